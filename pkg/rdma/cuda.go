package rdma

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sync/errgroup"

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

// device returns the state of device ord, preparing it on first use: primary context, stream,
// the copy kernel (JIT from PTX) and its completion goroutine.
func (e *CUDAEngine) device(ord int) (*cudaDev, error) {
	e.devMu.Lock()
	defer e.devMu.Unlock()
	if d, ok := e.devs[ord]; ok {
		return d, nil
	}
	if e.shut.Load() {
		return nil, ErrClosed
	}
	ctx, err := e.drv.PrimaryContext(ord)
	if err != nil {
		return nil, fmt.Errorf("%w: device %d: %v", ErrUnavailable, ord, err)
	}
	d := &cudaDev{ord: ord, ctx: ctx, pending: make(chan *cudaGroup, 4096)}
	if d.stream, err = ctx.StreamCreate(); err != nil {
		_ = ctx.Release()
		return nil, fmt.Errorf("rdma/cuda: device %d: %w", ord, err)
	}
	if d.up, err = ctx.StreamCreate(); err != nil {
		_ = ctx.StreamDestroy(d.stream)
		_ = ctx.Release()
		return nil, fmt.Errorf("rdma/cuda: device %d: %w", ord, err)
	}
	if d.mod, err = ctx.ModuleLoadData(cuda.CopyKernelPTX); err == nil {
		d.fn, err = ctx.ModuleFunction(d.mod, cuda.CopyKernelName)
		if err == nil {
			d.warpFn, err = ctx.ModuleFunction(d.mod, cuda.WarpKernelName)
		}
		if err == nil {
			d.sms, err = e.drv.DeviceAttribute(ord, cuda.DeviceAttrMultiprocessorCount)
		}
	}
	if err != nil {
		_ = ctx.StreamDestroy(d.up)
		_ = ctx.StreamDestroy(d.stream)
		_ = ctx.Release()
		return nil, fmt.Errorf("rdma/cuda: device %d: load copy kernel: %w", ord, err)
	}
	e.devs[ord] = d
	e.wg.Add(1)
	go e.completions(d)
	return d, nil
}

// completions finishes groups of d in submission order.
func (e *CUDAEngine) completions(d *cudaDev) {
	defer e.wg.Done()
	for g := range d.pending {
		g.err = d.ctx.EventSynchronize(g.ev)
		_ = d.ctx.EventDestroy(g.ev)
		d.queued.Add(-g.n)
		if g.buf != nil {
			d.putBuf(g.buf)
		}
		close(g.done)
	}
}

func (d *cudaDev) getBuf(n int) (*cudaDescBuf, error) {
	d.poolMu.Lock()
	defer d.poolMu.Unlock()
	for i := len(d.free) - 1; i >= 0; i-- {
		// buffers of a smaller group size (options changed) stay in the pool
		if b := d.free[i]; cap(b.descs) >= n {
			d.free = append(d.free[:i], d.free[i+1:]...)
			return b, nil
		}
	}
	size := uint64(n) * cuda.DescSize
	host, err := d.ctx.MemHostAlloc(size)
	if err != nil {
		return nil, err
	}
	dev, err := d.ctx.MemAlloc(size)
	if err != nil {
		_ = d.ctx.MemFreeHost(host)
		return nil, err
	}
	up, err := d.ctx.EventCreate(false)
	if err != nil {
		_ = d.ctx.MemFreeHost(host)
		_ = d.ctx.MemFree(dev)
		return nil, err
	}
	b := &cudaDescBuf{host: host, dev: dev, up: up}
	b.descs = unsafe.Slice((*cudaDesc)(unsafe.Add(unsafe.Pointer(nil), uintptr(host))), n)[:0]
	d.all = append(d.all, b)
	return b, nil
}

func (d *cudaDev) putBuf(b *cudaDescBuf) {
	d.poolMu.Lock()
	b.descs = b.descs[:0]
	d.free = append(d.free, b)
	d.poolMu.Unlock()
}

// ensurePeer enables access from device a to device b's memory.
func (e *CUDAEngine) ensurePeer(a, b int) error {
	if a < 0 || b < 0 || a == b {
		return nil
	}
	e.devMu.Lock()
	err, ok := e.peerOK[[2]int{a, b}]
	e.devMu.Unlock()
	if ok {
		return err
	}
	da, err := e.device(a)
	if err != nil {
		return err
	}
	db, err := e.device(b)
	if err != nil {
		return err
	}
	can, err := e.drv.CanAccessPeer(a, b)
	if err == nil && !can {
		err = fmt.Errorf("%w: device %d cannot access device %d (no peer access)", ErrUnavailable, a, b)
	}
	if err == nil {
		err = da.ctx.EnablePeerAccess(db.ctx)
	}
	e.devMu.Lock()
	e.peerOK[[2]int{a, b}] = err
	e.devMu.Unlock()
	return err
}

