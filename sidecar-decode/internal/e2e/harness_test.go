package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/launch"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sidecar-decode/internal/proctest"
)

var bins = map[string]string{}

// TestMain finds (in $KVC_BIN_DIR) or builds the binaries the tests run.
func TestMain(m *testing.M) {
	var cleanup func()
	var err error
	bins, cleanup, err = launch.Binaries(os.Getenv("KVC_BIN_DIR"), map[string]string{
		"kvc-sidecar-decode":  "../..",
		"kvc-sidecar-prefill": "../../../sidecar-prefill",
		"kvc-controlplane":    "../../../controlplane",
		"kvc-sim":             "../../../sim",
	}, "kvc-controlplane", "kvc-sim") // tests needing the control plane or kvc-sim say so when it is missing
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		cleanup()
		os.Exit(1)
	}
	etcdtest.VerifyTestMain(m, cleanup)
}

// Geometry of every test pool: 16 tokens per page, 4 layers, 64 bytes per token per buffer.
const (
	pageSize   = 16
	numLayers  = 4
	tokenBytes = 64
	itemLen    = pageSize * tokenBytes
	bpt        = 2 * numLayers * tokenBytes // KV bytes per token
)

// plaintext returns ["--insecure"] when bin takes that flag (plaintext must be chosen
// explicitly once TLS is the default) and nothing for a binary that predates it.
func plaintext(bin string) []string {
	plainMu.Lock()
	defer plainMu.Unlock()
	if v, ok := plainCache[bin]; ok {
		return v
	}
	out, _ := exec.Command(bin, "--help").CombinedOutput()
	var v []string
	if strings.Contains(string(out), "-insecure") {
		v = []string{"--insecure"}
	}
	plainCache[bin] = v
	return v
}

var (
	plainMu    sync.Mutex
	plainCache = map[string][]string{}
)

// proc is a running binary.
type proc = launch.Process

// start runs bin with args plus --ready-file and waits for the ready file.
func start(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	if !slices.Contains(args, "--tls-cert") {
		args = append(args, plaintext(bin)...)
	}
	return launch.StartT(t, launch.Spec{Name: name, Bin: bin, Args: args}, 30*time.Second)
}

// sidecarProc is a running sidecar and its worker's bridge client.
type sidecarProc struct {
	*proc
	id       string
	events   string
	bridge   kvcv1.WorkerBridgeServiceClient
	peerAddr string
	httpAddr string
	transfer string
}

func startSidecar(t *testing.T, role, id, cp string, extra ...string) *sidecarProc {
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
	return &sidecarProc{proc: p, id: id, events: evlog, bridge: kvcv1.NewWorkerBridgeServiceClient(conn),
		peerAddr: p.ReadyString("peer_addr"), httpAddr: p.ReadyString("http_addr"), transfer: p.ReadyString("transfer_endpoint")}
}

// worker is the test's stand-in for an SGLang worker: a shared-memory pool and a page allocator.
type worker struct {
	pool *kvpool.Pool
	next int64
}

func newWorker(t *testing.T, sc *sidecarProc, pages int64) *worker {
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
func readEvents(t *testing.T, path string) []sidecar.Event {
	t.Helper()
	return proctest.ReadEvents(t, path)
}

func filterEvents(evs []sidecar.Event, name, session string) []sidecar.Event {
	var out []sidecar.Event
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
	launch.WaitForT(t, what, d, 10*time.Millisecond, cond)
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

func snapshotStatus(t *testing.T, p *sidecarProc, session string) snapStatus {
	var s snapStatus
	if code := getJSON(t, "http://"+p.httpAddr+"/v1/sessions/"+session+"/snapshot_status", &s); code != 200 {
		t.Fatalf("snapshot_status: HTTP %d", code)
	}
	return s
}

// snapshotKV fetches P's snapshot bytes (buffer-major, then token).
func snapshotKV(t *testing.T, p *sidecarProc, session string) []byte {
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
