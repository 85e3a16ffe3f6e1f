package launch

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

const helperEnv = "LAUNCH_TEST_HELPER"

// TestMain turns the test binary into a fake kvc-* process when helperEnv is set; else it runs
// the tests and fails them when a goroutine they started is still running at the end.
func TestMain(m *testing.M) {
	if mode := os.Getenv(helperEnv); mode != "" {
		os.Exit(helper(mode, os.Args[1:]))
	}
	goleak.VerifyTestMain(m)
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
	fmt.Println("helper starting", mode, "KVC_LEAK="+os.Getenv("KVC_LEAK"), "EXTRA="+os.Getenv("EXTRA"))
	switch mode {
	case "die":
		fmt.Println("fatal: cannot bind 127.0.0.1:1 (pretend)")
		return 3
	case "ready", "stubborn", "badexit":
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
		if mode == "badexit" {
			return 7
		}
		return 0
	case "silent":
		<-sig
		return 0
	case "usage": // a flag package's -h output
		fmt.Println("Usage of helper:\n  -insecure\n    \tplaintext gRPC\n  -tls-cert string\n    \tcertificate")
		return 0
	}
	return 5
}

func startHelper(t *testing.T, mode string, s Spec) *Process {
	t.Helper()
	t.Setenv(helperEnv, mode)
	if s.Name == "" {
		s.Name = "h-" + mode
	}
	s.Bin, s.Args = os.Args[0], []string{"--x", "y"}
	if s.Dir == "" {
		s.Dir = t.TempDir()
	}
	p, err := Start(s)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Kill)
	return p
}

func TestProcessLifecycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	t.Run("ready then SIGTERM", func(t *testing.T) {
		t.Setenv("KVC_LEAK", "parent's")
		p := startHelper(t, "ready", Spec{Env: []string{"EXTRA=given"}})
		m, err := p.WaitReady(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m["http_addr"] != "127.0.0.1:9" || p.ReadyString("http_addr") != "127.0.0.1:9" {
			t.Fatalf("ready %v", p.Ready())
		}
		if err := p.Stop(10 * time.Second); err != nil {
			t.Fatal(err)
		}
		log := p.Tail(5)
		if p.Alive() || !strings.Contains(log, "helper stopping") {
			t.Fatalf("alive %v, log %q", p.Alive(), log)
		}
		if !strings.Contains(log, "KVC_LEAK= ") || !strings.Contains(log, "EXTRA=given") {
			t.Fatalf("child environment: KVC_* must not reach it, Spec.Env must: %q", log)
		}
	})
	t.Run("exits before ready", func(t *testing.T) {
		p := startHelper(t, "die", Spec{})
		_, err := p.WaitReady(ctx)
		if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "cannot bind") {
			t.Fatalf("want exit error with log tail, got %v", err)
		}
	})
	t.Run("never ready", func(t *testing.T) {
		p := startHelper(t, "silent", Spec{})
		sctx, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer scancel()
		if _, err := p.WaitReady(sctx); err == nil || !strings.Contains(err.Error(), "not ready") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("ignores SIGTERM", func(t *testing.T) {
		p := startHelper(t, "stubborn", Spec{})
		if _, err := p.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if err := p.Stop(200 * time.Millisecond); !errors.Is(err, ErrKilled) {
			t.Fatalf("got %v", err)
		}
		if p.Alive() {
			t.Fatal("still alive")
		}
	})
	t.Run("unclean exit on SIGTERM", func(t *testing.T) {
		p := startHelper(t, "badexit", Spec{})
		if _, err := p.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
		if err := p.Stop(10 * time.Second); err == nil || !strings.Contains(err.Error(), "uncleanly") {
			t.Fatalf("got %v", err)
		}
	})
	t.Run("started again appends its log", func(t *testing.T) {
		dir := t.TempDir()
		for range 2 {
			p := startHelper(t, "die", Spec{Name: "again", Dir: dir, AppendLog: true})
			<-p.Exited()
		}
		b, err := os.ReadFile(filepath.Join(dir, "again.log"))
		if err != nil || strings.Count(string(b), "helper starting") != 2 {
			t.Fatalf("log %q (%v): want both runs", b, err)
		}
	})
}

func TestStartRejectsAnIncompleteSpec(t *testing.T) {
	for _, s := range []Spec{{Bin: "x", Dir: "/tmp"}, {Name: "x", Dir: "/tmp"}, {Name: "x", Bin: "x"}} {
		if _, err := Start(s); err == nil || !strings.Contains(err.Error(), "required") {
			t.Errorf("%+v: %v", s, err)
		}
	}
	if _, err := Start(Spec{Name: "x", Bin: filepath.Join(t.TempDir(), "none"), Dir: t.TempDir()}); err == nil {
		t.Error("a missing binary started")
	}
}

func TestWaitFor(t *testing.T) {
	closed := make(chan struct{})
	close(closed)
	tests := []struct {
		name string
		gone <-chan struct{}
		hold int32 // cond holds from this call on (0: never)
		ctx  time.Duration
		want error
	}{
		{"holds at once", nil, 1, time.Second, nil},
		{"holds on the third check", nil, 3, 10 * time.Second, nil},
		{"never holds", nil, 0, 50 * time.Millisecond, context.DeadlineExceeded},
		{"process gone", closed, 0, 10 * time.Second, ErrExited},
		{"holds as the process goes", closed, 2, 10 * time.Second, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), tt.ctx)
			defer cancel()
			var calls atomic.Int32
			err := WaitFor(ctx, tt.gone, time.Millisecond, func() bool { return tt.hold > 0 && calls.Add(1) >= tt.hold })
			if !errors.Is(err, tt.want) && !(err == nil && tt.want == nil) {
				t.Fatalf("err %v, want %v", err, tt.want)
			}
		})
	}
}

