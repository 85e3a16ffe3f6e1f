package launch

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"
)

// Restartable is one Spec run again and again: a process that a fault test kills and starts
// again with the same arguments (the same fixed ports, FreeAddr, so every peer's address list
// stays valid). Each Start is a new Process; the log is appended across the runs, each after a
// line naming its start. Its methods are safe for concurrent use; those of a process act on
// the latest run (none before the first Start: not alive, pid 0).
type Restartable struct {
	spec Spec

	mu     sync.Mutex
	cur    *Process
	starts int
}

// NewRestartable returns s, not started (its log is always appended: Spec.AppendLog).
func NewRestartable(s Spec) *Restartable {
	s.AppendLog = true
	s.Args = append([]string(nil), s.Args...)
	return &Restartable{spec: s}
}

// Name is the Spec's name.
func (r *Restartable) Name() string { return r.spec.Name }

// Spec is what every run starts (a copy).
func (r *Restartable) Spec() Spec {
	s := r.spec
	s.Args = append([]string(nil), s.Args...)
	s.Env = append([]string(nil), s.Env...)
	return s
}

// LogPath is the log every run appends to (Dir/Name.log).
func (r *Restartable) LogPath() string { return filepath.Join(r.spec.Dir, r.spec.Name+".log") }

// Current is the latest run, nil before the first Start.
func (r *Restartable) Current() *Process {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cur
}

// Starts is how many times Start started the process.
func (r *Restartable) Starts() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.starts
}

// Start starts a new run without waiting for it to be ready; it fails while the latest run
// is still alive.
func (r *Restartable) Start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cur != nil && r.cur.Alive() {
		return fmt.Errorf("%s: already running (pid %d)", r.spec.Name, r.cur.PID)
	}
	if r.spec.Dir != "" && r.spec.Name != "" {
		if lf, err := os.OpenFile(r.LogPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
			fmt.Fprintf(lf, "=== launch: start %d of %s at %s\n", r.starts+1, r.spec.Name, time.Now().UTC().Format(time.RFC3339Nano))
			_ = lf.Close()
		}
	}
	p, err := Start(r.spec)
	if err != nil {
		return err
	}
	r.cur = p
	r.starts++
	return nil
}

// WaitReady waits for the latest run's ready file (Process.WaitReady); a run that exits first
// fails the wait with its log's tail.
func (r *Restartable) WaitReady(ctx context.Context) (map[string]any, error) {
	p := r.Current()
	if p == nil {
		return nil, fmt.Errorf("%s: never started", r.spec.Name)
	}
	return p.WaitReady(ctx)
}

// StartReady starts a new run and waits up to limit for it to be ready.
func (r *Restartable) StartReady(ctx context.Context, limit time.Duration) error {
	if err := r.Start(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	_, err := r.WaitReady(ctx)
	return err
}

// Alive reports whether the latest run still runs.
func (r *Restartable) Alive() bool {
	p := r.Current()
	return p != nil && p.Alive()
}

// PID is the running process's id (0 when none runs).
func (r *Restartable) PID() int {
	if p := r.Current(); p != nil && p.Alive() {
		return p.PID
	}
	return 0
}

// Signal sends sig to the latest run without waiting (SIGSTOP, SIGCONT); false when none runs.
func (r *Restartable) Signal(sig syscall.Signal) bool {
	p := r.Current()
	return p != nil && p.Signal(sig)
}

// Kill sends SIGKILL to the latest run and waits for its exit (nothing when never started).
func (r *Restartable) Kill() {
	if p := r.Current(); p != nil {
		p.Kill()
	}
}

// Stop stops the latest run as Process.Stop does (nil when none runs).
func (r *Restartable) Stop(grace time.Duration) error {
	p := r.Current()
	if p == nil {
		return nil
	}
	return p.Stop(grace)
}

// Readier is a process whose readiness can be awaited (a Process, a Restartable).
type Readier interface {
	WaitReady(ctx context.Context) (map[string]any, error)
}

// WaitReadyAll waits for every process's ready file at once, each up to limit; the error joins
// every process's that did not get ready (nil when all did).
func WaitReadyAll[R Readier](ctx context.Context, limit time.Duration, ps ...R) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	errs := make([]error, len(ps))
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Go(func() { _, errs[i] = p.WaitReady(ctx) })
	}
	wg.Wait()
	return errors.Join(errs...)
}
