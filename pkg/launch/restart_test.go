package launch

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestRestartable(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	t.Setenv(helperEnv, "ready")
	dir := t.TempDir()
	r := NewRestartable(Spec{Name: "r", Bin: os.Args[0], Args: []string{"--x", "y"}, Dir: dir})
	t.Cleanup(r.Kill)

	// Never started: nothing runs, nothing to wait for, nothing to stop.
	if _, err := r.WaitReady(ctx); err == nil || !strings.Contains(err.Error(), "never started") {
		t.Fatalf("WaitReady before Start: %v", err)
	}
	r.Kill()
	if r.Alive() || r.PID() != 0 || r.Signal(syscall.SIGCONT) || r.Stop(time.Second) != nil || r.Current() != nil {
		t.Fatal("a process that was never started looks alive")
	}

	if err := r.StartReady(ctx, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	first := r.PID()
	if first == 0 || !r.Alive() || r.Current().ReadyString("http_addr") != "127.0.0.1:9" {
		t.Fatalf("first run: pid %d, alive %v", first, r.Alive())
	}
	if err := r.Start(); err == nil || !strings.Contains(err.Error(), "already running") {
		t.Fatalf("Start while running: %v", err)
	}
	r.Kill()
	if r.Alive() || r.PID() != 0 {
		t.Fatal("alive after Kill")
	}
	if err := r.Start(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	if second := r.PID(); second == 0 || second == first || r.Starts() != 2 {
		t.Fatalf("second run: pid %d (first %d), %d starts", second, first, r.Starts())
	}
	if !r.Signal(syscall.SIGSTOP) || !r.Signal(syscall.SIGCONT) {
		t.Fatal("signals not sent to the running process")
	}
	if err := r.Stop(10 * time.Second); err != nil {
		t.Fatal(err)
	}
	log, err := os.ReadFile(filepath.Join(dir, "r.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"=== launch: start 1 of r at ", "=== launch: start 2 of r at ", "helper stopping"} {
		if !strings.Contains(string(log), want) {
			t.Errorf("log lacks %q:\n%s", want, log)
		}
	}
	if n := strings.Count(string(log), "helper starting"); n != 2 || r.LogPath() != filepath.Join(dir, "r.log") {
		t.Errorf("log %s has %d runs, want both", r.LogPath(), n)
	}
	if s := r.Spec(); !s.AppendLog || s.Name != "r" || len(s.Args) != 2 {
		t.Errorf("spec %+v", s)
	}
}

func TestWaitReadyAll(t *testing.T) {
	ctx := context.Background()
	start := func(t *testing.T, mode, name string) *Restartable {
		t.Helper()
		t.Setenv(helperEnv, mode)
		r := NewRestartable(Spec{Name: name, Bin: os.Args[0], Dir: t.TempDir()})
		if err := r.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(r.Kill)
		return r
	}
	t.Run("all ready", func(t *testing.T) {
		a, b := start(t, "ready", "a"), start(t, "ready", "b")
		if err := WaitReadyAll[Readier](ctx, 20*time.Second, a, b.Current()); err != nil {
			t.Fatal(err)
		}
		if a.Current().Ready() == nil || b.Current().Ready() == nil {
			t.Fatal("ready files not read")
		}
	})
	t.Run("one exits, one never ready", func(t *testing.T) {
		a, b, c := start(t, "ready", "a"), start(t, "die", "b"), start(t, "silent", "c")
		err := WaitReadyAll(ctx, 2*time.Second, a, b, c)
		if err == nil || !strings.Contains(err.Error(), "b (pid") || !strings.Contains(err.Error(), "exited before it was ready") ||
			!strings.Contains(err.Error(), "c (pid") || !strings.Contains(err.Error(), "not ready") || strings.Contains(err.Error(), "a (pid") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("none", func(t *testing.T) {
		if err := WaitReadyAll[*Process](ctx, time.Second); err != nil {
			t.Fatal(err)
		}
	})
}

// TestFreeAddr: the fixed ports are distinct, bindable and below the kernel's ephemeral range
// (where no outgoing connection or ":0" listener can take them first).
func TestFreeAddr(t *testing.T) {
	lo := ephemeralStart()
	seen := map[string]bool{}
	for range 20 {
		a, err := FreeAddr()
		if err != nil {
			t.Fatal(err)
		}
		if seen[a] {
			t.Fatalf("%s given twice", a)
		}
		seen[a] = true
		_, ps, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		if p, _ := strconv.Atoi(ps); p >= lo || p < 10000 {
			t.Fatalf("port %d outside [10000, %d)", p, lo)
		}
		l, err := net.Listen("tcp", a)
		if err != nil {
			t.Fatalf("%s not bindable: %v", a, err)
		}
		_ = l.Close()
	}
}

func TestSupportsFlag(t *testing.T) {
	t.Setenv(helperEnv, "usage")
	for _, tc := range []struct {
		bin, flag string
		want      bool
	}{
		{os.Args[0], "insecure", true},
		{os.Args[0], "tls-cert", true},
		{os.Args[0], "insec", false},
		{os.Args[0], "tls", false},
		{filepath.Join(t.TempDir(), "none"), "insecure", false},
	} {
		if got := SupportsFlag(tc.bin, tc.flag); got != tc.want {
			t.Errorf("SupportsFlag(%s, %q) = %v, want %v", filepath.Base(tc.bin), tc.flag, got, tc.want)
		}
	}
}
