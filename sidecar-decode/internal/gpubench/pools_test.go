package gpubench

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// shape is the pool geometry of a run.
type shape struct {
	PageSize   int64
	Layers     int64
	TokenBytes int64 // bytes per token per buffer
	Tokens     int64 // the session
	PoolFactor int64 // pool pages = factor × session pages (fragmentation)
	// MLA: one buffer per layer (KV_KIND_COMBINED, SGLang's MLATokenToKVPool) instead of K and V.
	MLA bool
}

func (s shape) itemLen() int64 { return s.PageSize * s.TokenBytes }
func (s shape) buffers() int {
	if s.MLA {
		return int(s.Layers)
	}
	return int(2 * s.Layers)
}
func (s shape) sessionPages() int64  { return (s.Tokens + s.PageSize - 1) / s.PageSize }
func (s shape) poolPages() int64     { return s.PoolFactor * s.sessionPages() }
func (s shape) bytesPerToken() int64 { return s.TokenBytes * int64(s.buffers()) }
func (s shape) sessionBytes() int64  { return s.Tokens * s.bytesPerToken() }

// workerPool is a worker's KV pool as the test process (playing the SGLang worker) owns it:
// shared memory (CPU runs) or device memory exported by CUDA IPC (GPU runs).
type workerPool interface {
	// register is the RegisterKVPool request that hands the pool to a sidecar.
	register(model string) *kvcv1.RegisterKVPoolRequest
	// fill writes the known bytes of tokens [0, n) of the session into pages.
	fill(ctx context.Context, seed uint64, pages []int64, n int64) error
	// check counts the token slots of [0, n) in pages that do not hold the known bytes.
	check(ctx context.Context, seed uint64, pages []int64, n int64) (int64, error)
	// clear zeroes pages.
	clear(ctx context.Context, pages []int64) error
	// local is an engine of this process with the pool registered, and the pool's layout in
	// this process's addresses (to replay a sidecar's push from here).
	local(ctx context.Context) (rdma.Engine, *kvcv1.KVLayout, error)
}

func kvBuffer(s shape, i int, size int64) *kvcv1.KVBuffer {
	if s.MLA {
		return &kvcv1.KVBuffer{Layer: int32(i), Kind: kvcv1.KVKind_KV_KIND_COMBINED, SizeBytes: size}
	}
	kind := kvcv1.KVKind_KV_KIND_K
	if i%2 == 1 {
		kind = kvcv1.KVKind_KV_KIND_V
	}
	return &kvcv1.KVBuffer{Layer: int32(i / 2), Kind: kind, SizeBytes: size}
}

func registerReq(s shape, pages int64, model string) *kvcv1.RegisterKVPoolRequest {
	r := &kvcv1.RegisterKVPoolRequest{PageSize: int32(s.PageSize), ItemLen: s.itemLen(), PageCount: pages, NumLayers: int32(s.Layers), Model: model}
	if s.MLA {
		r.Layout = kvcv1.PoolLayout_POOL_LAYOUT_MLA
	}
	return r
}

// shmPool is a worker pool in a shared-memory file (kvpool).
type shmPool struct {
	s     shape
	pages int64
	p     *kvpool.Pool
	eng   rdma.Engine // a tcp engine of this process, made by local
}

func (w *shmPool) local(ctx context.Context) (rdma.Engine, *kvcv1.KVLayout, error) {
	l := &kvcv1.KVLayout{PageSize: int32(w.s.PageSize), ItemLen: w.s.itemLen(), NumLayers: int32(w.s.Layers), PageCount: w.pages}
	for i := 0; i < w.s.buffers(); i++ {
		l.BufferAddrs = append(l.BufferAddrs, uint64(uintptr(unsafe.Pointer(&w.p.Buffer(i)[0]))))
	}
	if w.eng != nil {
		return w.eng, l, nil
	}
	eng, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 2})
	if err != nil {
		return nil, nil, err
	}
	for i, a := range l.BufferAddrs {
		if err := eng.RegisterMemory(rdma.Region{Addr: a, Len: uint64(len(w.p.Buffer(i))), Kind: rdma.MemShared}); err != nil {
			_ = eng.Close()
			return nil, nil, err
		}
	}
	w.eng = eng
	return eng, l, nil
}

func newShmPool(dir string, s shape, pages int64, name string) (*shmPool, error) {
	p, err := kvpool.Create(dir, kvpool.Spec{PageSize: int(s.PageSize), ItemLen: uint64(s.itemLen()), NumLayers: int(s.Layers), PageCount: pages, Name: name, MLA: s.MLA})
	if err != nil {
		return nil, err
	}
	return &shmPool{s: s, pages: pages, p: p}, nil
}

