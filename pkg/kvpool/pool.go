package kvpool

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// MemfdDir passed as Create's dir puts the pool in an anonymous memfd instead of a file; its
// Path is then /proc/<pid>/fd/<n>, which another process of the same user can open while the
// creator lives.
const MemfdDir = "memfd"

// DefaultDir is where Create puts pool files when dir is empty.
const DefaultDir = "/dev/shm"

// ErrBadSpec is wrapped by errors about pool shapes and page lists.
var ErrBadSpec = errors.New("kvpool: bad pool spec")

// Spec is the shape of a KV pool: 2×NumLayers buffers (layer 0 K, layer 0 V, ...; MLA: one
// buffer per layer) of PageCount pages of ItemLen bytes (PageSize tokens per page).
type Spec struct {
	PageSize  int
	ItemLen   uint64
	NumLayers int
	PageCount int64
	// MLA: one buffer per layer (SGLang's MLATokenToKVPool) instead of K and V.
	MLA bool
	// Name is a prefix of the file name (default "kvc-pool").
	Name string
}

// Validate checks the spec.
func (s Spec) Validate() error {
	switch {
	case s.PageSize <= 0, s.NumLayers <= 0, s.PageCount <= 0, s.ItemLen == 0:
		return fmt.Errorf("%w: page size %d, item length %d, layers %d, pages %d", ErrBadSpec, s.PageSize, s.ItemLen, s.NumLayers, s.PageCount)
	case s.ItemLen%uint64(s.PageSize) != 0:
		return fmt.Errorf("%w: item length %d not a multiple of page size %d", ErrBadSpec, s.ItemLen, s.PageSize)
	}
	hi, _ := bits.Mul64(uint64(s.PageCount), s.ItemLen)
	if hi != 0 || uint64(s.PageCount)*s.ItemLen > 1<<46 {
		return fmt.Errorf("%w: %d pages of %d bytes is too large", ErrBadSpec, s.PageCount, s.ItemLen)
	}
	return nil
}

// NumBuffers is 2×NumLayers, or NumLayers for an MLA pool.
func (s Spec) NumBuffers() int {
	if s.MLA {
		return s.NumLayers
	}
	return 2 * s.NumLayers
}

// BufferStride is the distance between buffers in the pool file: the buffer length rounded up to
// the OS page size, so every buffer starts at a mappable offset.
func (s Spec) BufferStride() uint64 {
	ps := uint64(os.Getpagesize())
	n := uint64(s.PageCount) * s.ItemLen
	return (n + ps - 1) / ps * ps
}

// Buffers is a KV pool seen from one process: its layout (addresses in this process) and the
// bytes of each buffer. *Pool and *View implement it.
type Buffers interface {
	Layout() rdma.Layout
	Buffer(i int) []byte
}

// Pool is a worker's KV pool in one shared-memory file (or memfd), mapped in this process.
type Pool struct {
	spec  Spec
	path  string
	owner bool
	memfd bool
	file  *os.File
	mem   []byte
	bufs  [][]byte

	closeOnce sync.Once
	closeErr  error
}

// Create makes a pool: one file of 2×layers buffers under dir (DefaultDir when empty, MemfdDir
// for a memfd), sized and mapped shared. The creator owns it: Close unmaps and unlinks.
func Create(dir string, s Spec) (*Pool, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if s.Name == "" {
		s.Name = "kvc-pool"
	}
	stride := s.BufferStride()
	nb := s.NumBuffers()
	size := stride * uint64(nb)
	if size/uint64(nb) != stride || size > 1<<46 {
		return nil, fmt.Errorf("%w: pool of %d buffers of %d bytes is too large", ErrBadSpec, nb, stride)
	}
	var (
		f    *os.File
		path string
	)
	if dir == MemfdDir {
		fd, err := unix.MemfdCreate(s.Name, unix.MFD_CLOEXEC)
		if err != nil {
			return nil, fmt.Errorf("kvpool: memfd_create: %w", err)
		}
		f = os.NewFile(uintptr(fd), s.Name)
		path = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), fd)
	} else {
		if dir == "" {
			dir = DefaultDir
		}
		var rnd [6]byte
		if _, err := rand.Read(rnd[:]); err != nil {
			return nil, err
		}
		path = filepath.Join(dir, fmt.Sprintf("%s-%d-%s", s.Name, os.Getpid(), hex.EncodeToString(rnd[:])))
		var err error
		f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		if err != nil {
			return nil, fmt.Errorf("kvpool: create pool file: %w", err)
		}
	}
	p := &Pool{spec: s, path: path, owner: true, memfd: dir == MemfdDir, file: f}
	if err := f.Truncate(int64(size)); err != nil {
		p.cleanup()
		return nil, fmt.Errorf("kvpool: size pool file to %d bytes: %w", size, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		p.cleanup()
		return nil, fmt.Errorf("kvpool: mmap %d bytes: %w", size, err)
	}
	p.mem = mem
	p.bufs = make([][]byte, nb)
	n := uint64(s.PageCount) * s.ItemLen
	for i := range p.bufs {
		off := uint64(i) * stride
		p.bufs[i] = mem[off : off+n : off+n]
	}
	return p, nil
}

func (p *Pool) cleanup() {
	if p.file != nil {
		_ = p.file.Close()
	}
	if p.owner && !p.memfd {
		_ = os.Remove(p.path)
	}
}

