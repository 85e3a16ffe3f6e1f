package embedetcd

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/kvcentric/kvcentric/pkg/kvstore"
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

// TestLimits is issue 16 finding 5 at the embedded etcd: periodic auto-compaction removes
// overwritten revisions, and past the backend quota writes are refused (kvstore.ErrNoSpace,
// which the admin service answers RESOURCE_EXHAUSTED) instead of growing without bound.
func TestLimits(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	client := func(srv *Server) *clientv3.Client {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.ClientURL()}, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cli.Close() })
		return cli
	}
	t.Run("auto-compaction", func(t *testing.T) {
		srv, err := Start(ctx, Config{Name: "c", Dir: t.TempDir(), ClientAddr: "127.0.0.1:0", PeerAddr: "127.0.0.1:0", CompactionRetention: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		cli := client(srv)
		first, err := cli.Put(ctx, "k", "v0")
		if err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for i := 1; ; i++ {
			if _, err := cli.Put(ctx, "k", fmt.Sprint("v", i)); err != nil {
				t.Fatal(err)
			}
			_, err := cli.Get(ctx, "k", clientv3.WithRev(first.Header.Revision))
			if errors.Is(err, rpctypes.ErrCompacted) {
				t.Logf("revision %d compacted after %d overwrites", first.Header.Revision, i)
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("revision %d still readable after 20s with a 1s retention (err %v)", first.Header.Revision, err)
			}
			time.Sleep(100 * time.Millisecond) // a write every 100 ms until the compactor has run
		}
	})
	t.Run("quota", func(t *testing.T) {
		const quota = 4 << 20
		srv, err := Start(ctx, Config{Name: "q", Dir: t.TempDir(), ClientAddr: "127.0.0.1:0", PeerAddr: "127.0.0.1:0", QuotaBytes: quota, CompactionRetention: -1})
		if err != nil {
			t.Fatal(err)
		}
		defer srv.Close()
		store, err := kvstore.New(client(srv), kvstore.WithPrefix("/q/"))
		if err != nil {
			t.Fatal(err)
		}
		sess, err := concurrency.NewSession(store.Client(), concurrency.WithTTL(5))
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		el := concurrency.NewElection(sess, store.ElectionPrefix())
		if err := el.Campaign(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		fence := kvstore.Fence{Key: el.Key(), Rev: el.Rev()}
		val := make([]byte, 512<<10)
		for i := 0; i < 4*quota/len(val); i++ {
			err := store.Apply(ctx, fence, []kvstore.Op{{Key: store.PolicyKey(), Value: val}})
			if errors.Is(err, kvstore.ErrNoSpace) {
				t.Logf("write %d (%d KiB each) refused at a %d MiB quota: %v", i, len(val)>>10, quota>>20, err)
				return
			}
			if err != nil {
				t.Fatalf("write %d: %v", i, err)
			}
		}
		t.Fatalf("%d MiB written over a %d MiB quota without a refusal", 4*quota>>20, quota>>20)
	})
}
