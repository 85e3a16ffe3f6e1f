package kvxfer

import (
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Limits on what a worker may register.
const (
	MaxLayers    = 1024
	MaxPageCount = 1 << 30
	MaxPageSize  = 1 << 16
	MaxItemLen   = 1 << 30
)

// Pool is a paged KV pool mapped into this process: 2·layers buffers (layer 0 K, layer 0 V, ...;
// an MHA pool) or, for an MLA pool, one buffer per layer (KV_KIND_COMBINED), of PageCount pages
// of ItemLen bytes. It is either a worker's pool (shared-memory files mapped from
// RegisterKVPool) or the sidecar's own arena (the prefill snapshot store).
type Pool struct {
	PageSize  int32
	ItemLen   int64
	PageCount int64
	NumLayers int32
	// MLA: one buffer per layer (SGLang's MLATokenToKVPool) instead of K and V.
	MLA bool
	// Registration metadata of a worker's pool (zero for an arena): tensor-parallel rank and
	// size (TPSize ≥ 1) and the bytes of each aux (metadata) row.
	TPRank, TPSize int32
	AuxItemLens    []int64

	bufs    [][]byte
	maps    [][]byte // mappings to unmap on Close
	regions []rdma.Region
	eng     rdma.Engine
	// addrs, when set, are the buffers' addresses for a pool without a CPU view (a worker's
	// GPU pool imported by CUDA IPC, pool_cuda.go); bufs is then empty.
	addrs []uint64
	// frees release memory that is not a mapping (pinned host memory), after unregistering.
	frees []func()
}

// Buffers is the number of buffers (2·layers; layers for an MLA pool).
func (p *Pool) Buffers() int {
	if p.MLA {
		return int(p.NumLayers)
	}
	return int(2 * p.NumLayers)
}

// LayoutName is "MLA" or "MHA".
func (p *Pool) LayoutName() string {
	if p.MLA {
		return "MLA"
	}
	return "MHA"
}

// Buffer returns buffer b's memory.
func (p *Pool) Buffer(b int) []byte { return p.bufs[b] }

// TokenBytes is bytes per token per buffer.
func (p *Pool) TokenBytes() int64 { return p.ItemLen / int64(p.PageSize) }

// BytesPerToken is the KV bytes of one token over all buffers.
func (p *Pool) BytesPerToken() int64 { return p.TokenBytes() * int64(p.Buffers()) }

// CapacityTokens is the number of tokens the pool holds.
func (p *Pool) CapacityTokens() int64 { return p.PageCount * int64(p.PageSize) }

// Layout describes the pool with its local addresses (what peers target).
func (p *Pool) Layout() *kvcv1.KVLayout {
	l := &kvcv1.KVLayout{PageSize: p.PageSize, ItemLen: p.ItemLen, NumLayers: p.NumLayers, PageCount: p.PageCount}
	if p.addrs != nil {
		l.BufferAddrs = append(l.BufferAddrs, p.addrs...)
		return l
	}
	for _, b := range p.bufs {
		l.BufferAddrs = append(l.BufferAddrs, addrOf(b))
	}
	return l
}

// TokenSlot returns the bytes of token t (t-th token of the page map) in buffer b.
func (p *Pool) TokenSlot(pages []int64, t int64, b int) []byte {
	ps := int64(p.PageSize)
	off := pages[t/ps]*p.ItemLen + (t%ps)*p.TokenBytes()
	return p.bufs[b][off : off+p.TokenBytes()]
}

// CheckPages verifies that every page index lies inside the pool.
func (p *Pool) CheckPages(pages []int64) error {
	for i, pg := range pages {
		if pg < 0 || pg >= p.PageCount {
			return status.Errorf(codes.OutOfRange, "page %d (position %d) outside the registered pool of %d pages", pg, i, p.PageCount)
		}
	}
	return nil
}

func addrOf(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}

// Shape is the geometry of a pool: PageCount pages of ItemLen bytes (PageSize tokens) in each
// of its buffers, K and V per layer, or one buffer per layer for an MLA pool.
type Shape struct {
	PageSize  int32
	ItemLen   int64
	PageCount int64
	NumLayers int32
	MLA       bool
}

// Shape is the pool's geometry.
func (p *Pool) Shape() Shape {
	return Shape{PageSize: p.PageSize, ItemLen: p.ItemLen, PageCount: p.PageCount, NumLayers: p.NumLayers, MLA: p.MLA}
}

// Buffers is the number of buffers of a pool of this shape (2·layers; layers for MLA).
func (s Shape) Buffers() int {
	if s.MLA {
		return int(s.NumLayers)
	}
	return int(2 * s.NumLayers)
}

// Check returns an InvalidArgument status when the shape is out of this package's limits.
func (s Shape) Check() error {
	return checkGeometry(s.PageSize, s.ItemLen, s.PageCount, s.NumLayers)
}

// Memory is what a caller allocated for a pool it builds itself (a snapshot store): CPU views
// of the buffers (Bufs) or, for memory without one, the buffers' addresses (Addrs, non-nil).
// Free releases it, after the pool's regions are unregistered, on Close.
type Memory struct {
	Bufs  [][]byte
	Addrs []uint64
	Free  []func()
}

// Adopt returns a pool of shape s over mem (s is not checked: Check it before allocating).
// Register its memory with RegisterRegions; Close unregisters and frees it.
func Adopt(s Shape, mem Memory) *Pool {
	return &Pool{PageSize: s.PageSize, ItemLen: s.ItemLen, PageCount: s.PageCount, NumLayers: s.NumLayers, MLA: s.MLA,
		bufs: mem.Bufs, addrs: mem.Addrs, frees: mem.Free}
}

// RegisterRegions registers regions with eng as the pool's memory; Close unregisters them. On
// an error the regions registered so far are unregistered again.
func (p *Pool) RegisterRegions(eng rdma.Engine, regions ...rdma.Region) error {
	p.eng = eng
	for i, r := range regions {
		if err := eng.RegisterMemory(r); err != nil {
			p.unregister()
			return fmt.Errorf("register region %d: %w", i, err)
		}
		p.regions = append(p.regions, r)
	}
	return nil
}

func checkGeometry(pageSize int32, itemLen, pageCount int64, layers int32) error {
	switch {
	case pageSize <= 0 || pageSize > MaxPageSize:
		return status.Errorf(codes.InvalidArgument, "page_size %d out of range [1, %d]", pageSize, MaxPageSize)
	case itemLen <= 0 || itemLen > MaxItemLen:
		return status.Errorf(codes.InvalidArgument, "item_len %d out of range [1, %d]", itemLen, MaxItemLen)
	case itemLen%int64(pageSize) != 0:
		return status.Errorf(codes.InvalidArgument, "item_len %d is not a multiple of page_size %d", itemLen, pageSize)
	case pageCount <= 0 || pageCount > MaxPageCount:
		return status.Errorf(codes.InvalidArgument, "page_count %d out of range [1, %d]", pageCount, MaxPageCount)
	case layers <= 0 || layers > MaxLayers:
		return status.Errorf(codes.InvalidArgument, "num_layers %d out of range [1, %d]", layers, MaxLayers)
	case itemLen > (1<<46)/pageCount:
		return status.Errorf(codes.InvalidArgument, "buffer of %d pages x %d bytes is too large", pageCount, itemLen)
	}
	return nil
}

// MapPool validates a RegisterKVPool request and maps its shared-memory buffers. CUDA IPC
// buffers are refused here (they belong to the cuda transport, not to a CPU mapping).
func MapPool(req *kvcv1.RegisterKVPoolRequest) (*Pool, error) {
	if err := checkGeometry(req.GetPageSize(), req.GetItemLen(), req.GetPageCount(), req.GetNumLayers()); err != nil {
		return nil, err
	}
	p, err := checkRegistration(req)
	if err != nil {
		return nil, err
	}
	need := p.ItemLen * p.PageCount
	for i, b := range req.GetBuffers() {
		switch m := b.GetMemory().(type) {
		case *kvcv1.KVBuffer_Shm:
			mem, whole, err := mapShared(m.Shm.GetPath(), m.Shm.GetOffset(), need)
			if err != nil {
				p.unmap()
				return nil, status.Errorf(codes.InvalidArgument, "buffer %d: %v", i, err)
			}
			p.bufs = append(p.bufs, mem)
			p.maps = append(p.maps, whole)
		case *kvcv1.KVBuffer_Cuda:
			p.unmap()
			return nil, status.Errorf(codes.Unimplemented, "buffer %d is a CUDA IPC handle; this sidecar maps shared-memory pools only (use the cuda transport build)", i)
		default:
			p.unmap()
			return nil, status.Errorf(codes.InvalidArgument, "buffer %d has no memory reference", i)
		}
	}
	return p, nil
}

// NewArena allocates a pool of shape s in this process's own (anonymous, page-aligned) memory.
func NewArena(s Shape) (*Pool, error) {
	return newArena(s.PageSize, s.ItemLen, s.PageCount, s.NumLayers, s.MLA)
}

func newArena(pageSize int32, itemLen, pageCount int64, layers int32, mla bool) (*Pool, error) {
	if err := checkGeometry(pageSize, itemLen, pageCount, layers); err != nil {
		return nil, err
	}
	p := &Pool{PageSize: pageSize, ItemLen: itemLen, PageCount: pageCount, NumLayers: layers, MLA: mla}
	n := itemLen * pageCount
	for i := 0; i < p.Buffers(); i++ {
		mem, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			p.unmap()
			return nil, fmt.Errorf("arena: mmap %d bytes: %w", n, err)
		}
		p.bufs = append(p.bufs, mem)
		p.maps = append(p.maps, mem)
	}
	return p, nil
}

