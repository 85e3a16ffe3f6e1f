package cluster

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
	"sync/atomic"
	"syscall"
	"time"
)

// Process is one child process of the cluster.
type Process struct {
	Name    string
	Role    string // controlplane, sidecar-prefill, sidecar-decode, sim-prefill, sim-decode, gateway
	PID     int
	Ready   map[string]any // its ready file, once ready
	LogPath string

	readyPath string
	cmd       *exec.Cmd
	logFile   *os.File
	exited    chan struct{}
	exitErr   error
	killed    atomic.Bool // killed on purpose (KillLeader): its exit is not a failure
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

// ReadyString returns a string field of the ready file ("" when absent).
func (p *Process) ReadyString(key string) string {
	s, _ := p.Ready[key].(string)
	return s
}

// childEnv is the parent's environment without KVC_* variables, so that nothing set for the
// supervisor (a ready file, an address) leaks into a child: children are configured by flags only.
// Nor the supervisor's systemd notify socket and watchdog: a child does not speak for it.
func childEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(kv, "KVC_") && k != "NOTIFY_SOCKET" && k != "WATCHDOG_USEC" && k != "WATCHDOG_PID" {
			out = append(out, kv)
		}
	}
	return out
}

// spawn starts bin with args (plus --ready-file), output to logDir/name.log.
func spawn(bin, name, role, logDir string, args []string) (*Process, error) {
	return spawnEnv(bin, name, role, logDir, args, nil)
}

// spawnEnv is spawn with extra environment variables (replacing the parent's of the same name).
func spawnEnv(bin, name, role, logDir string, args, env []string) (*Process, error) {
	logPath := filepath.Join(logDir, name+".log")
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: log file: %w", name, err)
	}
	readyPath := filepath.Join(logDir, name+".ready.json")
	_ = os.Remove(readyPath)
	args = append(append([]string(nil), args...), "--ready-file", readyPath)
	cmd := exec.Command(bin, args...)
	cmd.Stdout = lf
	cmd.Stderr = lf
	cmd.Env = childEnv()
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		cmd.Env = slices.DeleteFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, k+"=") })
		cmd.Env = append(cmd.Env, kv)
	}
	// Children die with the supervisor (SIGKILL when it goes away) and get their own process
	// group, so a terminal's Ctrl-C reaches only the supervisor, which then stops them in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = lf.Close()
		return nil, fmt.Errorf("%s: start %s: %w", name, bin, err)
	}
	p := &Process{Name: name, Role: role, PID: cmd.Process.Pid, LogPath: logPath, readyPath: readyPath,
		cmd: cmd, logFile: lf, exited: make(chan struct{})}
	go func() {
		p.exitErr = cmd.Wait()
		_ = lf.Close()
		close(p.exited)
	}()
	return p, nil
}

// logTail returns the last n lines of the process's log.
func (p *Process) logTail(n int) string {
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

// waitReady polls the ready file until it holds a JSON object, failing fast (with the log's
// tail) when the process exits first.
func (p *Process) waitReady(ctx context.Context) error {
	m, err := p.waitJSON(ctx, p.readyPath, "ready")
	if err != nil {
		return err
	}
	p.Ready = m
	return nil
}

// waitJSON polls path — a file the process writes atomically (obs.WriteReadyFile) — until it
// holds a JSON object; what says what the file means ("ready", "listening") in errors.
func (p *Process) waitJSON(ctx context.Context, path, what string) (map[string]any, error) {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(path); err == nil && len(bytes.TrimSpace(b)) > 0 {
			var m map[string]any
			if err := json.Unmarshal(b, &m); err != nil {
				return nil, fmt.Errorf("%s: bad %s file %s: %v", p.Name, what, path, err)
			}
			return m, nil
		}
		select {
		case <-p.exited:
			return nil, fmt.Errorf("%s (pid %d) exited before it was %s (%v); last log lines of %s:\n%s",
				p.Name, p.PID, what, p.exitErr, p.LogPath, p.logTail(25))
		case <-ctx.Done():
			return nil, fmt.Errorf("%s (pid %d) not %s: %w; last log lines of %s:\n%s",
				p.Name, p.PID, what, ctx.Err(), p.LogPath, p.logTail(25))
		case <-tick.C:
		}
	}
}

// stop sends SIGTERM, waits up to grace, then SIGKILLs. It reports an unclean exit.
func (p *Process) stop(grace time.Duration) error {
	if !p.Alive() {
		return nil
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.exited:
		var ee *exec.ExitError
		if p.exitErr != nil && !(errors.As(p.exitErr, &ee) && ee.Exited() && ee.ExitCode() == 0) {
			// A process that handles SIGTERM exits 0; anything else is worth reporting.
			return fmt.Errorf("%s exited uncleanly on SIGTERM: %v", p.Name, p.exitErr)
		}
		return nil
	case <-t.C:
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
	return fmt.Errorf("%s did not stop within %s of SIGTERM; killed", p.Name, grace)
}

// kill sends SIGKILL and waits for the exit.
func (p *Process) kill() {
	p.killed.Store(true)
	if p.Alive() {
		_ = p.cmd.Process.Kill()
	}
	<-p.exited
}
