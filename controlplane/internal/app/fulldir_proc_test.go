package app

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestFullDataDirOneLine (issue 23 item 6): kvc-controlplane with its embedded etcd on a full
// filesystem (a 1 MiB tmpfs filled up; the test needs to be root to mount it) exits 1 with one
// error line naming the data dir — it panicked inside etcd ("failed to open database") with a
// stack trace and exit status 2.
func TestFullDataDirOneLine(t *testing.T) {
	if testing.Short() {
		t.Skip("real process")
	}
	mnt := t.TempDir()
	if err := syscall.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount a small tmpfs (needs root): %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(mnt, syscall.MNT_DETACH) })
	fill, err := os.Create(filepath.Join(mnt, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := fill.Write(make([]byte, 64<<10)); err != nil {
			break // full
		}
	}
	_ = fill.Close()
	bins := procBinaries(t)
	dir := filepath.Join(mnt, "etcd")
	cmd := exec.Command(bins["kvc-controlplane"], "--node-id", "x", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--data-dir", dir, "--insecure")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("still running on a full data dir:\n%s", stderr.String())
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1 {
		t.Fatalf("exit %v, want status 1:\n%s", err, stderr.String())
	}
	out := stderr.String()
	if strings.Contains(out, "panic") || strings.Contains(out, "goroutine ") {
		t.Fatalf("a panic and a stack trace:\n%s", out)
	}
	var named int
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if strings.Contains(l, dir) {
			named++
			if !strings.Contains(l, `"level":"error"`) || !strings.Contains(l, "free") {
				t.Fatalf("the line naming %s is not an error saying it is full: %s", dir, l)
			}
		}
	}
	if named != 1 {
		t.Fatalf("%d lines name %s, want one:\n%s", named, dir, out)
	}
}
