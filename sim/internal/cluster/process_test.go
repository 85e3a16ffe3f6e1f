package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

const helperEnv = "CLUSTER_TEST_HELPER"

// TestMain turns the test binary into a fake kvc-* process when helperEnv is set.
func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helper(mode, os.Args[1:]))
	}
	os.Exit(m.Run())
}

func helper(mode string, args []string) int {
	var ready string
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "--ready-file" {
			ready = args[i+1]
		}
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM)
	fmt.Println("helper starting", mode)
	switch mode {
	case "die":
		fmt.Println("fatal: cannot bind 127.0.0.1:1 (pretend)")
		return 3
	case "ready", "stubborn":
		b, _ := json.Marshal(map[string]any{"pid": os.Getpid(), "http_addr": "127.0.0.1:9"})
		if err := os.WriteFile(ready, b, 0o644); err != nil {
			return 4
		}
		if mode == "stubborn" {
			signal.Ignore(syscall.SIGTERM)
			select {}
		}
		<-sig
		fmt.Println("helper stopping")
		return 0
	case "silent":
		<-sig
		return 0
	}
	return 5
}

func spawnHelper(t *testing.T, mode string) *Process {
	t.Helper()
	t.Setenv(helperEnv, mode)
	p, err := spawn(os.Args[0], "h-"+mode, "test", t.TempDir(), []string{"--x", "y"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.kill)
	return p
}

func TestProcessLifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	t.Run("ready then SIGTERM", func(t *testing.T) {
		p := spawnHelper(t, "ready")
		if err := p.waitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if p.ReadyString("http_addr") != "127.0.0.1:9" {
			t.Fatalf("ready %v", p.Ready)
		}
		if err := p.stop(10 * time.Second); err != nil {
			t.Fatal(err)
		}
		if p.Alive() || !strings.Contains(p.logTail(5), "helper stopping") {
			t.Fatalf("alive %v, log %q", p.Alive(), p.logTail(5))
		}
	})
	t.Run("exits before ready", func(t *testing.T) {
		p := spawnHelper(t, "die")
		err := p.waitReady(ctx)
		if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "cannot bind") {
			t.Fatalf("want exit error with log tail, got %v", err)
		}
	})
	t.Run("never ready", func(t *testing.T) {
		p := spawnHelper(t, "silent")
		sctx, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer scancel()
		if err := p.waitReady(sctx); err == nil || !strings.Contains(err.Error(), "not ready") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("ignores SIGTERM", func(t *testing.T) {
		p := spawnHelper(t, "stubborn")
		if err := p.waitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if err := p.stop(200 * time.Millisecond); err == nil || !strings.Contains(err.Error(), "killed") {
			t.Fatalf("got %v", err)
		}
		if p.Alive() {
			t.Fatal("still alive")
		}
	})
}

func TestStartRejectsBadConfig(t *testing.T) {
	dir := t.TempDir()
	if _, err := Start(context.Background(), Config{BinDir: dir, WorkDir: filepath.Join(dir, "w"), Gateway: true}); err == nil ||
		!strings.Contains(err.Error(), "kvc-controlplane") || !strings.Contains(err.Error(), "kvc-gateway") {
		t.Fatalf("missing binaries: %v", err)
	}
	if _, err := Start(context.Background(), Config{BinDir: dir}); err == nil || !strings.Contains(err.Error(), "WorkDir") {
		t.Fatalf("missing work dir: %v", err)
	}
	if _, err := Start(context.Background(), Config{BinDir: dir, WorkDir: dir, Decode: 99}); err == nil {
		t.Fatal("99 decode workers accepted")
	}
}

// A relative WorkDir (or BinDir) works: the cluster makes both absolute before anything uses
// them, so children started elsewhere and gRPC's unix:// dials get absolute socket paths.
func TestConfigDefaultsAbsolutePaths(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, work, bin string
	}{
		{"relative", "run/w", "bin"},
		{"dot-relative", "./w", "../bin"},
		{"absolute", filepath.Join(wd, "w"), filepath.Join(wd, "bin")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{WorkDir: tt.work, BinDir: tt.bin}
			if err := cfg.defaults(); err != nil {
				t.Fatal(err)
			}
			want := func(p string) string {
				if filepath.IsAbs(p) {
					return filepath.Clean(p)
				}
				return filepath.Join(wd, p)
			}
			if cfg.WorkDir != want(tt.work) || cfg.BinDir != want(tt.bin) {
				t.Fatalf("work %q bin %q; want %q %q", cfg.WorkDir, cfg.BinDir, want(tt.work), want(tt.bin))
			}
			c := &Cluster{cfg: cfg}
			if f := c.addrFile("sim-decode-0"); !filepath.IsAbs(f) {
				t.Fatalf("addr file %q not absolute", f)
			}
		})
	}
}

func TestRepoRoot(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "integrations", "refworker", "kvc_refworker"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ bin, want string }{
		{filepath.Join(root, "bin"), root},
		{filepath.Join(root, "bin", "real"), root},
		{filepath.Join(t.TempDir(), "elsewhere", "bin"), ""}, // not found: bin's parent (or the cwd's repo)
	} {
		got := repoRoot(tc.bin)
		if tc.want != "" && got != tc.want {
			t.Errorf("repoRoot(%s) = %s, want %s", tc.bin, got, tc.want)
		}
	}
}

func TestWorkerKind(t *testing.T) {
	for _, tc := range []struct {
		kind    string
		wantErr bool
	}{{"", false}, {"sim", false}, {"refworker", false}, {"vllm", true}} {
		cfg := Config{BinDir: t.TempDir(), WorkDir: t.TempDir(), WorkerKind: tc.kind}
		err := cfg.defaults()
		if (err != nil) != tc.wantErr {
			t.Errorf("kind %q: err %v", tc.kind, err)
		}
		if err == nil && tc.kind == "refworker" && (cfg.RefworkerPython != "python3" || len(cfg.RefworkerPath) != 2) {
			t.Errorf("refworker defaults: %+v", cfg)
		}
	}
}