// importHandle opens (once per engine) the allocation behind an IPC handle in the context of
// the engine's device, with peer access enabled lazily when the memory lives on another GPU.
func (e *CUDAEngine) importHandle(m *CUDAMemory) (uint64, error) {
	if len(m.IPCHandle) != cuda.IPCHandleSize {
		return 0, fmt.Errorf("%w: IPC handle of %d bytes", ErrInvalidRequest, len(m.IPCHandle))
	}
	key := fmt.Sprintf("%d/%x", m.Device, m.IPCHandle)
	e.impMu.Lock()
	defer e.impMu.Unlock()
	if im, ok := e.imports[key]; ok {
		return im.ptr, nil
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return 0, err
	}
	var h cuda.IPCHandle
	copy(h[:], m.IPCHandle)
	p, err := d.ctx.IPCOpen(h)
	if err != nil {
		return 0, fmt.Errorf("rdma/cuda: import IPC handle on device %d: %w", m.Device, err)
	}
	e.imports[key] = cudaImport{ctx: d.ctx, ptr: p}
	return p, nil
}

// AllocDevice allocates n bytes of device memory on the engine's device, for a store or pool
// that this process owns; register it as a MemCUDA region without a handle. Close frees it.
func (e *CUDAEngine) AllocDevice(n uint64) (uint64, error) {
	return e.alloc(n, false)
}

// AllocPinned allocates n bytes of pinned, device-mapped host memory (a host-side snapshot
// store the copy kernel can reach); register it as a MemHost region. The slice views it and
// must not be used after FreeMemory or Close.
func (e *CUDAEngine) AllocPinned(n uint64) (uint64, []byte, error) {
	p, err := e.alloc(n, true)
	if err != nil {
		return 0, nil, err
	}
	return p, cuda.HostBytes(p, n), nil
}

func (e *CUDAEngine) alloc(n uint64, host bool) (uint64, error) {
	if n == 0 {
		return 0, fmt.Errorf("%w: zero-byte allocation", ErrInvalidRequest)
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return 0, err
	}
	var p uint64
	if host {
		p, err = d.ctx.MemHostAlloc(n)
	} else {
		p, err = d.ctx.MemAlloc(n)
	}
	if err != nil {
		return 0, fmt.Errorf("rdma/cuda: allocate %d bytes: %w", n, err)
	}
	e.allocMu.Lock()
	e.allocs[p] = host
	e.allocMu.Unlock()
	return p, nil
}

// FreeMemory frees memory from AllocDevice or AllocPinned. Unregister it first.
func (e *CUDAEngine) FreeMemory(p uint64) error {
	e.allocMu.Lock()
	host, ok := e.allocs[p]
	delete(e.allocs, p)
	e.allocMu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %#x was not allocated by this engine", ErrInvalidRequest, p)
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return err
	}
	if host {
		return d.ctx.MemFreeHost(p)
	}
	return d.ctx.MemFree(p)
}

// RegisterMemory implements Engine. Kinds:
//   - MemCUDA with r.CUDA.IPCHandle set: another process's device memory (a worker's KV pool);
//     it is imported here and Addr is the owner's address, used only as the region's name.
//   - MemCUDA without a handle: device memory allocated by this process at Addr; its IPC
//     handle is derived so that peers can import it.
//   - MemHost: pinned host memory of this process (cuMemHostAlloc or registered); usable as a
//     local source or target, not importable by other processes.
//   - MemShared: this process's mapping of a shared-memory file whose absolute path is
//     Location (a /dev/shm file, or a memfd as /proc/<pid>/fd/<n>), mapped from offset 0 over
//     Len bytes; it is page-locked and device-mapped here (cuMemHostRegister) unless pinned
//     already, and peers that open this segment map the file by its path and copy into it
//     one-sided (cuda_shm.go).
func (e *CUDAEngine) RegisterMemory(r Region) error {
	if r.Len == 0 || r.Addr+r.Len < r.Addr {
		return fmt.Errorf("%w: region [%#x,+%d)", ErrInvalidRequest, r.Addr, r.Len)
	}
	sp := cudaSpan{addr: r.Addr, len: r.Len}
	adv := cudaWireRegion{Region: r}
	switch {
	case r.Kind == MemCUDA && r.CUDA != nil && len(r.CUDA.IPCHandle) > 0:
		if r.CUDA.Device < 0 {
			return fmt.Errorf("%w: device %d", ErrInvalidRequest, r.CUDA.Device)
		}
		base, err := e.importHandle(r.CUDA)
		if err != nil {
			return err
		}
		sp.ptr, sp.dev = base+r.CUDA.Offset, r.CUDA.Device
		c := *r.CUDA
		c.IPCHandle = append([]byte(nil), r.CUDA.IPCHandle...)
		adv.CUDA = &c
	case r.Kind == MemCUDA:
		d, err := e.device(e.defDev)
		if err != nil {
			return err
		}
		mt, ord, err := d.ctx.PointerInfo(r.Addr)
		if err != nil || mt != cuda.MemoryDevice {
			return fmt.Errorf("%w: %#x is not device memory of this process (%v)", ErrInvalidRequest, r.Addr, err)
		}
		od, err := e.device(ord)
		if err != nil {
			return err
		}
		base, size, err := od.ctx.AddressRange(r.Addr)
		if err != nil {
			return fmt.Errorf("%w: %v", ErrInvalidRequest, err)
		}
		if r.Addr+r.Len > base+size {
			return fmt.Errorf("%w: region [%#x,+%d) exceeds its allocation", ErrInvalidRequest, r.Addr, r.Len)
		}
		h, err := od.ctx.IPCGetHandle(base)
		if err != nil {
			return fmt.Errorf("rdma/cuda: IPC handle: %w", err)
		}
		sp.ptr, sp.dev = r.Addr, ord
		adv.CUDA = &CUDAMemory{Device: ord, IPCHandle: h[:], Offset: r.Addr - base}
		if adv.Location == "" {
			adv.Location = fmt.Sprintf("cuda:%d", ord)
		}
	case r.Kind == MemHost:
		d, err := e.device(e.defDev)
		if err != nil {
			return err
		}
		mt, _, err := d.ctx.PointerInfo(r.Addr)
		if err != nil || mt != cuda.MemoryHost {
			return fmt.Errorf("%w: %#x is not pinned host memory (%v)", ErrInvalidRequest, r.Addr, err)
		}
		dp, err := d.ctx.HostDevicePointer(r.Addr)
		if err != nil {
			return fmt.Errorf("%w: %#x is not mapped pinned host memory (%v)", ErrInvalidRequest, r.Addr, err)
		}
		sp.ptr, sp.dev = dp, -1
		adv.CUDA = nil
		if adv.Location == "" {
			adv.Location = "cpu"
		}
	case r.Kind == MemShared:
		dp, err := e.registerShared(r)
		if err != nil {
			return err
		}
		sp.ptr, sp.dev = dp, -1
		adv.CUDA = nil
	default:
		return fmt.Errorf("%w: the cuda backend takes MemCUDA, pinned MemHost or MemShared regions, not kind %d", ErrInvalidRequest, r.Kind)
	}
	adv.Ptr = sp.ptr
	if err := e.addRegion(sp, adv); err != nil {
		if r.Kind == MemShared {
			e.unregisterShared(r.Addr)
		}
		return err
	}
	return nil
}