func mapShared(path string, off, size int64) (mem, whole []byte, err error) {
	if path == "" {
		return nil, nil, fmt.Errorf("shared-memory path is empty")
	}
	if off < 0 {
		return nil, nil, fmt.Errorf("negative offset %d", off)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, nil, fmt.Errorf("%s is not a regular file", path)
	}
	if off+size > st.Size() || off+size < off {
		return nil, nil, fmt.Errorf("%s is %d bytes; [%d, %d) does not fit", path, st.Size(), off, off+size)
	}
	pg := int64(os.Getpagesize())
	start := off / pg * pg
	whole, err = syscall.Mmap(int(f.Fd()), start, int(off+size-start), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("mmap %s: %w", path, err)
	}
	return whole[off-start : off-start+size : off-start+size], whole, nil
}

// Register registers every buffer with the engine (once).
func (p *Pool) Register(eng rdma.Engine, location string) error {
	p.eng = eng // set first: a failure below unregisters what was registered
	for i, b := range p.bufs {
		r := rdma.Region{Addr: addrOf(b), Len: uint64(len(b)), Kind: rdma.MemShared, Location: location}
		if location == "host" {
			r.Kind = rdma.MemHost
		}
		if err := eng.RegisterMemory(r); err != nil {
			p.unregister()
			return fmt.Errorf("register buffer %d: %w", i, err)
		}
		p.regions = append(p.regions, r)
	}
	p.eng = eng
	return nil
}

func (p *Pool) unregister() {
	if p.eng == nil && len(p.regions) == 0 {
		return
	}
	for _, r := range p.regions {
		if p.eng != nil {
			_ = p.eng.UnregisterMemory(r.Addr)
		}
	}
	p.regions = nil
}

// unmap releases the mappings. bufs keeps its (now dangling) slice headers so that a
// concurrent Layout of a replaced pool reads stale addresses, which the engine no longer has
// registered, instead of racing with this write.
func (p *Pool) unmap() {
	for _, m := range p.maps {
		_ = syscall.Munmap(m)
	}
	p.maps = nil
	for _, f := range p.frees {
		f()
	}
	p.frees = nil
}

// Close unregisters the buffers from the engine and unmaps them. The caller guarantees no
// transfer uses the pool any more.
func (p *Pool) Close() {
	p.unregister()
	p.unmap()
}

// HostVisible reports whether the pool's bytes can be read by the CPU (Buffer, TokenSlot). A
// worker's GPU pool and a device-memory store cannot.
func (p *Pool) HostVisible() bool { return p.addrs == nil }
