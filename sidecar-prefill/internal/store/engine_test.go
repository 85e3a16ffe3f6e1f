package store

import (
	"errors"
	"unsafe"

	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// regEngine records what a sidecar registers and allocates; only the methods the pool code
// calls are implemented (the real cuda engine's import of IPC regions runs in the GPU tests of
// pkg/rdma). failAt makes the n-th RegisterMemory fail (1-based).
type regEngine struct {
	rdma.Engine
	backend string
	regs    map[uint64]rdma.Region
	failAt  int
	calls   int
	pinned  map[uint64][]byte
}

func newRegEngine(backend string) *regEngine {
	return &regEngine{backend: backend, regs: map[uint64]rdma.Region{}, pinned: map[uint64][]byte{}}
}

func (e *regEngine) Backend() string { return e.backend }
func (e *regEngine) RegisterMemory(r rdma.Region) error {
	e.calls++
	if e.failAt > 0 && e.calls >= e.failAt {
		return errors.New("registration refused")
	}
	e.regs[r.Addr] = r
	return nil
}
func (e *regEngine) UnregisterMemory(addr uint64) error {
	if _, ok := e.regs[addr]; !ok {
		return errors.New("not registered")
	}
	delete(e.regs, addr)
	return nil
}
func (e *regEngine) AllocPinned(n uint64) (uint64, []byte, error) {
	b := make([]byte, n)
	p := uint64(uintptr(unsafe.Pointer(&b[0])))
	e.pinned[p] = b
	return p, b, nil
}
func (e *regEngine) FreeMemory(p uint64) error {
	if _, ok := e.pinned[p]; !ok {
		return errors.New("not allocated")
	}
	delete(e.pinned, p)
	return nil
}