// addRegion records a resolved local region and advertises it to connected peers.
func (e *CUDAEngine) addRegion(sp cudaSpan, adv cudaWireRegion) error {
	r := adv.Region
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	for _, s := range e.local {
		if r.Addr < s.addr+s.len && s.addr < r.Addr+r.Len {
			return fmt.Errorf("%w: region [%#x,+%d) overlaps a registered one", ErrInvalidRequest, r.Addr, r.Len)
		}
	}
	local := append(append(cudaSpans(nil), e.local...), sp).sorted()
	e.local = local
	e.adv = append(e.adv, adv)
	e.broadcastLocked()
	return nil
}

// UnregisterMemory implements Engine. Peers learn it from the next snapshot; the caller must
// make sure no copy into or out of the region is still running.
func (e *CUDAEngine) UnregisterMemory(addr uint64) error {
	if err := e.unregisterLocal(addr); err != nil {
		return err
	}
	e.unregisterShared(addr)
	return nil
}

func (e *CUDAEngine) unregisterLocal(addr uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, s := range e.local {
		if s.addr == addr {
			local := append(append(cudaSpans(nil), e.local[:i]...), e.local[i+1:]...)
			e.local = local
			for j, a := range e.adv {
				if a.Addr == addr {
					e.adv = append(e.adv[:j:j], e.adv[j+1:]...)
					break
				}
			}
			e.broadcastLocked()
			return nil
		}
	}
	return fmt.Errorf("%w: no region at %#x", ErrInvalidRequest, addr)
}

func (e *CUDAEngine) broadcastLocked() {
	msg := cudaEncodeRegions(e.pid, e.adv)
	for c := range e.conns {
		c.send(msg)
	}
}

func (c *cudaConn) send(msg []byte) {
	c.wm.Lock()
	defer c.wm.Unlock()
	_ = c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if err := cudaWriteFrame(c.c, msg); err != nil {
		_ = c.c.Close()
	}
}

func (e *CUDAEngine) acceptLoop() {
	defer e.wg.Done()
	for {
		c, err := e.ln.Accept()
		if err != nil {
			return
		}
		e.wg.Add(1)
		go e.serve(c)
	}
}

// serve answers one opener: hello, then snapshots until either side closes.
func (e *CUDAEngine) serve(c net.Conn) {
	defer e.wg.Done()
	defer c.Close()
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	e.greeting[c] = struct{}{} // closed by Close while waiting for the hello
	e.mu.Unlock()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, err := cudaReadFrame(c)
	e.mu.Lock()
	delete(e.greeting, c)
	e.mu.Unlock()
	if err != nil {
		return
	}
	if _, err := cudaDecodeHello(b); err != nil {
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	cc := &cudaConn{c: c}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	e.conns[cc] = struct{}{}
	cc.send(cudaEncodeRegions(e.pid, e.adv))
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		delete(e.conns, cc)
		e.mu.Unlock()
	}()
	// The opener sends nothing more; a read returns when it closes (or misbehaves).
	var one [1]byte
	_, _ = c.Read(one[:])
}

