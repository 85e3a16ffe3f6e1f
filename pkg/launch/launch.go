package launch

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Spec says what to run.
type Spec struct {
	// Name names the process in errors, its log (Dir/Name.log) and its ready file
	// (Dir/Name.ready.json).
	Name string
	// Bin is the executable; Args its arguments, without --ready-file (Start adds it).
	Bin  string
	Args []string
	// Dir holds the log and the ready file (it must exist).
	Dir string
	// Env is added to the child's environment (ChildEnv), replacing variables of the same name.
	Env []string
	// AppendLog appends to the log instead of truncating it (a process started again keeps
	// the log of its earlier runs).
	AppendLog bool
	// NoReadyFile leaves --ready-file out of the arguments (a program that has no such flag;
	// WaitReady then cannot be used).
	NoReadyFile bool
}

// Process is one started child. Its methods are safe for concurrent use.
type Process struct {
	Name    string
	PID     int
	LogPath string
	// ReadyPath is the ready file the process was told to write (pkg/obs.WriteReadyFile).
	ReadyPath string
	// StopGrace is how long StartT's cleanup waits after SIGTERM before SIGKILL (default 10 s).
	StopGrace time.Duration

	cmd    *exec.Cmd
	exited chan struct{}

	mu      sync.Mutex
	exitErr error
	ready   map[string]any
}

// ChildEnv is the parent's environment without KVC_* variables, so that nothing set for the
// parent (a ready file, an address) leaks into a child (children are configured by flags only),
// nor the parent's systemd notify socket and watchdog: a child does not speak for it.
func ChildEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(kv, "KVC_") && k != "NOTIFY_SOCKET" && k != "WATCHDOG_USEC" && k != "WATCHDOG_PID" {
			out = append(out, kv)
		}
	}
	return out
}

// Start starts the process, without waiting for it to be ready; stdout and stderr go to its
// log. The child gets SIGKILL when the parent dies and a process group of its own, so a
// terminal's Ctrl-C reaches only the parent, which stops its children in order.
func Start(s Spec) (*Process, error) {
	if s.Name == "" || s.Bin == "" || s.Dir == "" {
		return nil, fmt.Errorf("launch: Name, Bin and Dir are required (name %q, bin %q, dir %q)", s.Name, s.Bin, s.Dir)
	}
	logPath := filepath.Join(s.Dir, s.Name+".log")
	flags := os.O_CREATE | os.O_WRONLY | os.O_TRUNC
	if s.AppendLog {
		flags = os.O_CREATE | os.O_WRONLY | os.O_APPEND
	}
	lf, err := os.OpenFile(logPath, flags, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: log file: %w", s.Name, err)
	}
	p := &Process{Name: s.Name, LogPath: logPath, exited: make(chan struct{})}
	args := append([]string(nil), s.Args...)
	if !s.NoReadyFile {
		p.ReadyPath = filepath.Join(s.Dir, s.Name+".ready.json")
		_ = os.Remove(p.ReadyPath)
		args = append(args, "--ready-file", p.ReadyPath)
	}
	cmd := exec.Command(s.Bin, args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Env = ChildEnv()
	for _, kv := range s.Env {
		k, _, _ := strings.Cut(kv, "=")
		cmd.Env = slices.DeleteFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, k+"=") })
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = lf.Close()
		return nil, fmt.Errorf("%s: start %s: %w", s.Name, s.Bin, err)
	}
	p.cmd, p.PID = cmd, cmd.Process.Pid
	go func() {
		err := cmd.Wait()
		_ = lf.Close()
		p.mu.Lock()
		p.exitErr = err
		p.mu.Unlock()
		close(p.exited)
	}()
	return p, nil
}

// Exited is closed when the process has exited.
func (p *Process) Exited() <-chan struct{} { return p.exited }

// Alive reports whether the process still runs.
func (p *Process) Alive() bool {
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// ExitErr is cmd.Wait's error once the process has exited (nil before, and after exit 0).
func (p *Process) ExitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitErr
}

