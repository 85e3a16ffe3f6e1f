package cluster

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests when a goroutine they started is still running at the end.
// (The child-process lifecycle itself is pkg/launch's, tested there.)
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

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
