package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/agent"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

var bins = map[string]string{}

// TestMain finds (in $KVC_BIN_DIR) or builds the binaries the tests run.
func TestMain(m *testing.M) {
	dir := os.Getenv("KVC_BIN_DIR")
	tmp := ""
	need := map[string]string{
		"kvc-sidecar-decode":  "../..",
		"kvc-sidecar-prefill": "../../../sidecar-prefill",
		"kvc-controlplane":    "../../../controlplane",
	}
	for name, mod := range need {
		if dir != "" {
			if _, err := os.Stat(filepath.Join(dir, name)); err == nil {
				bins[name] = filepath.Join(dir, name)
				continue
			}
		}
		if _, err := os.Stat(filepath.Join(mod, "cmd", name)); err != nil {
			continue // not written yet (kvc-controlplane): tests needing it say so
		}
		if tmp == "" {
			var err error
			if tmp, err = os.MkdirTemp("", "kvc-e2e-bin-"); err != nil {
				fmt.Fprintln(os.Stderr, err)
				os.Exit(1)
			}
		}
		out := filepath.Join(tmp, name)
		cmd := exec.Command("go", "build", "-o", out, "./cmd/"+name)
		cmd.Dir = mod
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "build %s: %v\n%s", name, err, b)
			if name != "kvc-controlplane" {
				os.Exit(1)
			}
			continue
		}
		bins[name] = out
	}
	code := m.Run()
	if tmp != "" {
		_ = os.RemoveAll(tmp)
	}
	os.Exit(code)
}

// Geometry of every test pool: 16 tokens per page, 4 layers, 64 bytes per token per buffer.
const (
	pageSize   = 16
	numLayers  = 4
	tokenBytes = 64
	itemLen    = pageSize * tokenBytes
	bpt        = 2 * numLayers * tokenBytes // KV bytes per token
)

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

// proc is a running binary.
type proc struct {
	name   string
	cmd    *exec.Cmd
	ready  map[string]any
	stderr *lockedBuf
	exited chan struct{}
}

func (p *proc) str(k string) string { s, _ := p.ready[k].(string); return s }

// stop sends SIGTERM and waits (SIGKILL after 10 s).
func (p *proc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
}

// kill sends SIGKILL and waits.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// start runs bin with args plus --ready-file and waits for the ready file.
func start(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	if bin == "" {
		t.Fatalf("binary for %s not available", name)
	}
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
	deadline := time.NewTimer(30 * time.Second)
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

// sidecar is a running sidecar and its worker's bridge client.
type sidecar struct {
	*proc
	id       string
	events   string
	bridge   kvcv1.WorkerBridgeServiceClient
	peerAddr string
	httpAddr string
	transfer string
}

func startSidecar(t *testing.T, role, id, cp string, extra ...string) *sidecar {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "bridge.sock")
	evlog := filepath.Join(dir, "events.jsonl")
	args := []string{"--worker-id", id, "--bridge-socket", sock, "--event-log", evlog, "--transport", "tcp",
		"--transfer-conns", "2", "--log-level", "debug", "--heartbeat", "100ms"}
	if cp != "" {
		args = append(args, "--control-plane", cp)
	}
	args = append(args, extra...)
	p := start(t, id, bins["kvc-sidecar-"+role], args...)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &sidecar{proc: p, id: id, events: evlog, bridge: kvcv1.NewWorkerBridgeServiceClient(conn),
		peerAddr: p.str("peer_addr"), httpAddr: p.str("http_addr"), transfer: p.str("transfer_endpoint")}
}

// worker is the test's stand-in for an SGLang worker: a shared-memory pool and a page allocator.
type worker struct {
	pool *kvpool.Pool
	next int64
}

func newWorker(t *testing.T, sc *sidecar, pages int64) *worker {
	t.Helper()
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: pageSize, ItemLen: itemLen, NumLayers: numLayers, PageCount: pages, Name: sc.id})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	req := &kvcv1.RegisterKVPoolRequest{PageSize: pageSize, ItemLen: itemLen, PageCount: pages, NumLayers: numLayers, Model: "test"}
	for i := 0; i < 2*numLayers; i++ {
		kind := kvcv1.KVKind_KV_KIND_K
		if i%2 == 1 {
			kind = kvcv1.KVKind_KV_KIND_V
		}
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: int32(i / 2), Kind: kind, SizeBytes: pages * itemLen,
			Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	res, err := sc.bridge.RegisterKVPool(ctxT(t, 10*time.Second), req)
	if err != nil {
		t.Fatalf("register pool on %s: %v", sc.id, err)
	}
	if res.GetKvBytesPerToken() != bpt || res.GetTransferEndpoint() != sc.transfer {
		t.Fatalf("register answer %v", res)
	}
	return &worker{pool: p}
}

// alloc returns n pages, every stride-th page from the allocator's cursor.
func (w *worker) alloc(n int, stride int64) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = w.next
		w.next += stride
	}
	return out
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// readEvents parses a sidecar's event log.
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
			t.Fatalf("event log line %q: %v", sc.Text(), err)
		}
		out = append(out, e)
	}
	return out
}

func filterEvents(evs []agent.Event, name, session string) []agent.Event {
	var out []agent.Event
	for _, e := range evs {
		if e.Event == name && (session == "" || e.Session == session) {
			out = append(out, e)
		}
	}
	return out
}

// waitFor polls cond (a read of a file or an HTTP endpoint of another process) until it holds.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			t.Fatalf("timed out waiting for %s", what)
		case <-tick.C:
		}
	}
}

func getJSON(t *testing.T, url string, v any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode == http.StatusOK && v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("%s: %v: %s", url, err, b)
		}
	}
	return resp.StatusCode
}

type snapStatus struct {
	Exists     bool    `json:"exists"`
	Seqlen     int64   `json:"seqlen"`
	Generation uint64  `json:"generation"`
	FreshnessS float64 `json:"freshness_s"`
	Bytes      int64   `json:"bytes"`
}

func snapshotStatus(t *testing.T, p *sidecar, session string) snapStatus {
	var s snapStatus
	if code := getJSON(t, "http://"+p.httpAddr+"/v1/sessions/"+session+"/snapshot_status", &s); code != 200 {
		t.Fatalf("snapshot_status: HTTP %d", code)
	}
	return s
}

// snapshotKV fetches P's snapshot bytes (buffer-major, then token).
func snapshotKV(t *testing.T, p *sidecar, session string) []byte {
	t.Helper()
	resp, err := http.Get("http://" + p.httpAddr + "/v1/sessions/" + session + "/snapshot_kv")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("snapshot_kv: HTTP %d %v %s", resp.StatusCode, err, b)
	}
	return b
}

// kvBytes reads a worker's KV of tokens [0, n) in the snapshot_kv order.
func kvBytes(w *worker, pages []int64, n int64) []byte {
	var out []byte
	for b := 0; b < 2*numLayers; b++ {
		buf := w.pool.Buffer(b)
		for tok := int64(0); tok < n; tok++ {
			off := pages[tok/pageSize]*itemLen + (tok%pageSize)*tokenBytes
			out = append(out, buf[off:off+tokenBytes]...)
		}
	}
	return out
}
