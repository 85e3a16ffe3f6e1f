package seede2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/launch"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

var bins = map[string]string{}

// TestMain takes the binaries from $KVC_BIN_DIR, or builds them; it fails the tests when a
// goroutine they started is still running at the end.
func TestMain(m *testing.M) {
	var cleanup func()
	var err error
	bins, cleanup, err = launch.Binaries(os.Getenv("KVC_BIN_DIR"), map[string]string{"kvc-sidecar-prefill": "../..",
		"kvc-sidecar-decode": "../../../sidecar-decode", "kvc-controlplane": "../../../controlplane", "kvc-sim": "../../../sim"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		cleanup()
		os.Exit(1)
	}
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) { cleanup(); os.Exit(code) }))
}

// Geometry of the test pools: 16 tokens per page, 4 layers, 64 bytes per token per buffer.
const (
	pageSize   = 16
	numLayers  = 4
	tokenBytes = 64
	itemLen    = pageSize * tokenBytes
	bpt        = 2 * numLayers * tokenBytes
)

// sidecarProc is a running sidecar process and its worker's bridge client.
type sidecarProc struct {
	id     string
	events string
	bridge kvcv1.WorkerBridgeServiceClient
	ready  map[string]any
}

func (s *sidecarProc) str(k string) string { v, _ := s.ready[k].(string); return v }

// startProc runs bin with args plus --ready-file, waits for the ready file and returns it; the
// process is stopped when the test ends (its log's tail logged if the test failed).
func startProc(t *testing.T, name, bin string, args ...string) map[string]any {
	t.Helper()
	return launch.StartT(t, launch.Spec{Name: name, Bin: bin, Args: args}, 30*time.Second).Ready()
}

// startSidecar runs kvc-sidecar-<role> (tcp transport) and connects to its bridge.
func startSidecar(t *testing.T, role, id string, extra ...string) *sidecarProc {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "bridge.sock")
	evlog := filepath.Join(dir, "events.jsonl")
	args := append([]string{"--worker-id", id, "--bridge-socket", sock, "--event-log", evlog, "--transport", "tcp",
		"--transfer-conns", "2", "--log-level", "debug", "--insecure", "--heartbeat", "100ms"}, extra...)
	sc := &sidecarProc{id: id, events: evlog, ready: startProc(t, id, bins["kvc-sidecar-"+role], args...)}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	sc.bridge = kvcv1.NewWorkerBridgeServiceClient(conn)
	return sc
}

// newPool is the test's stand-in for a worker's KV pool: shared memory registered with sc.
func newPool(t *testing.T, sc *sidecarProc, pages int64) *kvpool.Pool {
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
	if _, err := sc.bridge.RegisterKVPool(ctxT(t, 10*time.Second), req); err != nil {
		t.Fatalf("register pool on %s: %v", sc.id, err)
	}
	return p
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func events(t *testing.T, path, name, session string) []sidecar.Event {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []sidecar.Event
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var e sidecar.Event
		if json.Unmarshal(sc.Bytes(), &e) == nil && e.Event == name && e.Session == session {
			out = append(out, e)
		}
	}
	return out
}

func seq(from, n, stride int64) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = from + int64(i)*stride
	}
	return out
}