// Unlink removes a file pool's name from its directory right away (a memfd pool has none):
// the memory lives on for this process's mappings and descriptor, and for every process that
// already mapped it, but nothing is left behind in the directory when the process dies, even by
// kill -9. Path then becomes /proc/<pid>/fd/<n>, which a process of the same user can open
// (and map) while this one lives — as for a memfd pool.
func (p *Pool) Unlink() error {
	if !p.owner || p.memfd || p.file == nil {
		return nil
	}
	if err := os.Remove(p.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("kvpool: unlink pool file: %w", err)
	}
	p.memfd = true // no name left to remove at Close
	p.path = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), p.file.Fd())
	return nil
}

// Spec returns the pool's shape.
func (p *Pool) Spec() Spec { return p.spec }

// Path is the file another process maps (a /dev/shm path or /proc/<pid>/fd/<n>).
func (p *Pool) Path() string { return p.path }

// Offset is the offset of buffer i in the pool file.
func (p *Pool) Offset(i int) int64 { return int64(uint64(i) * p.spec.BufferStride()) }

// Buffer returns buffer i (0 ≤ i < 2×layers; layer l K is 2l, V is 2l+1).
func (p *Pool) Buffer(i int) []byte { return p.bufs[i] }

// NumBuffers is 2×layers (layers for an MLA pool).
func (p *Pool) NumBuffers() int { return len(p.bufs) }

// Layout describes the pool with this process's addresses.
func (p *Pool) Layout() rdma.Layout {
	l := rdma.Layout{PageSize: p.spec.PageSize, ItemLen: p.spec.ItemLen, NumLayers: p.spec.NumLayers, PageCount: p.spec.PageCount, MLA: p.spec.MLA}
	for _, b := range p.bufs {
		l.BufferAddrs = append(l.BufferAddrs, addrOf(b))
	}
	return l
}

// Close unmaps the pool and, for the owner, removes its file. Buffers must not be used after.
func (p *Pool) Close() error {
	p.closeOnce.Do(func() {
		if p.mem != nil {
			p.closeErr = unix.Munmap(p.mem)
			p.mem, p.bufs = nil, nil
		}
		p.cleanup()
	})
	return p.closeErr
}

// Mapping is a region mapped into this process (a worker's pool file, or anonymous memory). Its
// address is stable until Close.
type Mapping struct {
	mem  []byte // the whole mapping (page aligned)
	b    []byte // the requested bytes
	once sync.Once
	err  error
}

// Map maps size bytes at offset of a pool file created by another process (shared, read-write):
// what a sidecar does with a worker's SharedMemoryRef. offset need not be page aligned.
func Map(path string, offset, size int64) (*Mapping, error) {
	if offset < 0 || size <= 0 || offset+size < offset {
		return nil, fmt.Errorf("%w: map offset %d size %d", ErrBadSpec, offset, size)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("kvpool: open pool file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("kvpool: stat pool file: %w", err)
	}
	if offset+size > st.Size() {
		return nil, fmt.Errorf("%w: [%d, %d) beyond the %d bytes of %s", ErrBadSpec, offset, offset+size, st.Size(), path)
	}
	ps := int64(os.Getpagesize())
	start := offset / ps * ps
	mem, err := unix.Mmap(int(f.Fd()), start, int(offset+size-start), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("kvpool: mmap %s: %w", path, err)
	}
	in := offset - start
	return &Mapping{mem: mem, b: mem[in : in+size : in+size]}, nil
}

// Arena maps n bytes of anonymous private memory (zeroed, page aligned, never moved): host memory
// for registration, such as the prefill snapshot store.
func Arena(n int64) (*Mapping, error) {
	if n <= 0 || n > 1<<46 {
		return nil, fmt.Errorf("%w: arena of %d bytes", ErrBadSpec, n)
	}
	mem, err := unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("kvpool: mmap arena of %d bytes: %w", n, err)
	}
	return &Mapping{mem: mem, b: mem}, nil
}

// Bytes returns the mapped bytes.
func (m *Mapping) Bytes() []byte { return m.b }

// Addr is the address of the first byte, for rdma.Region.
func (m *Mapping) Addr() uint64 { return addrOf(m.b) }

// Len is the mapped length.
func (m *Mapping) Len() uint64 { return uint64(len(m.b)) }

// Close unmaps; the bytes must not be used after.
func (m *Mapping) Close() error {
	m.once.Do(func() {
		if m.mem != nil {
			m.err = unix.Munmap(m.mem)
			m.mem, m.b = nil, nil
		}
	})
	return m.err
}

func addrOf(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b))))
}

// View is a pool seen through separately mapped buffers (what a sidecar builds from a worker's
// RegisterKVPool). It implements Buffers.
type View struct {
	L    rdma.Layout
	Bufs [][]byte
}

// NewView checks that bufs match l (one per buffer, each at its address and long enough).
func NewView(l rdma.Layout, bufs [][]byte) (*View, error) {
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if len(bufs) != l.NumBuffers() {
		return nil, fmt.Errorf("%w: %d buffers for %d layers", ErrBadSpec, len(bufs), l.NumLayers)
	}
	for i, b := range bufs {
		if uint64(len(b)) < l.BufferLen() || addrOf(b) != l.BufferAddrs[i] {
			return nil, fmt.Errorf("%w: buffer %d does not match the layout", ErrBadSpec, i)
		}
	}
	return &View{L: l, Bufs: bufs}, nil
}

// Layout returns the view's layout.
func (v *View) Layout() rdma.Layout { return v.L }

// Buffer returns buffer i.
func (v *View) Buffer(i int) []byte { return v.Bufs[i] }