// OpenSegment implements Engine: connect to the peer's control socket, receive its regions and
// import its device memory.
func (e *CUDAEngine) OpenSegment(ctx context.Context, name string) (SegmentID, error) {
	network, addr := splitCUDAAddr(name)
	if addr == "" {
		return 0, fmt.Errorf("%w: empty segment name", ErrUnknownSegment)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return 0, fmt.Errorf("%w %q: %v", ErrUnknownSegment, name, err)
	}
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(10 * time.Second)
	}
	_ = c.SetDeadline(dl)
	p := &cudaPeer{name: name, conn: c, done: make(chan struct{}), updated: make(chan struct{}, 1)}
	err = cudaWriteFrame(c, cudaEncodeHello(e.pid))
	var first []byte
	if err == nil {
		first, err = cudaReadFrame(c)
	}
	if err == nil {
		err = e.applySnapshot(p, first)
	}
	if err != nil {
		_ = c.Close()
		return 0, fmt.Errorf("%w %q: handshake: %v", ErrUnknownSegment, name, err)
	}
	_ = c.SetDeadline(time.Time{})
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		_ = c.Close()
		return 0, ErrClosed
	}
	id := e.nextSeg
	e.nextSeg++
	e.peers[id] = p
	e.mu.Unlock()
	e.wg.Add(1)
	go e.follow(p)
	return id, nil
}

// applySnapshot decodes a peer's region snapshot and resolves it for this process.
func (e *CUDAEngine) applySnapshot(p *cudaPeer, msg []byte) error {
	pid, regs, err := cudaDecodeRegions(msg)
	if err != nil {
		return err
	}
	spans := make(cudaSpans, len(regs))
	for i, r := range regs {
		s := cudaSpan{addr: r.Addr, len: r.Len, dev: -1}
		if r.CUDA != nil {
			s.dev = r.CUDA.Device
		}
		switch {
		case pid == e.pid && !e.testForeign:
			s.ptr = r.Ptr // same process: the owner's pointer is valid here
		case r.CUDA != nil:
			base, err := e.importHandle(r.CUDA)
			if err != nil {
				s.err = err
			} else {
				s.ptr = base + r.CUDA.Offset
			}
		case r.Kind == MemShared:
			if s.ptr, err = e.importShared(r); err != nil {
				s.err = err
			}
		default:
			s.err = errors.New("host memory of another process is not reachable through CUDA IPC")
		}
		spans[i] = s
	}
	p.pid = pid
	p.regs.Store(&regs)
	p.spans.Store(&spans)
	select {
	case p.updated <- struct{}{}:
	default:
	}
	return nil
}

// follow applies the peer's later snapshots until the connection ends.
func (e *CUDAEngine) follow(p *cudaPeer) {
	defer e.wg.Done()
	defer close(p.done)
	for {
		msg, err := cudaReadFrame(p.conn)
		if err == nil {
			err = e.applySnapshot(p, msg)
		}
		if err != nil {
			gone := fmt.Errorf("%w: %s: %v", ErrPeerGone, p.name, err)
			p.gone.Store(&gone)
			_ = p.conn.Close()
			return
		}
	}
}

// CloseSegment implements Engine.
func (e *CUDAEngine) CloseSegment(id SegmentID) error {
	e.mu.Lock()
	p, ok := e.peers[id]
	delete(e.peers, id)
	e.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownSegment, id)
	}
	_ = p.conn.Close()
	<-p.done
	return nil
}

// RemoteRegions implements Engine.
func (e *CUDAEngine) RemoteRegions(id SegmentID) ([]Region, error) {
	e.mu.RLock()
	p, ok := e.peers[id]
	e.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownSegment, id)
	}
	regs := *p.regs.Load()
	out := make([]Region, len(regs))
	for i, r := range regs {
		out[i] = r.Region
	}
	return out, nil
}

// cudaPrealloc is the most task slots AllocateBatch allocates ahead (12 bytes each); a batch
// declared larger grows in Submit.
const cudaPrealloc = 1 << 20

// AllocateBatch implements Engine.
func (e *CUDAEngine) AllocateBatch(capacity int) (BatchID, error) {
	if capacity <= 0 {
		return 0, fmt.Errorf("%w: batch capacity %d", ErrInvalidRequest, capacity)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return 0, ErrClosed
	}
	id := e.nextBatch
	e.nextBatch++
	// The task slots are allocated here, outside Submit (whose first copy should start as soon
	// as possible), as Mooncake allocates its task list with the batch.
	e.batches[id] = &cudaBatch{cap: capacity, errs: map[int]error{}, canceled: map[int32]bool{},
		lens: make([]uint64, 0, min(capacity, cudaPrealloc)), group: make([]int32, 0, min(capacity, cudaPrealloc))}
	return id, nil
}

func (e *CUDAEngine) batch(id BatchID) (*cudaBatch, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	b, ok := e.batches[id]
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownBatch, id)
	}
	return b, nil
}

