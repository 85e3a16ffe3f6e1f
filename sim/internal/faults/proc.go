package faults

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is one child process that the harness can kill and start again with the same
// arguments (the same fixed ports, so every peer's address list stays valid).
type proc struct {
	name string
	bin  string
	args []string // without --ready-file
	dir  string   // logs and ready files

	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{}
	exitEr error
	ready  map[string]any
	starts int
}

func (p *proc) readyPath() string { return filepath.Join(p.dir, p.name+".ready.json") }

// LogPath is where the process's stdout and stderr go (appended across restarts).
func (p *proc) LogPath() string { return filepath.Join(p.dir, p.name+".log") }

// spawn starts the process without waiting for it to be ready.
func (p *proc) spawn() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && !isClosed(p.exited) {
		return fmt.Errorf("%s: already running (pid %d)", p.name, p.cmd.Process.Pid)
	}
	_ = os.Remove(p.readyPath())
	lf, err := os.OpenFile(p.LogPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("%s: log: %w", p.name, err)
	}
	p.starts++
	fmt.Fprintf(lf, "=== faults harness: start %d of %s at %s\n", p.starts, p.name, time.Now().UTC().Format(time.RFC3339Nano))
	cmd := exec.Command(p.bin, append(append([]string(nil), p.args...), "--ready-file", p.readyPath())...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Env = childEnv()
	// The children die with the test process and never receive a terminal's signals.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = lf.Close()
		return fmt.Errorf("%s: start: %w", p.name, err)
	}
	exited := make(chan struct{})
	p.cmd, p.exited, p.ready, p.exitEr = cmd, exited, nil, nil
	go func() {
		err := cmd.Wait()
		_ = lf.Close()
		p.mu.Lock()
		p.exitEr = err
		p.mu.Unlock()
		close(exited)
	}()
	return nil
}

// waitReady polls the ready file until it holds a JSON object; a process that exits first
// fails the wait with its log tail.
func (p *proc) waitReady(ctx context.Context, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	p.mu.Lock()
	exited := p.exited
	p.mu.Unlock()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(p.readyPath()); err == nil && len(bytes.TrimSpace(b)) > 0 {
			var m map[string]any
			if err := json.Unmarshal(b, &m); err == nil {
				p.mu.Lock()
				p.ready = m
				p.mu.Unlock()
				return nil
			}
		}
		select {
		case <-exited:
			return fmt.Errorf("%s exited before it was ready (%v); log tail:\n%s", p.name, p.exitErr(), p.tail(20))
		case <-ctx.Done():
			return fmt.Errorf("%s not ready within %s; log tail:\n%s", p.name, limit, p.tail(20))
		case <-tick.C:
		}
	}
}

func (p *proc) exitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitEr
}

// start spawns the process and waits until it is ready.
func (p *proc) start(ctx context.Context, limit time.Duration) error {
	if err := p.spawn(); err != nil {
		return err
	}
	return p.waitReady(ctx, limit)
}

// alive reports whether the process runs.
func (p *proc) alive() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil && !isClosed(p.exited)
}

// pid is the running process's id (0 when none).
func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || isClosed(p.exited) {
		return 0
	}
	return p.cmd.Process.Pid
}

// signal sends sig without waiting (SIGSTOP, SIGCONT); false when no process runs.
func (p *proc) signal(sig syscall.Signal) bool {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil || isClosed(exited) {
		return false
	}
	return cmd.Process.Signal(sig) == nil
}

// kill sends SIGKILL and waits for the exit.
func (p *proc) kill() {
	p.signalWait(syscall.SIGKILL, 0)
}

// stop sends SIGTERM and waits up to grace, then SIGKILL; it reports whether the process
// exited within the grace.
func (p *proc) stop(grace time.Duration) bool {
	return p.signalWait(syscall.SIGTERM, grace)
}

func (p *proc) signalWait(sig syscall.Signal, grace time.Duration) bool {
	p.mu.Lock()
	cmd, exited := p.cmd, p.exited
	p.mu.Unlock()
	if cmd == nil || isClosed(exited) {
		return true
	}
	_ = cmd.Process.Signal(sig)
	if grace > 0 {
		t := time.NewTimer(grace)
		defer t.Stop()
		select {
		case <-exited:
			return true
		case <-t.C:
			_ = cmd.Process.Kill()
		}
	}
	<-exited
	return sig == syscall.SIGKILL
}

// tail returns the last n lines of the log.
func (p *proc) tail(n int) string {
	b, err := os.ReadFile(p.LogPath())
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func isClosed(ch chan struct{}) bool {
	if ch == nil {
		return true
	}
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// childEnv is the environment without KVC_* variables: children are configured by flags only.
func childEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "KVC_") {
			out = append(out, kv)
		}
	}
	return out
}

// freeAddr returns a loopback address with a port that was free a moment ago. The harness
// gives every restartable listener a fixed port so that the addresses its peers were given
// stay valid across restarts.
//
// The port comes from below the kernel's ephemeral range (ip_local_port_range), never from
// it: a port of that range freed here could be handed to any outgoing connection or ":0"
// listener of the cluster before its process binds it ("address already in use" at set-up,
// seen once). Below the range only explicit binds compete; the ports given out are remembered.
func freeAddr() (string, error) {
	lo := ephemeralStart()
	const base = 10000
	portMu.Lock()
	defer portMu.Unlock()
	for range 200 {
		port := base + rand.IntN(lo-base)
		if givenPorts[port] {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue // taken by someone else: another
		}
		_ = l.Close()
		givenPorts[port] = true
		return l.Addr().String(), nil
	}
	return "", fmt.Errorf("no free loopback port below %d after 200 tries", lo)
}

var (
	portMu     sync.Mutex
	givenPorts = map[int]bool{}
)

// ephemeralStart is the first port of the kernel's ephemeral range (32768 where it cannot be
// read or makes no sense).
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if n, err := strconv.Atoi(f[0]); err == nil && n > 12000 && n <= 65535 {
				return n
			}
		}
	}
	return 32768
}