// TestSeedThroughStore: the prefill worker sends a two-chunk seed with to_store; the prefill
// sidecar copies it from the worker's pool into its own store as the session's snapshot of
// generation 1 (bytes checked there by a snapshot reseed into a real decode sidecar's pool,
// which is how a colocated decode worker's KvcLinker loads it: a page-aligned prefix). A D→P
// push of the same generation then appends onto the seed snapshot.
func TestSeedThroughStore(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	p0 := startSidecar(t, "prefill", "p0", "--store-capacity-bytes", strconv.Itoa(64*2*numLayers*itemLen))
	d1 := startSidecar(t, "decode", "d1")
	pw := newPool(t, p0, 64)
	dw := newPool(t, d1, 64)
	const session, tokens = "S", 100 // 7 pages, the last one partly used
	ppages := seq(3, 7, 2)           // the prefill worker's pages of the prompt, not contiguous
	if err := kvpool.FillTokens(pw, kvpool.SessionSeed(session), ppages, 0, tokens); err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t, 30*time.Second)

	// Bad requests first: clear errors, nothing stored.
	bad := []struct {
		name string
		req  *kvcv1.SendKVRequest
		want codes.Code
	}{
		{"no generation", &kvcv1.SendKVRequest{Room: 5, SessionId: session, Pages: ppages[:4], Tokens: tokens, ToStore: true}, codes.InvalidArgument},
		{"no tokens", &kvcv1.SendKVRequest{Room: 5, SessionId: session, Pages: ppages[:4], Generation: 1, ToStore: true}, codes.InvalidArgument},
		{"no session", &kvcv1.SendKVRequest{Room: 5, Pages: ppages[:4], Tokens: tokens, Generation: 1, ToStore: true}, codes.InvalidArgument},
		{"past the tokens", &kvcv1.SendKVRequest{Room: 5, SessionId: session, Pages: seq(0, 8, 1), Tokens: tokens, Generation: 1, ToStore: true}, codes.InvalidArgument},
		{"not from page 0", &kvcv1.SendKVRequest{Room: 5, SessionId: session, Pages: ppages[4:], FirstPage: 4, Tokens: tokens, Generation: 1, ToStore: true}, codes.FailedPrecondition},
	}
	for _, b := range bad {
		if _, err := p0.bridge.SendKV(ctx, b.req); status.Code(err) != b.want {
			t.Fatalf("%s: %v, want %v", b.name, err, b.want)
		}
	}
	if st, err := p0.bridge.SnapshotStatus(ctx, &kvcv1.SnapshotStatusRequest{SessionId: session}); err != nil || st.GetExists() {
		t.Fatalf("snapshot after refused chunks: %v %v", st, err)
	}

	// A chunk that names another session mid-seed fails the seed; its reservation is freed.
	if _, err := p0.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 6, SessionId: "X", Pages: ppages[:4], Tokens: tokens, Generation: 1, ToStore: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := p0.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 6, SessionId: "Y", Pages: ppages[4:], FirstPage: 4, Last: true, Tokens: tokens, Generation: 1, ToStore: true}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("mixed sessions: %v", err)
	}
	if st, _ := p0.bridge.SnapshotStatus(ctx, &kvcv1.SnapshotStatusRequest{SessionId: "X"}); st.GetExists() {
		t.Fatal("a failed seed was stored")
	}

	// The seed: two chunks, the second the last.
	r1, err := p0.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 7, SessionId: session, Pages: ppages[:4], Tokens: tokens, Generation: 1, ToStore: true})
	if err != nil || r1.GetBytes() != 4*pageSize*bpt || r1.GetStoredSeqlen() != 0 {
		t.Fatalf("chunk 1: %v %v", r1, err)
	}
	if st, _ := p0.bridge.SnapshotStatus(ctx, &kvcv1.SnapshotStatusRequest{SessionId: session}); st.GetExists() {
		t.Fatal("the seed is visible before its last chunk")
	}
	r2, err := p0.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 7, SessionId: session, Pages: ppages[4:], FirstPage: 4, Last: true,
		Tokens: tokens, Generation: 1, ToStore: true, Aux: [][]byte{}})
	if err != nil || r2.GetBytes() != (tokens-4*pageSize)*bpt || r2.GetStoredSeqlen() != tokens {
		t.Fatalf("chunk 2: %v %v", r2, err)
	}
	if _, err := p0.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 7, SessionId: session, Pages: ppages[4:], FirstPage: 4, Last: true,
		Tokens: tokens, Generation: 1, ToStore: true}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a chunk after the last: %v", err)
	}
	st, err := p0.bridge.SnapshotStatus(ctx, &kvcv1.SnapshotStatusRequest{SessionId: session})
	if err != nil || !st.GetExists() || st.GetSeqlen() != tokens || st.GetGeneration() != 1 || st.GetPrefillWorker() != "p0" {
		t.Fatalf("snapshot status: %v %v", st, err)
	}
	ing := events(t, p0.events, sidecar.EvRecvIngested, session)
	if len(ing) != 1 || ing[0].Kind != "seed" || ing[0].Bytes != tokens*bpt || ing[0].Seqlen != tokens || ing[0].Generation != 1 || ing[0].Peer != "p0" {
		t.Fatalf("ingested events: %+v", ing)
	}

	// The colocated D loads a page-aligned prefix (SGLang asks for whole pages of input−1
	// tokens) from the store into its own, reversed, pages: the bytes are P's.
	const load = 6 * pageSize
	dpages := seq(40, 6, -3)
	if _, err := d1.bridge.PrepareReceive(ctx, &kvcv1.PrepareReceiveRequest{Room: 8, SessionId: session, Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT,
		Pages: dpages, Tokens: load, SourcePeerAddr: p0.str("peer_addr")}); err != nil {
		t.Fatal(err)
	}
	w, err := d1.bridge.WaitReceive(ctx, &kvcv1.WaitReceiveRequest{Room: 8, TimeoutMs: 20000})
	if err != nil || !w.GetOk() || w.GetBytes() != load*bpt {
		t.Fatalf("load from the store: %v %v", w, err)
	}
	if n, err := kvpool.CheckTokens(dw, kvpool.SessionSeed(session), dpages, 0, load); err != nil || n != 0 {
		t.Fatalf("decode pool after the load: %d mismatches, %v", n, err)
	}

	// The first D→P push of the session (generation 1, the seed's) appends onto the seed.
	peer, err := grpc.NewClient(p0.str("peer_addr"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = peer.Close() })
	pc := kvcv1.NewTransferPeerServiceClient(peer)
	lay := &kvcv1.KVLayout{PageSize: pageSize, ItemLen: itemLen, NumLayers: numLayers, PageCount: 64}
	for b := range 2 * numLayers {
		lay.BufferAddrs = append(lay.BufferAddrs, uint64(b+1)<<20)
	}
	res, err := pc.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: session, Generation: 1, BaseLen: tokens, Tokens: 20,
		SourceWorkerId: "d1", SourceLayout: lay})
	if err != nil || res.GetPages() == nil {
		t.Fatalf("append onto the seed snapshot: %v %v", res, err)
	}
	if _, err := pc.AbortSnapshot(ctx, &kvcv1.AbortSnapshotRequest{IngestId: res.GetIngestId(), Reason: "test"}); err != nil {
		t.Fatal(err)
	}
	// A seed of a newer generation (a RESEED_PREFILL through the store) replaces the snapshot;
	// one of an older generation is refused and leaves it.
	if r, err := p0.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 9, SessionId: session, Pages: ppages, Last: true, Tokens: tokens, Generation: 2, ToStore: true}); err != nil || r.GetStoredSeqlen() != tokens {
		t.Fatalf("a seed of generation 2: %v %v", r, err)
	}
	if _, err := p0.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 10, SessionId: session, Pages: ppages, Last: true, Tokens: tokens, Generation: 1, ToStore: true}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("a seed of an older generation: %v", err)
	}
	if st, _ := p0.bridge.SnapshotStatus(ctx, &kvcv1.SnapshotStatusRequest{SessionId: session}); st.GetGeneration() != 2 || st.GetSeqlen() != tokens {
		t.Fatalf("snapshot after the stale seed: %v", st)
	}
}