// cudaSink runs groups of copy descriptors in order, like one CUDA stream. The engine's sink is
// the GPU (cudaGPUSink); tests of the submission logic use a host sink.
type cudaSink interface {
	// buffer returns an empty descriptor buffer with room for n descriptors.
	buffer(n int) (*cudaDescBuf, error)
	// release returns a buffer that was not run.
	release(buf *cudaDescBuf)
	// run starts the copies of buf (nil: none) and returns a group that completes after them
	// and after everything run before. On error the sink keeps buf.
	run(buf *cudaDescBuf) (*cudaGroup, error)
}

// cudaGPUSink runs descriptors with the copy kernel (or per-descriptor memcpy) on one device.
type cudaGPUSink struct {
	e *CUDAEngine
	d *cudaDev
}

// buffer hands out buffers of the full group size whatever n is (the first groups of a
// submission are smaller), so that every buffer of the pool fits every group.
func (s cudaGPUSink) buffer(n int) (*cudaDescBuf, error) {
	return s.d.getBuf(max(n, s.e.opt.GroupDescs))
}
func (s cudaGPUSink) release(buf *cudaDescBuf) { s.d.putBuf(buf) }
func (s cudaGPUSink) run(buf *cudaDescBuf) (*cudaGroup, error) {
	if buf == nil {
		return s.e.record(s.d, nil)
	}
	g, err := s.e.launch(s.d, buf)
	if err != nil {
		s.d.putBuf(buf)
	}
	return g, err
}

// backlog is the number of descriptors run on the device and not yet completed.
func (s cudaGPUSink) backlog() int { return int(s.d.queued.Load()) }

// cudaBacklogger is a sink that knows how many descriptors it still has to copy.
type cudaBacklogger interface{ backlog() int }

// firstGroup is the size of a submission's first descriptor group: cudaFirstGroup when the
// sink is idle, so that the copy starts after a few microseconds of building; when the sink
// is still copying earlier groups (the next batch of a streamed transfer), as many
// descriptors as it has queued, up to groupMax: building them takes a fraction of the time
// the sink needs for its backlog, and every group boundary is a kernel boundary at which the
// GPU drains (restarting at 1,024 for every batch of a stream made many small kernels).
func firstGroup(sink cudaSink, groupMax int) int {
	n := min(groupMax, cudaFirstGroup)
	if b, ok := sink.(cudaBacklogger); ok {
		n = min(groupMax, max(n, b.backlog()))
	}
	return n
}

func (e *CUDAEngine) sink() (cudaSink, error) {
	if e.testSink != nil {
		return e.testSink, nil
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return nil, err
	}
	return cudaGPUSink{e: e, d: d}, nil
}

// Task group markers (cudaBatch.group values below zero).
const (
	cudaTaskFailed     int32 = -1
	cudaTaskUnassigned int32 = -2
)

func (b *cudaBatch) fail(t int, err error) {
	b.group[t] = cudaTaskFailed
	b.gmu.Lock()
	b.errs[t] = err
	b.gmu.Unlock()
}

func (b *cudaBatch) addGroup(g *cudaGroup) int32 {
	b.gmu.Lock()
	defer b.gmu.Unlock()
	b.groups = append(b.groups, g)
	return int32(len(b.groups) - 1)
}

// shards is the number of goroutines that build the descriptors of n requests.
func (e *CUDAEngine) shards(n int) int {
	per := e.shardMin
	if per <= 0 {
		per = cudaShardMin
	}
	return max(1, min(e.opt.Workers, (n+per-1)/per))
}

// cudaShardMin is the fewest requests worth a descriptor-building goroutine of their own.
const cudaShardMin = 8192

// Submit implements Engine. Every request is bounds-checked against the local regions and the
// peer's advertised regions before any byte moves; refused requests fail as tasks. The rest
// are turned into copy descriptors — by up to Workers goroutines, each over a contiguous shard
// of the requests — and run in groups, each followed by an event.
func (e *CUDAEngine) Submit(ctx context.Context, id BatchID, reqs []Request) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	e.subMu.RLock()
	defer e.subMu.RUnlock()
	if e.shut.Load() {
		return ErrClosed
	}
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.lens)+len(reqs) > b.cap {
		return fmt.Errorf("%w: %d + %d > %d", ErrBatchFull, len(b.lens), len(reqs), b.cap)
	}
	e.mu.RLock()
	local := e.local
	segs := make(map[SegmentID]*cudaPeer, len(e.peers)) // a snapshot: the shards run unlocked
	for id, p := range e.peers {
		segs[id] = p
	}
	e.mu.RUnlock()

	// The task slots are sized here and filled by the shards (each owns its range).
	base := len(b.lens)
	b.lens = slices.Grow(b.lens, len(reqs))[:base+len(reqs)]
	b.group = slices.Grow(b.group, len(reqs))[:base+len(reqs)]
	sink, err := e.sink()
	if err != nil {
		for i, r := range reqs {
			b.lens[base+i] = r.Length
			b.fail(base+i, err)
		}
		return err
	}
	n := len(reqs)
	shards := e.shards(n)
	b.ready = nil
	if shards == 1 {
		err = e.submitShard(b, sink, reqs, base, local, segs)
	} else {
		size := (n + shards - 1) / shards
		var g errgroup.Group
		for lo := 0; lo < n; lo += size {
			hi := min(n, lo+size)
			g.Go(func() error { return e.submitShard(b, sink, reqs[lo:hi], base+lo, local, segs) })
		}
		err = g.Wait()
	}
	if err == nil && base == 0 {
		// Every copy is queued: while the GPU runs them, prepare what Wait returns if they
		// all complete, so that Wait costs nothing after the last copy.
		b.ready = b.optimistic()
	}
	return err
}

