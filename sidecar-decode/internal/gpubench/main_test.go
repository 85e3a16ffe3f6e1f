package gpubench

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

	"github.com/kvcentric/kvcentric/pkg/agent"
)

var bins = map[string]string{}

// TestMain finds the sidecar binaries in $KVC_BIN_DIR (bin/gpu on the GPU machine, which has
// no Go toolchain) or builds them (CGO_ENABLED=0).
func TestMain(m *testing.M) {
	dir := os.Getenv("KVC_BIN_DIR")
	tmp := ""
	need := map[string]string{"kvc-sidecar-decode": "../..", "kvc-sidecar-prefill": "../../../sidecar-prefill"}
	for name, mod := range need {
		if dir != "" {
			if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
				bins[name], _ = filepath.Abs(filepath.Join(dir, name))
				continue
			}
		}
		if tmp == "" {
			var err error
			if tmp, err = os.MkdirTemp("", "kvc-gpubench-bin-"); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
		}
		out := filepath.Join(tmp, name)
		cmd := exec.Command("go", "build", "-o", out, "./cmd/"+name)
		cmd.Dir = mod
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build %s (or set KVC_BIN_DIR): %v\n%s", name, err, b)
			os.Exit(1)
		}
		bins[name] = out
	}
	code := m.Run()
	if tmp != "" {
		_ = os.RemoveAll(tmp)
	}
	os.Exit(code)
}

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

// proc is a running sidecar binary.
type proc struct {
	name   string
	cmd    *exec.Cmd
	ready  map[string]any
	stderr *lockedBuf
	exited chan struct{}
}

func (p *proc) str(k string) string { s, _ := p.ready[k].(string); return s }

func (p *proc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(20 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// start runs bin with args plus --ready-file and waits for the ready file.
func start(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	rf := filepath.Join(t.TempDir(), "ready.json")
	cmd := exec.Command(bin, append(args, "--ready-file", rf)...)
	p := &proc{name: name, cmd: cmd, stderr: &lockedBuf{}, exited: make(chan struct{})}
	cmd.Stderr = p.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("---- %s stderr (tail) ----\n%s", name, tail(p.stderr.String(), 6000))
		}
	})
	deadline := time.NewTimer(60 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, err := os.ReadFile(rf); err == nil {
			if err := json.Unmarshal(b, &p.ready); err != nil {
				t.Fatalf("%s ready file: %v", name, err)
			}
			return p
		}
		select {
		case <-p.exited:
			t.Fatalf("%s exited before ready: %s", name, tail(p.stderr.String(), 4000))
		case <-deadline.C:
			t.Fatalf("%s not ready in time: %s", name, tail(p.stderr.String(), 4000))
		case <-tick.C:
		}
	}
}

func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// readEvents parses a sidecar's event log (missing: none yet).
func readEvents(t *testing.T, path string) []agent.Event {
	t.Helper()
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []agent.Event
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var e agent.Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			continue // a line being written
		}
		out = append(out, e)
	}
	return out
}

// waitFor polls cond (a read of another process's event log) until it holds.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		case <-tick.C:
		}
	}
}
