package clustertest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeTB records BinDir's verdict instead of ending the test.
type fakeTB struct{ fatal, skip string }

func (f *fakeTB) Helper()                        {}
func (f *fakeTB) Fatalf(format string, a ...any) { f.fatal = fmt.Sprintf(format, a...) }
func (f *fakeTB) Skipf(format string, a ...any)  { f.skip = fmt.Sprintf(format, a...) }

func TestBinDir(t *testing.T) {
	need := []string{"kvc-a", "kvc-b"}
	// A repository: go.work at the root, the package three folders down, bin/ with what is built.
	mkRepo := func(t *testing.T, built ...string) (root, pkg string) {
		root = t.TempDir()
		pkg = filepath.Join(root, "sim", "internal", "x")
		for _, d := range []string{pkg, filepath.Join(root, "bin", "kvc-dir")} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(root, "go.work"), []byte("go 1.27\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, b := range built {
			if err := os.WriteFile(filepath.Join(root, "bin", b), nil, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		return root, pkg
	}
	tests := []struct {
		name        string
		built       []string
		env         func(root string) string // KVC_BIN_DIR ("" unset)
		need        []string
		want        func(root string) string
		fatal, skip string // what the message says ("" none)
	}{
		{name: "env, all built", built: need, env: func(r string) string { return filepath.Join(r, "bin") },
			want: func(r string) string { return filepath.Join(r, "bin") }},
		{name: "env relative", built: need, env: func(string) string { return "../../../bin" },
			want: func(r string) string { return filepath.Join(r, "bin") }},
		{name: "env lacks one", built: need[:1], env: func(r string) string { return filepath.Join(r, "bin") },
			fatal: "lacks [kvc-b]"},
		{name: "env names a folder as a binary", built: need, need: []string{"kvc-a", "kvc-dir"},
			env: func(r string) string { return filepath.Join(r, "bin") }, fatal: "lacks [kvc-dir]"},
		{name: "unset, repository's bin/ built", built: need, env: func(string) string { return "" },
			want: func(r string) string { return filepath.Join(r, "bin") }},
		{name: "unset, not built", built: need[1:], env: func(string) string { return "" }, skip: "missing in"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root, pkg := mkRepo(t, tt.built...)
			t.Setenv("KVC_BIN_DIR", tt.env(root))
			t.Chdir(pkg)
			n := need
			if tt.need != nil {
				n = tt.need
			}
			f := &fakeTB{}
			got := BinDir(f, n)
			if !strings.Contains(f.fatal, tt.fatal) || (tt.fatal == "") != (f.fatal == "") ||
				!strings.Contains(f.skip, tt.skip) || (tt.skip == "") != (f.skip == "") {
				t.Fatalf("fatal %q skip %q; want %q %q", f.fatal, f.skip, tt.fatal, tt.skip)
			}
			want := ""
			if tt.want != nil {
				want = tt.want(root)
			}
			if got != want {
				t.Fatalf("BinDir = %q, want %q", got, want)
			}
		})
	}
	t.Run("no repository", func(t *testing.T) {
		t.Setenv("KVC_BIN_DIR", "")
		t.Chdir(t.TempDir())
		f := &fakeTB{}
		if got := BinDir(f, need); got != "" || !strings.Contains(f.skip, "KVC_BIN_DIR unset") || f.fatal != "" {
			t.Fatalf("BinDir = %q, fatal %q skip %q", got, f.fatal, f.skip)
		}
	})
}
