package rdma

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

func init() {
	register("cuda", func(ctx context.Context, cfg Config) (Engine, error) {
		var opt CUDAOptions
		if v := os.Getenv(CUDACopyEnv); v != "" {
			c, err := ParseCUDACopy(v)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", CUDACopyEnv, err)
			}
			opt.Copy = c
		}
		if v := os.Getenv(CUDAChunkEnv); v != "" {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil || n == 0 {
				return nil, fmt.Errorf("%s=%q: %w: want a positive multiple of 16", CUDAChunkEnv, v, ErrInvalidRequest)
			}
			opt.ChunkBytes = n
		}
		return NewCUDA(ctx, cfg, opt)
	})
}

// CUDACopy selects how the cuda backend moves bytes.
type CUDACopy int

const (
	// CUDACopyKernel (the default) batches all requests of a submission into copy descriptors
	// executed by a page-gather/scatter kernel (one CTA per descriptor, 16-byte vector accesses).
	CUDACopyKernel CUDACopy = iota
	// CUDACopyMemcpy issues one cuMemcpyAsync per request. It is launch-bound on fragmented KV
	// (about 1 GB/s) and exists only to be compared against, never as a silent fallback.
	CUDACopyMemcpy
	// CUDACopyWarp runs the descriptors with a persistent kernel: a grid that fills the device
	// once, each warp copying whole descriptors (eight 16-byte accesses per thread in flight),
	// instead of one CTA per descriptor.
	CUDACopyWarp
	// CUDACopyBatch hands each descriptor group to the driver's cuMemcpyBatchAsync (CUDA 12.8+,
	// copy engines instead of SMs). NewCUDA fails with ErrUnavailable when the driver lacks it.
	CUDACopyBatch
)

var cudaCopyNames = [...]string{CUDACopyKernel: "kernel", CUDACopyMemcpy: "memcpy", CUDACopyWarp: "warp", CUDACopyBatch: "batch"}

func (c CUDACopy) String() string {
	if c >= 0 && int(c) < len(cudaCopyNames) {
		return cudaCopyNames[c]
	}
	return fmt.Sprintf("CUDACopy(%d)", int(c))
}

// ParseCUDACopy parses a copy mode name: kernel, warp, batch or memcpy.
func ParseCUDACopy(s string) (CUDACopy, error) {
	for i, n := range cudaCopyNames {
		if s == n {
			return CUDACopy(i), nil
		}
	}
	return 0, fmt.Errorf("%w: cuda copy mode %q (kernel, warp, batch or memcpy)", ErrInvalidRequest, s)
}

// CUDAChunkEnv names the environment variable that sets CUDAOptions.ChunkBytes of engines made
// with New (a multiple of 16; unset: 32 KiB).
const CUDAChunkEnv = "KVC_CUDA_CHUNK_BYTES"

// CUDACopyEnv names the environment variable that picks the copy mode of engines made with
// New (the sidecars'): a ParseCUDACopy name; unset means the default (kernel).
const CUDACopyEnv = "KVC_CUDA_COPY"

// CUDAOptions tunes the cuda backend; zero values take the defaults.
type CUDAOptions struct {
	Copy CUDACopy
	// ChunkBytes is the most bytes one kernel descriptor (one CTA) copies; a multiple of 16.
	// Default 32 KiB.
	ChunkBytes uint64
	// BlockThreads is the number of threads per CTA. Default 256.
	BlockThreads int
	// GroupDescs is the most descriptors per kernel launch; descriptors of a submission are
	// uploaded and launched in groups (the first of 1,024, then doubling up to GroupDescs) so
	// that building the next group overlaps copying the previous ones. Default 65536 (2 MiB
	// of descriptors): few kernel boundaries, at each of which the GPU drains.
	GroupDescs int
	// Workers is the number of goroutines that build the descriptors of one submission, each
	// over a contiguous shard of at least 8,192 requests. Default 1: one goroutine builds
	// descriptors several times faster than the GPU copies KV pages (about 15 ns per request
	// against about 60 ns per 16–32 KiB descriptor at link speed) and the first group starts
	// after 1,024 of them; more workers only add kernel launches. They pay for submissions of
	// many small requests.
	Workers int
}

