package clustertest

import (
	"os"
	"path/filepath"
)

// TB is the part of testing.TB that BinDir uses.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Skipf(format string, args ...any)
}

// BinDir is the directory of the built binaries: $KVC_BIN_DIR, else bin/ of the repository
// (the folder above the working directory that holds go.work). The test fails when
// KVC_BIN_DIR lacks one of need (under make test it is set, so the tests run) and is skipped
// when it is unset and bin/ lacks one (run make build).
func BinDir(t TB, need []string) string {
	t.Helper()
	dir := os.Getenv("KVC_BIN_DIR")
	if dir != "" {
		abs, err := filepath.Abs(dir)
		if err != nil {
			t.Fatalf("KVC_BIN_DIR=%s: %v", dir, err)
			return ""
		}
		if miss := missing(abs, need); len(miss) > 0 {
			t.Fatalf("KVC_BIN_DIR=%s lacks %v", dir, miss)
			return ""
		}
		return abs
	}
	root, err := repoRoot()
	if err != nil {
		t.Skipf("binaries not found (%v) and KVC_BIN_DIR unset; run make build", err)
		return ""
	}
	dir = filepath.Join(root, "bin")
	if miss := missing(dir, need); len(miss) > 0 {
		t.Skipf("binaries missing in %s (%v) and KVC_BIN_DIR unset; run make build", dir, miss)
		return ""
	}
	return dir
}

// missing lists the names of need that are not files in dir.
func missing(dir string, need []string) []string {
	var out []string
	for _, b := range need {
		if st, err := os.Stat(filepath.Join(dir, b)); err != nil || st.IsDir() {
			out = append(out, b)
		}
	}
	return out
}

// repoRoot is the nearest folder from the working directory up that holds go.work.
func repoRoot() (string, error) {
	d, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if st, err := os.Stat(filepath.Join(d, "go.work")); err == nil && !st.IsDir() {
			return d, nil
		}
		up := filepath.Dir(d)
		if up == d {
			return "", os.ErrNotExist
		}
		d = up
	}
}
