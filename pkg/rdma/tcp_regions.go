package rdma

import (
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"
)

// memAt is the registered memory [addr, addr+n). Only called after a bounds check against a
// registered region whose read lock is held.
func memAt(addr, n uint64) []byte {
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}

// memRegion is a registered region. Copies hold a reference (use/release) while they touch its
// bytes; UnregisterMemory marks it gone and waits until no reference is left, so no copy ever
// touches a withdrawn region. References nest (a sender holds many while one writev runs).
type memRegion struct {
	Region
	users atomic.Int64
	gone  atomic.Bool
	mu    sync.Mutex
	cond  *sync.Cond
}

func newMemRegion(r Region) *memRegion {
	m := &memRegion{Region: r}
	m.cond = sync.NewCond(&m.mu)
	return m
}

// use takes a reference; it fails once the region is withdrawn.
func (m *memRegion) use() bool {
	m.users.Add(1)
	if m.gone.Load() {
		m.release()
		return false
	}
	return true
}

func (m *memRegion) release() {
	if m.users.Add(-1) == 0 && m.gone.Load() {
		m.mu.Lock()
		m.cond.Broadcast()
		m.mu.Unlock()
	}
}

// withdraw marks the region gone and waits for the copies in flight.
func (m *memRegion) withdraw() {
	m.mu.Lock()
	m.gone.Store(true)
	for m.users.Load() > 0 {
		m.cond.Wait()
	}
	m.mu.Unlock()
}

// regionTable is a sorted set of non-overlapping regions.
type regionTable struct {
	mu   sync.RWMutex
	regs []*memRegion
}

func (t *regionTable) add(r Region) error {
	if r.Len == 0 || r.Addr == 0 || r.Addr+r.Len < r.Addr {
		return fmt.Errorf("%w: region [%#x, +%d)", ErrInvalidRequest, r.Addr, r.Len)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].Addr >= r.Addr })
	if i < len(t.regs) && t.regs[i].Addr < r.Addr+r.Len || i > 0 && t.regs[i-1].Addr+t.regs[i-1].Len > r.Addr {
		return fmt.Errorf("%w: region [%#x, +%d) overlaps a registered region", ErrInvalidRequest, r.Addr, r.Len)
	}
	t.regs = append(t.regs, nil)
	copy(t.regs[i+1:], t.regs[i:])
	t.regs[i] = newMemRegion(r)
	return nil
}

func (t *regionTable) remove(addr uint64) error {
	t.mu.Lock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].Addr >= addr })
	if i == len(t.regs) || t.regs[i].Addr != addr {
		t.mu.Unlock()
		return fmt.Errorf("%w: no region registered at %#x", ErrInvalidRequest, addr)
	}
	r := t.regs[i]
	t.regs = append(t.regs[:i], t.regs[i+1:]...)
	t.mu.Unlock()
	r.withdraw()
	return nil
}

// find returns the region holding [addr, addr+n), or nil.
func (t *regionTable) find(addr, n uint64) *memRegion {
	t.mu.RLock()
	defer t.mu.RUnlock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].Addr > addr })
	if i == 0 {
		return nil
	}
	if r := t.regs[i-1]; r.Contains(addr, n) {
		return r
	}
	return nil
}

// acquire returns the region holding [addr, addr+n) with a reference taken, or nil.
func (t *regionTable) acquire(addr, n uint64) *memRegion {
	r := t.find(addr, n)
	if r == nil || !r.use() {
		return nil
	}
	return r
}

func (t *regionTable) list() []Region {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := make([]Region, len(t.regs))
	for i, r := range t.regs {
		out[i] = r.Region
	}
	return out
}