// optimistic returns every task's status assuming all groups complete.
func (b *cudaBatch) optimistic() []TaskStatus {
	out := make([]TaskStatus, len(b.lens))
	for t, gi := range b.group {
		if gi < 0 {
			out[t] = b.status(t)
		} else {
			out[t] = TaskStatus{State: TaskCompleted, BytesDone: b.lens[t]}
		}
	}
	return out
}

// cudaWindow caches the span the previous request resolved to on one side: [lo, hi) in the
// owner's addresses, ptr the address of lo in this process, dev where it lives. The zero value
// matches nothing.
type cudaWindow struct {
	lo, hi, ptr uint64
	dev         int
}

func (w *cudaWindow) set(s *cudaSpan) {
	*w = cudaWindow{lo: s.addr, hi: s.addr + s.len, ptr: s.ptr, dev: s.dev}
}

// cudaFirstGroup is the size of a shard's first descriptor group; later groups double up to
// GroupDescs, so that the GPU starts after a few microseconds of building and the host, which
// builds descriptors several times faster than the GPU copies them, stays ahead.
const cudaFirstGroup = 1024

// submitShard routes reqs (tasks base, base+1, …), fills descriptor buffers and runs each
// full one. A task is attached to the group holding its last descriptor: groups run in order,
// so that group's completion means all of the task's bytes have moved.
//
// The loop is the hot path of a submission (hundreds of thousands of requests for one long
// session): a request inside the spans the previous one resolved to (the common case, since
// planned requests are sorted by buffer) is checked with four compares and written straight
// into the descriptor buffer; anything else takes the full route (cudaRouteRequest: lookups,
// precise errors) and, when it succeeds, becomes the new cached window.
func (e *CUDAEngine) submitShard(b *cudaBatch, sink cudaSink, reqs []Request, base int, local cudaSpans, segs map[SegmentID]*cudaPeer) error {
	chunk, groupMax := e.opt.ChunkBytes, e.opt.GroupDescs
	// memcpy and batch copies are not split into chunks: one copy per request
	whole := e.opt.Copy == CUDACopyMemcpy || e.opt.Copy == CUDACopyBatch
	groupN := firstGroup(sink, groupMax)
	end := base + len(reqs)
	lens, group := b.lens[base:end], b.group[base:end]
	var buf *cudaDescBuf
	var descs []cudaDesc // buf's descriptors, full capacity; k are filled
	k := 0
	pend := 0 // first task (index into reqs) not yet attached to a group
	// flush runs buf (or, with no descriptors but tasks waiting, an empty group) and attaches
	// tasks [pend, upto) to it.
	flush := func(upto int) error {
		waiting := false
		for t := pend; t < upto && !waiting; t++ {
			waiting = group[t] != cudaTaskFailed
		}
		if buf != nil {
			buf.descs = descs[:k]
			if k == 0 {
				sink.release(buf)
				buf = nil
			}
		}
		descs, k = nil, 0
		if buf == nil && !waiting {
			pend = upto
			return nil
		}
		g, err := sink.run(buf)
		buf = nil
		if err != nil {
			return err
		}
		gi := b.addGroup(g)
		for t := pend; t < upto; t++ {
			if group[t] != cudaTaskFailed {
				group[t] = gi
			}
		}
		pend = upto
		groupN = min(groupMax, 2*groupN)
		return nil
	}
	cur := -1 // last task whose slot is filled
	abort := func(err error) error {
		if buf != nil {
			buf.descs = buf.descs[:0]
			sink.release(buf)
			buf = nil
		}
		for t := pend; t < len(reqs); t++ {
			if t > cur {
				lens[t] = reqs[t].Length
			} else if group[t] == cudaTaskFailed {
				continue // keeps its own reason
			}
			b.fail(base+t, err)
		}
		return err
	}

	var lastSeg SegmentID = -1
	var remote cudaSpans
	var segErr error
	var lw, rw cudaWindow
	lh, rh := -1, -1
	var peersOK [3]int
	peersOKSet := false
	for i := range reqs {
		r := &reqs[i]
		n := r.Length
		lens[i], group[i], cur = n, cudaTaskUnassigned, i
		if r.Target != lastSeg {
			lastSeg, rh, segErr, rw = r.Target, -1, nil, cudaWindow{}
			p, ok := segs[r.Target]
			switch {
			case !ok:
				segErr = fmt.Errorf("%w: %d", ErrUnknownSegment, r.Target)
			case p.gone.Load() != nil:
				segErr = *p.gone.Load()
			default:
				remote = *p.spans.Load()
			}
		}
		if segErr != nil {
			b.fail(base+i, segErr)
			continue
		}
		var src, dst uint64
		ls, rs := r.Source, r.TargetAddr
		if (r.Op == OpWrite || r.Op == OpRead) && n != 0 &&
			ls >= lw.lo && ls+n > ls && ls+n <= lw.hi && rs >= rw.lo && rs+n > rs && rs+n <= rw.hi {
			lp, rp := lw.ptr+(ls-lw.lo), rw.ptr+(rs-rw.lo)
			if r.Op == OpWrite {
				src, dst = lp, rp
			} else {
				src, dst = rp, lp
			}
		} else {
			rt, err := cudaRouteRequest(r, local, remote, e.defDev, &lh, &rh)
			if err == nil && (!peersOKSet || peersOK != [3]int{rt.dev, rt.srcDev, rt.dstDev}) {
				if err = e.ensurePeer(rt.dev, rt.srcDev); err == nil {
					err = e.ensurePeer(rt.dev, rt.dstDev)
				}
				if err == nil {
					peersOK, peersOKSet = [3]int{rt.dev, rt.srcDev, rt.dstDev}, true
				}
			}
			if err != nil {
				b.fail(base+i, err)
				continue
			}
			// The route succeeded, so lh and rh index the spans it used (and whose device
			// pair was just checked): later requests inside them take the fast path.
			lw.set(&local[lh])
			rw.set(&remote[rh])
			src, dst = rt.src, rt.dst
		}
		step := chunk
		if whole {
			step = n
		}
		for off := uint64(0); off < n; off += step {
			if buf == nil {
				var err error
				if buf, err = sink.buffer(groupN); err != nil {
					buf = nil
					return abort(err)
				}
				descs = buf.descs[:groupN]
			}
			descs[k] = cudaDesc{src: src + off, dst: dst + off, n: min(step, n-off)}
			k++
			if k == len(descs) {
				upto := i // this task's last descriptor is in the group only if no bytes remain
				if off+step >= n {
					upto = i + 1
				}
				if err := flush(upto); err != nil {
					return abort(err)
				}
			}
		}
	}
	if err := flush(len(reqs)); err != nil {
		return abort(err)
	}
	return nil
}

