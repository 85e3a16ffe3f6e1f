package etcdtest

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

func TestStartSingle(t *testing.T) {
	dir := t.TempDir()
	logPath := filepath.Join(dir, "etcd.log")
	e, ep, err := StartSingle(dir, logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if !strings.HasPrefix(ep, "http://127.0.0.1:") {
		t.Fatalf("endpoint %q", ep)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	if resp, err := cli.Get(ctx, "k"); err != nil || len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("get: %v %v", resp, err)
	}
	if _, err := os.Stat(filepath.Join(dir, "etcd-0", "member")); err != nil {
		t.Fatalf("data not under the given dir: %v", err)
	}
	if _, err := os.Stat(logPath); err != nil {
		t.Fatalf("etcd log: %v", err)
	}
}