func (o *CUDAOptions) defaults() error {
	if o.ChunkBytes == 0 {
		o.ChunkBytes = 32 << 10
	}
	if o.BlockThreads == 0 {
		o.BlockThreads = 256
	}
	if o.GroupDescs == 0 {
		o.GroupDescs = 1 << 16
	}
	if o.Workers == 0 {
		o.Workers = 1
	}
	switch {
	case o.ChunkBytes%16 != 0:
		return fmt.Errorf("%w: cuda chunk bytes %d not a multiple of 16", ErrInvalidRequest, o.ChunkBytes)
	case o.BlockThreads < 32 || o.BlockThreads > 1024 || o.BlockThreads%32 != 0:
		return fmt.Errorf("%w: cuda block threads %d", ErrInvalidRequest, o.BlockThreads)
	case o.GroupDescs < 1:
		return fmt.Errorf("%w: cuda group descriptors %d", ErrInvalidRequest, o.GroupDescs)
	case o.Workers < 1:
		return fmt.Errorf("%w: cuda workers %d", ErrInvalidRequest, o.Workers)
	case o.Copy < CUDACopyKernel || o.Copy > CUDACopyBatch:
		return fmt.Errorf("%w: cuda copy mode %d", ErrInvalidRequest, o.Copy)
	}
	return nil
}

// CUDAEngine is the cuda backend: same-node GPU↔GPU (and GPU↔pinned host) transfers. Peers'
// device memory is imported from the CUDA IPC handles of the handshake into the context of the
// engine's device (Config.CUDADevice) and copied one-sided by the opener: the copy kernel runs
// on the engine's device and reaches the other GPU over NVLink (peer access).
type CUDAEngine struct {
	drv    *cuda.Driver
	opt    CUDAOptions
	defDev int
	pid    uint32
	ln     net.Listener
	name   string

	devMu  sync.Mutex
	devs   map[int]*cudaDev
	peerOK map[[2]int]error

	impMu   sync.Mutex
	imports map[string]cudaImport
	shms    map[string]*cudaShm // peers' shared-memory files mapped here (cuda_shm.go)

	allocMu sync.Mutex
	allocs  map[uint64]bool // AllocDevice/AllocPinned allocations; true: pinned host
	// hostRegs are this process's MemShared regions that RegisterMemory page-locked
	// (cuMemHostRegister); UnregisterMemory and Close undo it.
	hostRegs map[uint64]bool

	// subMu is held shared by submissions and exclusively by Close, so that no copy is queued
	// on a device being shut down.
	subMu sync.RWMutex
	shut  atomic.Bool

	testSink cudaSink // tests of the submission logic only; nil: the GPU
	// testForeign makes peers of this process look like other processes (tests of the
	// cross-process import paths in one process only).
	testForeign bool
	shardMin    int // tests only; 0: cudaShardMin

	mu        sync.RWMutex
	local     cudaSpans
	adv       []cudaWireRegion
	conns     map[*cudaConn]struct{}
	greeting  map[net.Conn]struct{}
	peers     map[SegmentID]*cudaPeer
	nextSeg   SegmentID
	batches   map[BatchID]*cudaBatch
	nextBatch BatchID
	closed    bool

	ready cudaReady // interprocess ready events (cuda_ready.go)

	wg sync.WaitGroup
}

type cudaImport struct {
	ctx *cuda.Context
	ptr uint64
}

type cudaConn struct {
	c  net.Conn
	wm sync.Mutex
}

type cudaPeer struct {
	name  string
	conn  net.Conn
	pid   uint32
	regs  atomic.Pointer[[]cudaWireRegion]
	spans atomic.Pointer[cudaSpans]
	gone  atomic.Pointer[error]
	done  chan struct{}
	// updated receives a value (without blocking) after each applied snapshot.
	updated chan struct{}
}