func (w *shmPool) close() {
	if w.eng != nil {
		_ = w.eng.Close()
	}
	_ = w.p.Close()
}

func (w *shmPool) register(model string) *kvcv1.RegisterKVPoolRequest {
	req := registerReq(w.s, w.pages, model)
	for i := 0; i < w.s.buffers(); i++ {
		b := kvBuffer(w.s, i, w.pages*w.s.itemLen())
		b.Memory = &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: w.p.Path(), Offset: w.p.Offset(i)}}
		req.Buffers = append(req.Buffers, b)
	}
	return req
}

func (w *shmPool) fill(_ context.Context, seed uint64, pages []int64, n int64) error {
	return kvpool.FillTokens(w.p, seed, pages, 0, n)
}

func (w *shmPool) check(_ context.Context, seed uint64, pages []int64, n int64) (int64, error) {
	return kvpool.CheckTokens(w.p, seed, pages, 0, n)
}

func (w *shmPool) clear(_ context.Context, pages []int64) error {
	il := w.s.itemLen()
	for b := 0; b < w.s.buffers(); b++ {
		for _, pg := range pages {
			clear(w.p.Buffer(b)[pg*il : (pg+1)*il])
		}
	}
	return nil
}

// gpuWorker is the device side of the test process on one GPU: a cuda engine (the worker's own,
// used only to allocate, export and fill its memory) and a pinned staging buffer of one
// buffer's session pages.
type gpuWorker struct {
	s       shape
	dev     int
	eng     *rdma.CUDAEngine
	self    rdma.SegmentID
	staging []byte
	stAddr  uint64
}

func newGPUWorker(ctx context.Context, s shape, dev int) (*gpuWorker, error) {
	eng, err := rdma.NewCUDA(ctx, rdma.Config{Backend: "cuda", CUDADevice: dev, ListenAddr: "127.0.0.1:0"}, rdma.CUDAOptions{})
	if err != nil {
		return nil, err
	}
	g := &gpuWorker{s: s, dev: dev, eng: eng}
	n := uint64(s.sessionPages() * s.itemLen())
	if g.stAddr, g.staging, err = eng.AllocPinned(n); err != nil {
		_ = eng.Close()
		return nil, err
	}
	if err := eng.RegisterMemory(rdma.Region{Addr: g.stAddr, Len: n, Kind: rdma.MemHost}); err != nil {
		_ = eng.Close()
		return nil, err
	}
	return g, nil
}

func (g *gpuWorker) close() { _ = g.eng.Close() }

// gpuPool is a worker pool in device memory: one allocation per buffer.
type gpuPool struct {
	g     *gpuWorker
	pages int64
	addrs []uint64
	refs  []*kvcv1.CudaIpcRef
}

// newGPUPool allocates and registers the buffers; call exportAll once every pool of the worker
// is allocated.
func (g *gpuWorker) newPool(pages int64) (*gpuPool, error) {
	p := &gpuPool{g: g, pages: pages}
	n := uint64(pages * g.s.itemLen())
	for i := 0; i < g.s.buffers(); i++ {
		a, err := g.eng.AllocDevice(n)
		if err != nil {
			return nil, fmt.Errorf("buffer %d: %w", i, err)
		}
		if err := g.eng.RegisterMemory(rdma.Region{Addr: a, Len: n, Kind: rdma.MemCUDA}); err != nil {
			return nil, err
		}
		p.addrs = append(p.addrs, a)
	}
	return p, nil
}

// exportAll opens the worker engine's own segment (the handshake carries the IPC handle the
// engine derived for each registered allocation) and records every pool's handles.
func (g *gpuWorker) exportAll(ctx context.Context, pools ...*gpuPool) error {
	seg, err := g.eng.OpenSegment(ctx, g.eng.SegmentName())
	if err != nil {
		return err
	}
	g.self = seg
	regs, err := g.eng.RemoteRegions(seg)
	if err != nil {
		return err
	}
	byAddr := map[uint64]rdma.Region{}
	for _, r := range regs {
		byAddr[r.Addr] = r
	}
	for _, p := range pools {
		for i, a := range p.addrs {
			r, ok := byAddr[a]
			if !ok || r.CUDA == nil || len(r.CUDA.IPCHandle) != 64 {
				return fmt.Errorf("buffer %d at %#x: no IPC handle advertised (%+v)", i, a, r)
			}
			p.refs = append(p.refs, &kvcv1.CudaIpcRef{IpcHandle: r.CUDA.IPCHandle, Device: int32(r.CUDA.Device), Offset: int64(r.CUDA.Offset)})
		}
	}
	return nil
}

