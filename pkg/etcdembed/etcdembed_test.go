package etcdembed

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

func TestMemberConfig(t *testing.T) {
	tests := []struct {
		name    string
		in      MemberConfig
		wantErr string
		check   func(t *testing.T, c *embed.Config)
	}{
		{
			name: "single member defaults",
			in:   MemberConfig{Name: "a", Dir: "/d", ClientURL: "http://127.0.0.1:1", PeerURL: "http://127.0.0.1:2"},
			check: func(t *testing.T, c *embed.Config) {
				if c.InitialCluster != "a=http://127.0.0.1:2" || c.ClusterState != StateNew {
					t.Fatalf("cluster %q state %q", c.InitialCluster, c.ClusterState)
				}
				if c.AutoCompactionMode != "" && c.AutoCompactionRetention != "0" {
					t.Fatalf("compaction on by default: %q %q", c.AutoCompactionMode, c.AutoCompactionRetention)
				}
				if c.UnsafeNoFsync {
					t.Fatal("fsync off by default")
				}
			},
		},
		{
			name: "limits, restart, log file",
			in: MemberConfig{Name: "b", Dir: "/d", ClientURL: "http://127.0.0.1:1", PeerURL: "http://127.0.0.1:2",
				InitialCluster: "a=x,b=y", State: StateExisting, Token: "tok", LogPath: "/tmp/e.log",
				QuotaBytes: 1 << 20, CompactionRetention: time.Minute, NoFsync: true},
			check: func(t *testing.T, c *embed.Config) {
				if c.InitialCluster != "a=x,b=y" || c.ClusterState != StateExisting || c.InitialClusterToken != "tok" {
					t.Fatalf("cluster %q state %q token %q", c.InitialCluster, c.ClusterState, c.InitialClusterToken)
				}
				if c.QuotaBackendBytes != 1<<20 || c.AutoCompactionMode != embed.CompactorModePeriodic || c.AutoCompactionRetention != "1m0s" {
					t.Fatalf("quota %d compaction %q %q", c.QuotaBackendBytes, c.AutoCompactionMode, c.AutoCompactionRetention)
				}
				if !c.UnsafeNoFsync || c.LogLevel != "error" || len(c.LogOutputs) != 1 || c.LogOutputs[0] != "/tmp/e.log" {
					t.Fatalf("fsync off %v log %q %v", c.UnsafeNoFsync, c.LogLevel, c.LogOutputs)
				}
			},
		},
		{name: "no host", in: MemberConfig{Name: "c", ClientURL: "unix:sock", PeerURL: "http://127.0.0.1:2"}, wantErr: "must be scheme://host:port"},
		{name: "bad url", in: MemberConfig{Name: "d", ClientURL: "http://127.0.0.1:1", PeerURL: "http://[::1"}, wantErr: "peer url"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := tt.in.Config()
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, c)
		})
	}
}

func TestStartSingle(t *testing.T) {
	dir := t.TempDir()
	logPath := filepath.Join(dir, "etcd.log")
	e, ep, err := StartSingle(t.Context(), dir, logPath)
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

// A port another listener holds fails the start with an error IsAddrInUse recognises (the
// signal StartSingle and etcdtest retry on).
func TestStartMemberPortTaken(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ports, err := FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	_, err = StartMember(t.Context(), MemberConfig{
		Name:      "m0",
		Dir:       t.TempDir(),
		ClientURL: "http://" + l.Addr().String(),
		PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[0]),
	})
	if err == nil {
		t.Fatal("start on a taken port succeeded")
	}
	if !IsAddrInUse(err) {
		t.Fatalf("IsAddrInUse(%v) = false", err)
	}
	if IsAddrInUse(nil) || IsAddrInUse(fmt.Errorf("other")) {
		t.Fatal("IsAddrInUse true for nil or an unrelated error")
	}
}

func TestFreePortsDistinct(t *testing.T) {
	ports, err := FreePorts(8)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if p <= 0 || seen[p] {
			t.Fatalf("ports %v", ports)
		}
		seen[p] = true
	}
}

// TestCheckDir: a data dir that cannot hold a member (not enough room, a file in its place) is
// one error naming it; a usable one is made and passes.
func TestCheckDir(t *testing.T) {
	tmp := t.TempDir()
	file := filepath.Join(tmp, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		dir  string
		need uint64
		ok   bool
	}{
		{"usable, made", filepath.Join(tmp, "a", "b"), 1 << 10, true},
		{"not enough room", filepath.Join(tmp, "c"), 1 << 62, false},
		{"a file in its place", filepath.Join(file, "d"), 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckDir(tc.dir, tc.need)
			if (err == nil) != tc.ok {
				t.Fatalf("CheckDir(%s) = %v, want ok %v", tc.dir, err, tc.ok)
			}
			if err != nil && (!strings.Contains(err.Error(), tc.dir) || strings.Contains(err.Error(), "\n")) {
				t.Fatalf("error %q is not one line naming %s", err, tc.dir)
			}
		})
	}
}