// cudaDev is the per-device state: primary context, copy stream, kernel, descriptor buffers
// and the completion queue (events complete in stream order).
type cudaDev struct {
	ord     int
	ctx     *cuda.Context
	stream  cuda.Stream // copies (kernels, memcpy) in submission order
	up      cuda.Stream // descriptor uploads, overlapping the copies of earlier groups
	mod     cuda.Module
	fn      cuda.Function // CopyKernelName: one CTA per descriptor
	warpFn  cuda.Function // WarpKernelName: persistent, one warp per descriptor
	sms     int           // multiprocessors (sizes the persistent grid)
	pending chan *cudaGroup
	// queued is the number of descriptors launched on the copy stream whose group has not
	// completed yet: the GPU's backlog, which sizes a submission's first group.
	queued atomic.Int64

	poolMu sync.Mutex
	free   []*cudaDescBuf
	all    []*cudaDescBuf
}

type cudaDescBuf struct {
	host, dev uint64
	descs     []cudaDesc // view of host
	// batch is pinned host memory for CUDACopyBatch's three arrays (dsts, srcs, sizes), each of
	// cap(descs) values; allocated on first use, freed with the buffer.
	batch uint64
	// up is recorded on the upload stream after the copy of descs to dev; the copy stream
	// waits for it before the kernel reads them.
	up cuda.Event
}

// cudaDesc mirrors the kernel's descriptor (cuda.DescSize bytes).
type cudaDesc struct{ src, dst, n, _ uint64 }

type cudaGroup struct {
	dev  *cudaDev
	ev   cuda.Event
	buf  *cudaDescBuf
	n    int64 // descriptors of buf, counted in dev.queued until the group completes
	done chan struct{}
	err  error
}

type cudaBatch struct {
	mu       sync.Mutex // held by Submit for the whole call and by every reader
	cap      int
	lens     []uint64
	group    []int32 // index into groups of the task's last copy; <0: failed (cudaTaskFailed)
	gmu      sync.Mutex
	errs     map[int]error // under gmu while a Submit's shards run
	groups   []*cudaGroup  // under gmu while a Submit's shards run
	canceled map[int32]bool
	// ready is every task's status should all groups complete, prepared by a batch's only
	// Submit while the copies run; Wait hands it out (once) when that is what happened.
	ready []TaskStatus
}

var _ Engine = (*CUDAEngine)(nil)

// NewCUDA starts a cuda engine: it loads libcuda (ErrUnavailable when it cannot, or when
// cfg.CUDADevice does not exist), prepares cfg.CUDADevice and listens for peers on
// cfg.ListenAddr ("127.0.0.1:0" by default; "unix:/path" for a Unix socket).
func NewCUDA(ctx context.Context, cfg Config, opt CUDAOptions) (*CUDAEngine, error) {
	if err := opt.defaults(); err != nil {
		return nil, err
	}
	drv, err := cuda.Load()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if cfg.CUDADevice < 0 || cfg.CUDADevice >= n {
		return nil, fmt.Errorf("%w: CUDA device %d of %d", ErrUnavailable, cfg.CUDADevice, n)
	}
	if opt.Copy == CUDACopyBatch && !drv.HasBatchMemcpy() {
		return nil, fmt.Errorf("%w: copy mode batch: the driver has no cuMemcpyBatchAsync (CUDA 12.8+)", ErrUnavailable)
	}
	e := newCUDAEngine(opt, cfg.CUDADevice)
	e.drv = drv
	if _, err := e.device(cfg.CUDADevice); err != nil {
		e.release()
		return nil, err
	}
	if err := e.listen(ctx, cfg); err != nil {
		_ = e.Close()
		return nil, err
	}
	return e, nil
}

func newCUDAEngine(opt CUDAOptions, dev int) *CUDAEngine {
	return &CUDAEngine{
		opt: opt, defDev: dev, pid: uint32(os.Getpid()),
		devs: map[int]*cudaDev{}, peerOK: map[[2]int]error{}, imports: map[string]cudaImport{},
		allocs: map[uint64]bool{}, hostRegs: map[uint64]bool{}, shms: map[string]*cudaShm{},
		conns: map[*cudaConn]struct{}{}, greeting: map[net.Conn]struct{}{}, peers: map[SegmentID]*cudaPeer{}, batches: map[BatchID]*cudaBatch{},
		nextSeg: 1, nextBatch: 1,
	}
}