// local is the worker's engine, where the pool is registered, and the pool with this process's
// addresses.
func (p *gpuPool) local(context.Context) (rdma.Engine, *kvcv1.KVLayout, error) {
	s := p.g.s
	return p.g.eng, &kvcv1.KVLayout{PageSize: int32(s.PageSize), ItemLen: s.itemLen(), NumLayers: int32(s.Layers), PageCount: p.pages, BufferAddrs: slices.Clone(p.addrs)}, nil
}

func (p *gpuPool) register(model string) *kvcv1.RegisterKVPoolRequest {
	s := p.g.s
	req := registerReq(s, p.pages, model)
	for i, ref := range p.refs {
		b := kvBuffer(s, i, p.pages*s.itemLen())
		b.Memory = &kvcv1.KVBuffer_Cuda{Cuda: ref}
		req.Buffers = append(req.Buffers, b)
	}
	return req
}

// stage copies, for buffer b, between the staging buffer (session page i at i·item_len) and
// the pool's pages, through the worker engine: up (staging → pool) or down.
func (p *gpuPool) stage(ctx context.Context, b int, pages []int64, n int64, up bool) error {
	s := p.g.s
	il := s.itemLen()
	var reqs []rdma.Request
	for i, pg := range pages {
		toks := min(s.PageSize, n-int64(i)*s.PageSize)
		if toks <= 0 {
			break
		}
		st, dv := p.g.stAddr+uint64(int64(i)*il), p.addrs[b]+uint64(pg*il)
		r := rdma.Request{Op: rdma.OpWrite, Source: st, Target: p.g.self, TargetAddr: dv, Length: uint64(toks * s.TokenBytes)}
		if !up {
			r.Source, r.TargetAddr = dv, st
		}
		if k := len(reqs) - 1; k >= 0 && reqs[k].Source+reqs[k].Length == r.Source && reqs[k].TargetAddr+reqs[k].Length == r.TargetAddr && toks == s.PageSize {
			reqs[k].Length += r.Length
			continue
		}
		reqs = append(reqs, r)
	}
	_, err := kvxfer.Transfer(ctx, p.g.eng, reqs)
	return err
}

// parallel runs f over [0, n) in GOMAXPROCS shards.
func parallel(n int64, f func(lo, hi int64)) {
	w := int64(runtime.GOMAXPROCS(0))
	per := (n + w - 1) / w
	var wg sync.WaitGroup
	for lo := int64(0); lo < n; lo += per {
		wg.Add(1)
		go func(lo, hi int64) {
			defer wg.Done()
			f(lo, hi)
		}(lo, min(lo+per, n))
	}
	wg.Wait()
}

func (p *gpuPool) fill(ctx context.Context, seed uint64, pages []int64, n int64) error {
	s := p.g.s
	for b := 0; b < s.buffers(); b++ {
		parallel(n, func(lo, hi int64) {
			for t := lo; t < hi; t++ {
				off := t * s.TokenBytes // session page t/ps at (t/ps)·item_len, slot t%ps
				kvpool.FillToken(p.g.staging[off:off+s.TokenBytes], seed, t, b)
			}
		})
		if err := p.stage(ctx, b, pages, n, true); err != nil {
			return fmt.Errorf("fill buffer %d: %w", b, err)
		}
	}
	return nil
}

func (p *gpuPool) check(ctx context.Context, seed uint64, pages []int64, n int64) (int64, error) {
	s := p.g.s
	var bad atomic.Int64
	for b := 0; b < s.buffers(); b++ {
		clear(p.g.staging)
		if err := p.stage(ctx, b, pages, n, false); err != nil {
			return 0, fmt.Errorf("read back buffer %d: %w", b, err)
		}
		parallel(n, func(lo, hi int64) {
			for t := lo; t < hi; t++ {
				off := t * s.TokenBytes
				if !kvpool.CheckToken(p.g.staging[off:off+s.TokenBytes], seed, t, b) {
					bad.Add(1)
				}
			}
		})
	}
	return bad.Load(), nil
}

func (p *gpuPool) clear(ctx context.Context, pages []int64) error {
	clear(p.g.staging)
	n := int64(len(pages)) * p.g.s.PageSize
	for b := 0; b < p.g.s.buffers(); b++ {
		if err := p.stage(ctx, b, pages, n, true); err != nil {
			return err
		}
	}
	return nil
}
