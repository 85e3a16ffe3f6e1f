package faults

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kvcentric/kvcentric/pkg/launch"
)

// proc is one child process that the harness can kill and start again with the same
// arguments (the same fixed ports, so every peer's address list stays valid); each run is a
// pkg/launch process.
type proc struct {
	name string
	bin  string
	args []string // without --ready-file
	dir  string   // logs and ready files

	mu     sync.Mutex
	cur    *launch.Process // the latest run (nil before the first)
	starts int
}

// LogPath is where the process's stdout and stderr go (appended across restarts).
func (p *proc) LogPath() string { return filepath.Join(p.dir, p.name+".log") }

// run is the latest run, nil before the first.
func (p *proc) run() *launch.Process {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cur
}

// spawn starts the process without waiting for it to be ready.
func (p *proc) spawn() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cur != nil && p.cur.Alive() {
		return fmt.Errorf("%s: already running (pid %d)", p.name, p.cur.PID)
	}
	p.starts++
	if lf, err := os.OpenFile(p.LogPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
		fmt.Fprintf(lf, "=== faults harness: start %d of %s at %s\n", p.starts, p.name, time.Now().UTC().Format(time.RFC3339Nano))
		_ = lf.Close()
	}
	cur, err := launch.Start(launch.Spec{Name: p.name, Bin: p.bin, Args: p.args, Dir: p.dir, AppendLog: true})
	if err != nil {
		return err
	}
	p.cur = cur
	return nil
}

// waitReady waits for the latest run's ready file; a process that exits first fails the wait
// with its log tail.
func (p *proc) waitReady(ctx context.Context, limit time.Duration) error {
	cur := p.run()
	if cur == nil {
		return fmt.Errorf("%s: never started", p.name)
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	_, err := cur.WaitReady(ctx)
	return err
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
	cur := p.run()
	return cur != nil && cur.Alive()
}

// pid is the running process's id (0 when none).
func (p *proc) pid() int {
	if cur := p.run(); cur != nil && cur.Alive() {
		return cur.PID
	}
	return 0
}

// signal sends sig without waiting (SIGSTOP, SIGCONT); false when no process runs.
func (p *proc) signal(sig syscall.Signal) bool {
	cur := p.run()
	return cur != nil && cur.Signal(sig)
}

// kill sends SIGKILL and waits for the exit.
func (p *proc) kill() {
	if cur := p.run(); cur != nil {
		cur.Kill()
	}
}

// stop sends SIGTERM and waits up to grace, then SIGKILL; it reports whether the process
// exited within the grace.
func (p *proc) stop(grace time.Duration) bool {
	cur := p.run()
	if cur == nil || !cur.Alive() {
		return true
	}
	return !errors.Is(cur.Stop(grace), launch.ErrKilled)
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
