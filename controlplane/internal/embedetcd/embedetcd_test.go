package embedetcd

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

func TestStartRestartKeepsData(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	cfg := Config{Name: "cp", Dir: dir, ClientAddr: "127.0.0.1:0", PeerAddr: "127.0.0.1:0"}
	put := func(srv *Server, k, v string) string {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.ClientURL()}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			t.Fatal(err)
		}
		defer cli.Close()
		if v != "" {
			if _, err := cli.Put(ctx, k, v); err != nil {
				t.Fatal(err)
			}
		}
		resp, err := cli.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 0 {
			return ""
		}
		return string(resp.Kvs[0].Value)
	}
	srv, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if srv.ClientAddr() == "" || srv.ClientAddr() == "127.0.0.1:0" {
		t.Fatalf("client addr %q not resolved", srv.ClientAddr())
	}
	put(srv, "k", "v")
	srv.Close()
	srv2, err := Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv2.Close()
	if got := put(srv2, "k", ""); got != "v" {
		t.Fatalf("after restart k = %q", got)
	}
	if _, err := Start(ctx, Config{Name: "x", Dir: t.TempDir(), ClientAddr: "nope", PeerAddr: "127.0.0.1:0"}); err == nil {
		t.Fatal("bad address accepted")
	}
}