// launch uploads a group's descriptors and runs them (kernel, or one memcpy each), then
// records the group's event.
func (e *CUDAEngine) launch(d *cudaDev, buf *cudaDescBuf) (*cudaGroup, error) {
	n := len(buf.descs)
	switch e.opt.Copy {
	case CUDACopyMemcpy:
		for _, ds := range buf.descs {
			if err := d.ctx.MemcpyAsync(ds.dst, ds.src, ds.n, d.stream); err != nil {
				return nil, err
			}
		}
		return e.record(d, buf)
	case CUDACopyBatch:
		if n == 0 {
			return e.record(d, buf)
		}
		c := uint64(cap(buf.descs))
		if buf.batch == 0 {
			p, err := d.ctx.MemHostAlloc(3 * 8 * c)
			if err != nil {
				return nil, err
			}
			buf.batch = p
		}
		arr := unsafe.Slice((*uint64)(unsafe.Add(unsafe.Pointer(nil), uintptr(buf.batch))), 3*c)
		dsts, srcs, sizes := arr[:n], arr[c:c+uint64(n)], arr[2*c:2*c+uint64(n)]
		for i, ds := range buf.descs {
			dsts[i], srcs[i], sizes[i] = ds.dst, ds.src, ds.n
		}
		if err := d.ctx.MemcpyBatchAsync(buf.batch, buf.batch+8*c, buf.batch+16*c, n, d.stream); err != nil {
			return nil, err
		}
		return e.record(d, buf)
	}
	// The upload runs on its own stream, so that it overlaps the kernels of earlier groups;
	// the copy stream waits for it (an event) before this group's kernel.
	if err := d.ctx.MemcpyHtoDAsync(buf.dev, buf.host, uint64(n)*cuda.DescSize, d.up); err != nil {
		return nil, err
	}
	if err := d.ctx.EventRecord(buf.up, d.up); err != nil {
		return nil, err
	}
	if err := d.ctx.StreamWaitEvent(d.stream, buf.up); err != nil {
		return nil, err
	}
	fn, grid, block := d.fn, uint32(n), uint32(e.opt.BlockThreads)
	if e.opt.Copy == CUDACopyWarp {
		// enough CTAs to fill every multiprocessor once (2,048 threads each), fewer when the
		// group has fewer descriptors than the grid has warps
		warps := block / 32
		grid = min(uint32(max(1, d.sms))*(2048/block), (uint32(n)+warps-1)/warps)
		fn = d.warpFn
	}
	if err := d.ctx.LaunchCopy(fn, buf.dev, uint32(n), max(grid, 1), block, d.stream); err != nil {
		return nil, err
	}
	return e.record(d, buf)
}

