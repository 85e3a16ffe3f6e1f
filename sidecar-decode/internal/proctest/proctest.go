package proctest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
)

// Binaries returns the path of each binary of need (name → the module directory holding
// cmd/<name>, relative to the test's directory): from dir ($KVC_BIN_DIR) when it has it, else
// built with CGO_ENABLED=0 into a temporary directory that cleanup removes. A binary whose
// cmd/<name> does not exist, or that fails to build while named in optional, is left out.
func Binaries(dir string, need map[string]string, optional ...string) (bins map[string]string, cleanup func(), err error) {
	bins = map[string]string{}
	tmp := ""
	cleanup = func() {
		if tmp != "" {
			_ = os.RemoveAll(tmp)
		}
	}
	isOptional := func(name string) bool {
		for _, o := range optional {
			if o == name {
				return true
			}
		}
		return false
	}
	for name, mod := range need {
		if dir != "" {
			if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
				bins[name], _ = filepath.Abs(filepath.Join(dir, name))
				continue
			}
		}
		if _, err := os.Stat(filepath.Join(mod, "cmd", name)); err != nil {
			if isOptional(name) {
				continue
			}
			return nil, cleanup, fmt.Errorf("%s: no %s", name, filepath.Join(mod, "cmd", name))
		}
		if tmp == "" {
			if tmp, err = os.MkdirTemp("", "kvc-proctest-bin-"); err != nil {
				return nil, cleanup, err
			}
		}
		out := filepath.Join(tmp, name)
		cmd := exec.Command("go", "build", "-o", out, "./cmd/"+name)
		cmd.Dir = mod
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			if isOptional(name) {
				fmt.Fprintf(os.Stderr, "build %s (optional, left out): %v\n%s", name, err, b)
				continue
			}
			return nil, cleanup, fmt.Errorf("build %s (or set KVC_BIN_DIR): %v\n%s", name, err, b)
		}
		bins[name] = out
	}
	return bins, cleanup, nil
}

// lockedBuf collects a process's stderr while tests read it.
type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuf) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Proc is a running binary.
type Proc struct {
	Name string
	Cmd  *exec.Cmd
	// Ready is the binary's ready file (pkg/obs): its bound addresses and the like.
	Ready map[string]any
	// Exited is closed when the process has exited.
	Exited chan struct{}
	// StopGrace is how long Stop waits after SIGTERM before SIGKILL (default 10 s).
	StopGrace time.Duration
	stderr    lockedBuf
}

// Str is a string field of the ready file.
func (p *Proc) Str(k string) string { s, _ := p.Ready[k].(string); return s }

// Stderr is everything the process wrote to stderr so far.
func (p *Proc) Stderr() string { return p.stderr.String() }

// Stop sends SIGTERM and waits (SIGKILL after StopGrace).
func (p *Proc) Stop() {
	grace := p.StopGrace
	if grace <= 0 {
		grace = 10 * time.Second
	}
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.Exited:
	case <-time.After(grace):
		_ = p.Cmd.Process.Kill()
		<-p.Exited
	}
}

// Kill sends SIGKILL and waits.
func (p *Proc) Kill() {
	_ = p.Cmd.Process.Kill()
	<-p.Exited
}

// Start runs bin with args plus --ready-file and waits (up to readyIn) for the ready file; the
// process is stopped when the test ends, and its stderr's tail logged if the test failed.
func Start(t testing.TB, name, bin string, readyIn time.Duration, args ...string) *Proc {
	t.Helper()
	if bin == "" {
		t.Fatalf("binary for %s not available", name)
	}
	rf := filepath.Join(t.TempDir(), "ready.json")
	cmd := exec.Command(bin, append(args, "--ready-file", rf)...)
	p := &Proc{Name: name, Cmd: cmd, Exited: make(chan struct{})}
	cmd.Stderr = &p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait(); close(p.Exited) }()
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("---- %s stderr (tail) ----\n%s", name, Tail(p.Stderr(), 6000))
		}
	})
	deadline := time.NewTimer(readyIn)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(rf); err == nil {
			if err := json.Unmarshal(b, &p.Ready); err != nil {
				t.Fatalf("%s ready file: %v", name, err)
			}
			return p
		}
		select {
		case <-p.Exited:
			t.Fatalf("%s exited before ready: %s", name, Tail(p.Stderr(), 4000))
		case <-deadline.C:
			t.Fatalf("%s not ready in time: %s", name, Tail(p.Stderr(), 4000))
		case <-tick.C:
		}
	}
}

// Tail is the last n bytes of s.
func Tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// ReadEvents parses a sidecar's event log (none yet when the file does not exist). A last line
// without its newline is being written and is left for the next read; any other line that does
// not parse fails the test.
func ReadEvents(t testing.TB, path string) []sidecar.Event {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	if i := bytes.LastIndexByte(b, '\n'); i < len(b)-1 {
		b = b[:i+1] // drop a partial last line
	}
	var out []sidecar.Event
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var e sidecar.Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("event log %s line %q: %v", path, sc.Text(), err)
		}
		out = append(out, e)
	}
	return out
}

// WaitFor polls cond (a read of a file or an endpoint of another process) every tick until it
// holds, failing the test after d.
func WaitFor(t testing.TB, what string, d, tick time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tk := time.NewTicker(tick)
	defer tk.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		case <-tk.C:
		}
	}
}