// fakeT records what StartT and WaitForT do with a test.
type fakeT struct {
	*testing.T
	fatal    string
	cleanups []func()
}

func (f *fakeT) Fatalf(format string, args ...any) {
	f.fatal = fmt.Sprintf(format, args...)
	panic(f) // stops the helper as t.Fatal's Goexit would
}
func (f *fakeT) Cleanup(fn func()) { f.cleanups = append(f.cleanups, fn) }

func run(f *fakeT, fn func()) {
	defer func() {
		if r := recover(); r != nil && r != any(f) {
			panic(r)
		}
	}()
	fn()
}

func TestStartTAndWaitForT(t *testing.T) {
	t.Setenv(helperEnv, "ready")
	f := &fakeT{T: t}
	var p *Process
	run(f, func() { p = StartT(f, Spec{Name: "h", Bin: os.Args[0]}, 20*time.Second) })
	if f.fatal != "" || p == nil || p.ReadyString("http_addr") != "127.0.0.1:9" || len(f.cleanups) != 1 {
		t.Fatalf("StartT: fatal %q, process %v, %d cleanups", f.fatal, p, len(f.cleanups))
	}
	f.cleanups[0]()
	if p.Alive() {
		t.Fatal("the cleanup left the process running")
	}

	t.Setenv(helperEnv, "die")
	f = &fakeT{T: t}
	run(f, func() { StartT(f, Spec{Name: "d", Bin: os.Args[0]}, 20*time.Second) })
	if !strings.Contains(f.fatal, "exited before it was ready") {
		t.Fatalf("StartT of a process that dies: %q", f.fatal)
	}
	for _, c := range f.cleanups {
		c()
	}

	f = &fakeT{T: t}
	run(f, func() { WaitForT(f, "never", 30*time.Millisecond, time.Millisecond, func() bool { return false }) })
	if !strings.Contains(f.fatal, "timed out waiting for never") {
		t.Fatalf("WaitForT: %q", f.fatal)
	}
}