// listen opens the control socket and starts accepting peers.
func (e *CUDAEngine) listen(ctx context.Context, cfg Config) error {
	network, addr := splitCUDAAddr(cfg.ListenAddr)
	if addr == "" {
		network, addr = "tcp", "127.0.0.1:0"
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, network, addr)
	if err != nil {
		return fmt.Errorf("rdma/cuda: listen %s: %w", cfg.ListenAddr, err)
	}
	e.ln = ln
	e.name = ln.Addr().String()
	if network == "unix" {
		e.name = "unix:" + e.name
	}
	if cfg.AdvertiseAddr != "" {
		e.name = cfg.AdvertiseAddr
	}
	e.wg.Add(1)
	go e.acceptLoop()
	return nil
}

func splitCUDAAddr(a string) (network, addr string) {
	if rest, ok := strings.CutPrefix(a, "unix:"); ok {
		return "unix", rest
	}
	if strings.HasPrefix(a, "/") {
		return "unix", a
	}
	return "tcp", a
}

// Backend implements Engine.
func (e *CUDAEngine) Backend() string { return "cuda" }

// SegmentName implements Engine: the control socket address.
func (e *CUDAEngine) SegmentName() string { return e.name }

// Options returns the options in effect.
func (e *CUDAEngine) Options() CUDAOptions { return e.opt }

// Close implements Engine: it stops accepting peers, waits for copies in flight, and releases
// imported memory, buffers, kernels, streams and contexts.
func (e *CUDAEngine) Close() error {
	e.subMu.Lock()
	e.shut.Store(true)
	e.subMu.Unlock()
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return ErrClosed
	}
	e.closed = true
	peers := e.peers
	e.peers = map[SegmentID]*cudaPeer{}
	for c := range e.conns {
		_ = c.c.Close()
	}
	for c := range e.greeting {
		_ = c.Close()
	}
	e.mu.Unlock()
	if e.ln != nil {
		_ = e.ln.Close()
	}
	for _, p := range peers {
		if p.conn != nil {
			_ = p.conn.Close()
		}
	}
	e.devMu.Lock()
	for _, d := range e.devs {
		_ = d.ctx.StreamSynchronize(d.up)
		_ = d.ctx.StreamSynchronize(d.stream)
		close(d.pending)
	}
	e.devMu.Unlock()
	e.wg.Wait()
	e.release()
	return nil
}

func (e *CUDAEngine) release() {
	e.impMu.Lock()
	for k, im := range e.imports {
		_ = im.ctx.IPCClose(im.ptr)
		delete(e.imports, k)
	}
	e.impMu.Unlock()
	e.devMu.Lock()
	d0 := e.devs[e.defDev]
	e.devMu.Unlock()
	e.releaseShared(d0)
	e.devMu.Lock()
	defer e.devMu.Unlock()
	e.allocMu.Lock()
	if d := e.devs[e.defDev]; d != nil {
		for p, host := range e.allocs {
			if host {
				_ = d.ctx.MemFreeHost(p)
			} else {
				_ = d.ctx.MemFree(p)
			}
		}
	}
	clear(e.allocs)
	e.allocMu.Unlock()
	if d := e.devs[e.defDev]; d != nil {
		e.closeReady(d)
	}
	for ord, d := range e.devs {
		for _, b := range d.all {
			_ = d.ctx.MemFreeHost(b.host)
			if b.batch != 0 {
				_ = d.ctx.MemFreeHost(b.batch)
			}
			_ = d.ctx.MemFree(b.dev)
			_ = d.ctx.EventDestroy(b.up)
		}
		_ = d.ctx.ModuleUnload(d.mod)
		_ = d.ctx.StreamDestroy(d.up)
		_ = d.ctx.StreamDestroy(d.stream)
		_ = d.ctx.Release()
		delete(e.devs, ord)
	}
}
