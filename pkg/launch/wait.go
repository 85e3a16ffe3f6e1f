package launch

import (
	"context"
	"errors"
	"time"
)

// ErrExited is WaitFor's error when gone closed before the condition held.
var ErrExited = errors.New("exited")

// WaitFor is the one wait helper: it checks cond at once and then every tick until it holds
// (nil), ctx ends (ctx.Err()) or gone closes (ErrExited; a nil gone never closes). cond reads
// what another process shows (a file, an endpoint): what cannot be waited on by a channel.
func WaitFor(ctx context.Context, gone <-chan struct{}, tick time.Duration, cond func() bool) error {
	t := time.NewTicker(tick)
	defer t.Stop()
	for !cond() {
		select {
		case <-gone:
			if cond() {
				return nil
			}
			return ErrExited
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// TB is the part of testing.TB the test helpers use (this package does not import testing:
// kvc-local and kvc-bench link it).
type TB interface {
	Helper()
	Cleanup(func())
	Failed() bool
	Fatalf(format string, args ...any)
	Logf(format string, args ...any)
	TempDir() string
}

// WaitForT is WaitFor for a test: it fails the test when cond does not hold within d.
func WaitForT(t TB, what string, d, tick time.Duration, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	if err := WaitFor(ctx, nil, tick, cond); err != nil {
		t.Fatalf("timed out waiting for %s (%s)", what, d)
	}
}

// StartT starts s for a test and waits up to readyIn for its ready file (s.Dir defaults to a
// temporary directory of the test). The process is stopped when the test ends (SIGTERM, then
// SIGKILL after StopGrace), and its log's tail is logged when the test failed.
func StartT(t TB, s Spec, readyIn time.Duration) *Process {
	t.Helper()
	if s.Bin == "" {
		t.Fatalf("binary for %s not available", s.Name)
	}
	if s.Dir == "" {
		s.Dir = t.TempDir()
	}
	p, err := Start(s)
	if err != nil {
		t.Fatalf("%v", err)
	}
	t.Cleanup(func() {
		_ = p.Stop(p.grace())
		if t.Failed() {
			t.Logf("---- %s log (tail) ----\n%s", p.Name, p.Tail(80))
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), readyIn)
	defer cancel()
	if _, err := p.WaitReady(ctx); err != nil {
		t.Fatalf("%v", err)
	}
	return p
}
