package prefill

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/kvxfer/kvxfertest"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

// gpuLikeEngine is a tcp engine that answers as the cuda backend: its "device" and "pinned"
// allocations are anonymous host memory, registered with tcp (which refuses MemCUDA) as host
// memory. Every copy is a real tcp transfer; only where the memory lives is pretended, so the
// device-store code paths of the sidecar (arena without CPU view, snapshot_kv through the
// engine) run on a machine without a GPU. sidecar-decode/internal/gpubench runs them on GPUs.
type gpuLikeEngine struct {
	rdma.Engine
	mu    sync.Mutex
	mem   map[uint64][]byte
	nfail int // AllocDevice fails after this many allocations (0: never)
}

func (e *gpuLikeEngine) Backend() string { return "cuda" }

func (e *gpuLikeEngine) alloc(n uint64) (uint64, []byte, error) {
	m, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return 0, nil, err
	}
	p := uint64(uintptr(unsafe.Pointer(&m[0])))
	e.mu.Lock()
	e.mem[p] = m
	e.mu.Unlock()
	return p, m, nil
}

func (e *gpuLikeEngine) AllocDevice(n uint64) (uint64, error) {
	e.mu.Lock()
	full := e.nfail > 0 && len(e.mem) >= e.nfail
	e.mu.Unlock()
	if full {
		return 0, errors.New("out of device memory")
	}
	p, _, err := e.alloc(n)
	return p, err
}

func (e *gpuLikeEngine) AllocPinned(n uint64) (uint64, []byte, error) { return e.alloc(n) }

func (e *gpuLikeEngine) FreeMemory(p uint64) error {
	e.mu.Lock()
	m, ok := e.mem[p]
	delete(e.mem, p)
	e.mu.Unlock()
	if !ok {
		return errors.New("not allocated here")
	}
	return syscall.Munmap(m)
}

func (e *gpuLikeEngine) RegisterMemory(r rdma.Region) error {
	r.Kind = rdma.MemHost
	return e.Engine.RegisterMemory(r)
}

func (e *gpuLikeEngine) allocated() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.mem)
}

// TestDeviceStoreSnapshotKV pushes a fragmented snapshot into a store without CPU view
// (--store-memory cuda) the way a decode sidecar does, and reads it back through snapshot_kv,
// which copies it out through the engine; then the store is closed and every allocation freed.
func TestDeviceStoreSnapshotKV(t *testing.T) {
	const ps, tb, layers, tokens = 4, 16, 2, 37
	ctx := context.Background()
	tcp, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tcp.Close() })
	eng := &gpuLikeEngine{Engine: tcp, mem: map[uint64][]byte{}}
	s := New(Config{WorkerID: "p", StoreBytes: 64 * ps * tb * 2 * layers, StoreMemory: store.MemoryCUDA}, eng, nil, zerolog.Nop())
	wp, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: ps, ItemLen: ps * tb, NumLayers: layers, PageCount: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = wp.Close() })
	req := &kvcv1.RegisterKVPoolRequest{PageSize: ps, ItemLen: ps * tb, PageCount: 4, NumLayers: layers}
	for i := 0; i < 2*layers; i++ {
		k := kvcv1.KVKind_KV_KIND_K
		if i%2 == 1 {
			k = kvcv1.KVKind_KV_KIND_V
		}
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: int32(i / 2), Kind: k, Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: wp.Path(), Offset: wp.Offset(i)}}})
	}
	if _, err := s.RegisterKVPool(ctx, req); err != nil {
		t.Fatal(err)
	}
	if _, arena, _ := s.storeAndArena(); arena.HostVisible() || eng.allocated() != 2*layers {
		t.Fatalf("store host visible %v, %d allocations; want a device store of %d buffers", arena.HostVisible(), eng.allocated(), 2*layers)
	}

	// The decode side: a fragmented session in its own pool and engine.
	src, err := kvxfer.NewArena(kvxfer.Shape{PageSize: ps, ItemLen: ps * tb, PageCount: 32, NumLayers: layers})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.Close)
	deng, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = deng.Close() })
	if err := src.Register(deng, "host"); err != nil {
		t.Fatal(err)
	}
	pages := []int64{30, 2, 3, 4, 17, 9, 10, 11, 0, 31}
	seed := kvpool.SessionSeed("sess")
	for b := 0; b < src.Buffers(); b++ {
		for tok := int64(0); tok < tokens; tok++ {
			kvpool.FillToken(src.TokenSlot(pages, tok, b), seed, tok, b)
		}
	}
	res, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "sess", Generation: 1, Tokens: tokens, SourceLayout: src.Layout(), SourceWorkerId: "d"})
	if err != nil {
		t.Fatal(err)
	}
	seg, err := deng.OpenSegment(ctx, res.GetStoreTransferEndpoint())
	if err != nil {
		t.Fatal(err)
	}
	reqs, err := kvxfertest.Requests(kvxfer.PageMap{Layout: src.Layout(), Pages: pages}, kvxfer.PageMap{Layout: res.GetStoreLayout(), Pages: res.GetPages()}, seg, 0, tokens)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kvxfer.Transfer(ctx, deng, reqs); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: res.GetIngestId()}); err != nil {
		t.Fatal(err)
	}

	mux := http.NewServeMux()
	s.Mount(mux)
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, httptest.NewRequest("GET", "/v1/sessions/sess/snapshot_kv", nil))
	var want bytes.Buffer
	for b := 0; b < src.Buffers(); b++ {
		for tok := int64(0); tok < tokens; tok++ {
			want.Write(src.TokenSlot(pages, tok, b))
		}
	}
	if w.Code != 200 || w.Header().Get("Content-Length") != strconv.Itoa(tokens*tb*2*layers) || !bytes.Equal(w.Body.Bytes(), want.Bytes()) {
		t.Fatalf("snapshot_kv of the device store: HTTP %d, Content-Length %q, %d bytes, equal %v", w.Code, w.Header().Get("Content-Length"),
			w.Body.Len(), bytes.Equal(w.Body.Bytes(), want.Bytes()))
	}
	if n := eng.allocated(); n != 2*layers {
		t.Fatalf("%d allocations after the read; the bounce buffer must be freed", n)
	}
	s.Close()
	if n := eng.allocated(); n != 0 {
		t.Fatalf("%d allocations left after Close", n)
	}
}

// TestDeviceStoreAllocationFails: a store that does not fit is refused with RESOURCE_EXHAUSTED
// and nothing stays allocated.
func TestDeviceStoreAllocationFails(t *testing.T) {
	tcp, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tcp.Close() })
	eng := &gpuLikeEngine{Engine: tcp, mem: map[uint64][]byte{}, nfail: 1}
	s := New(Config{WorkerID: "p", StoreBytes: 16 * 2 * 32, StoreMemory: store.MemoryCUDA}, eng, nil, zerolog.Nop())
	t.Cleanup(s.Close)
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 32, NumLayers: 1, PageCount: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	req := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 32, PageCount: 8, NumLayers: 1}
	for i, k := range []kvcv1.KVKind{kvcv1.KVKind_KV_KIND_K, kvcv1.KVKind_KV_KIND_V} {
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: 0, Kind: k, Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	_, err = s.RegisterKVPool(context.Background(), req)
	if status.Code(err) != codes.ResourceExhausted || eng.allocated() != 0 {
		t.Fatalf("register with a store that does not fit: %v, %d allocations left", err, eng.allocated())
	}
}