func (e *CUDAEngine) record(d *cudaDev, buf *cudaDescBuf) (*cudaGroup, error) {
	ev, err := d.ctx.EventCreateSpin() // the completion goroutine's wait ends the transfer: no sleeping thread to wake
	if err != nil {
		return nil, err
	}
	if err := d.ctx.EventRecord(ev, d.stream); err != nil {
		_ = d.ctx.EventDestroy(ev)
		return nil, err
	}
	g := &cudaGroup{dev: d, ev: ev, buf: buf, done: make(chan struct{})}
	if buf != nil {
		g.n = int64(len(buf.descs))
		d.queued.Add(g.n)
	}
	d.pending <- g
	return g, nil
}

func (b *cudaBatch) status(t int) TaskStatus {
	gi := b.group[t]
	if gi < 0 {
		err := b.errs[t]
		if err == nil {
			err = fmt.Errorf("%w: not submitted", ErrInvalidRequest)
		}
		return TaskStatus{State: TaskFailed, Err: err}
	}
	g := b.groups[gi]
	select {
	case <-g.done:
		if b.canceled[gi] {
			return TaskStatus{State: TaskCanceled, Err: context.Canceled}
		}
		if g.err != nil {
			return TaskStatus{State: TaskFailed, Err: g.err}
		}
		return TaskStatus{State: TaskCompleted, BytesDone: b.lens[t]}
	default:
		if b.canceled[gi] {
			return TaskStatus{State: TaskCanceled, Err: context.Canceled}
		}
		return TaskStatus{State: TaskPending}
	}
}

// Status implements Engine.
func (e *CUDAEngine) Status(id BatchID, task int) (TaskStatus, error) {
	b, err := e.batch(id)
	if err != nil {
		return TaskStatus{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if task < 0 || task >= len(b.lens) {
		return TaskStatus{}, fmt.Errorf("%w: task %d of %d", ErrInvalidRequest, task, len(b.lens))
	}
	return b.status(task), nil
}

// Wait implements Engine.
func (e *CUDAEngine) Wait(ctx context.Context, id BatchID) ([]TaskStatus, error) {
	b, err := e.batch(id)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	groups := append([]*cudaGroup(nil), b.groups...)
	b.mu.Unlock()
	var werr error
	for _, g := range groups {
		select {
		case <-g.done:
		case <-ctx.Done():
			werr = ctx.Err()
		}
		if werr != nil {
			break
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if werr == nil && b.allCompleted() {
		if out := b.ready; len(out) == len(b.lens) {
			b.ready = nil
			return out, nil
		}
	}
	return b.statuses(), werr
}

// allCompleted reports whether every group has finished without error or cancel.
func (b *cudaBatch) allCompleted() bool {
	if len(b.canceled) > 0 {
		return false
	}
	for _, g := range b.groups {
		select {
		case <-g.done:
			if g.err != nil {
				return false
			}
		default:
			return false
		}
	}
	return true
}

// statuses is status for every task, looking at each group once.
func (b *cudaBatch) statuses() []TaskStatus {
	const (
		pending = iota
		completed
		failed
		canceled
	)
	gs := make([]uint8, len(b.groups))
	for i, g := range b.groups {
		select {
		case <-g.done:
			gs[i] = completed
			if g.err != nil {
				gs[i] = failed
			}
		default:
		}
		if b.canceled[int32(i)] {
			gs[i] = canceled
		}
	}
	out := make([]TaskStatus, len(b.lens))
	for t := range out {
		gi := b.group[t]
		if gi < 0 {
			out[t] = b.status(t)
			continue
		}
		switch gs[gi] {
		case completed:
			out[t] = TaskStatus{State: TaskCompleted, BytesDone: b.lens[t]}
		case failed:
			out[t] = TaskStatus{State: TaskFailed, Err: b.groups[gi].err}
		case canceled:
			out[t] = TaskStatus{State: TaskCanceled, Err: context.Canceled}
		default:
			out[t] = TaskStatus{State: TaskPending}
		}
	}
	return out
}

// Cancel implements Engine. Copies already launched cannot be stopped: their tasks report
// canceled (the target bytes are undefined) and FreeBatch waits for the GPU to finish them.
func (e *CUDAEngine) Cancel(id BatchID) error {
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, g := range b.groups {
		select {
		case <-g.done:
		default:
			b.canceled[int32(i)] = true
		}
	}
	return nil
}

// FreeBatch implements Engine: refused (ErrBatchBusy) while copies are in flight, except for a
// canceled batch, whose in-flight copies it waits out.
func (e *CUDAEngine) FreeBatch(id BatchID) error {
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	for i, g := range b.groups {
		select {
		case <-g.done:
		default:
			if !b.canceled[int32(i)] {
				b.mu.Unlock()
				return ErrBatchBusy
			}
			<-g.done
		}
	}
	b.mu.Unlock()
	e.mu.Lock()
	delete(e.batches, id)
	e.mu.Unlock()
	return nil
}

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