// State is the exited process's state (exit status, rusage); nil while it runs.
func (p *Process) State() *os.ProcessState {
	select {
	case <-p.exited:
		return p.cmd.ProcessState
	default:
		return nil
	}
}

// Ready is the ready file's content once WaitReady returned (nil before).
func (p *Process) Ready() map[string]any {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ready
}

// ReadyString is a string field of the ready file ("" when absent).
func (p *Process) ReadyString(key string) string {
	s, _ := p.Ready()[key].(string)
	return s
}

// WaitReady waits until the ready file holds a JSON object and returns it.
func (p *Process) WaitReady(ctx context.Context) (map[string]any, error) {
	if p.ReadyPath == "" {
		return nil, fmt.Errorf("%s: started without a ready file", p.Name)
	}
	m, err := p.WaitJSON(ctx, p.ReadyPath, "ready")
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.ready = m
	p.mu.Unlock()
	return m, nil
}

// WaitJSON polls path, a file the process writes atomically, until it holds a JSON object;
// what says what the file means ("ready", "listening") in errors. It fails at once, with the
// log's tail, when the process exits first, and when ctx ends.
func (p *Process) WaitJSON(ctx context.Context, path, what string) (map[string]any, error) {
	var m map[string]any
	var bad error
	err := WaitFor(ctx, p.exited, 20*time.Millisecond, func() bool {
		b, err := os.ReadFile(path)
		if err != nil || len(bytes.TrimSpace(b)) == 0 {
			return false
		}
		bad = json.Unmarshal(b, &m)
		return true
	})
	switch {
	case bad != nil:
		return nil, fmt.Errorf("%s: bad %s file %s: %v", p.Name, what, path, bad)
	case errors.Is(err, ErrExited):
		return nil, fmt.Errorf("%s (pid %d) exited before it was %s (%v); last log lines of %s:\n%s",
			p.Name, p.PID, what, p.ExitErr(), p.LogPath, p.Tail(25))
	case err != nil:
		return nil, fmt.Errorf("%s (pid %d) not %s: %w; last log lines of %s:\n%s",
			p.Name, p.PID, what, err, p.LogPath, p.Tail(25))
	}
	return m, nil
}

// Signal sends sig without waiting (SIGSTOP, SIGCONT); false when the process has exited.
func (p *Process) Signal(sig syscall.Signal) bool {
	if !p.Alive() {
		return false
	}
	return p.cmd.Process.Signal(sig) == nil
}

// ErrKilled is Stop's error (wrapped) when the process outlived its grace and was SIGKILLed.
var ErrKilled = errors.New("killed")

// Stop sends SIGTERM, waits up to grace, then SIGKILLs. Its error says why the stop was not
// clean: the process did not exit within grace (ErrKilled), or exited other than 0 on SIGTERM.
// A process that had already exited is not an error.
func (p *Process) Stop(grace time.Duration) error {
	if !p.Alive() {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.exited:
		var ee *exec.ExitError
		if err := p.ExitErr(); err != nil && !(errors.As(err, &ee) && ee.Exited() && ee.ExitCode() == 0) {
			return fmt.Errorf("%s exited uncleanly on SIGTERM: %v", p.Name, err)
		}
		return nil
	case <-t.C:
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
	return fmt.Errorf("%s did not stop within %s of SIGTERM: %w", p.Name, grace, ErrKilled)
}

// Kill sends SIGKILL and waits for the exit.
func (p *Process) Kill() {
	if p.Alive() {
		_ = p.cmd.Process.Kill()
	}
	<-p.exited
}

// Log is everything the process wrote to its log so far ("" when it cannot be read).
func (p *Process) Log() string {
	b, _ := os.ReadFile(p.LogPath)
	return string(b)
}

// Tail returns the last n lines of the process's log.
func (p *Process) Tail(n int) string {
	b, err := os.ReadFile(p.LogPath)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (p *Process) grace() time.Duration {
	if p.StopGrace > 0 {
		return p.StopGrace
	}
	return 10 * time.Second
}
