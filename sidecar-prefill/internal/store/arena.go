package store

import (
	"fmt"
	"unsafe"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// Store memory kinds (kvc-sidecar-prefill --store-memory).
const (
	MemoryHost = "host" // anonymous host memory; pinned host memory with the cuda backend
	MemoryCUDA = "cuda" // device memory of the engine's GPU (cuda backend only)
)

// NewArena allocates a prefill snapshot store of shape s (a worker's pool's shape with the
// store's page count) in memory and registers it with eng.
//
// MemoryHost (the default; any value but MemoryCUDA): anonymous host memory
// (kvxfer.NewArena) for the tcp and mooncake backends; with the cuda backend a shared-memory
// file (a memfd, reachable by path as /proc/<pid>/fd/<n> to processes of the same user while
// this one lives) mapped here and registered as one rdma.MemShared region with its path as
// Location. The cuda engine page-locks and device-maps it, and so does a peer's engine that
// opens this segment (it maps the file by that path), so a decode sidecar's copy kernel pushes
// into it one-sided, as into its own pinned memory. The store keeps a CPU view (the HTTP
// snapshot endpoint reads it).
//
// MemoryCUDA: device memory of the engine's GPU (one AllocDevice allocation per buffer,
// registered as rdma.MemCUDA, so that peers import it by IPC and write into it over NVLink); it
// needs the cuda backend. The pool has addresses (Layout) but no CPU view: HostVisible is
// false, and its bytes are read with a Reader (a copy through the engine).
//
// Close unregisters, unmaps and releases it.
func NewArena(eng rdma.Engine, memory string, s kvxfer.Shape) (*kvxfer.Pool, error) {
	if memory == MemoryCUDA {
		return newDeviceArena(eng, s)
	}
	return newArena(eng, s)
}

func newArena(eng rdma.Engine, s kvxfer.Shape) (*kvxfer.Pool, error) {
	if eng.Backend() != "cuda" {
		arena, err := kvxfer.NewArena(s)
		if err != nil {
			return nil, err
		}
		if err := arena.Register(eng, "host"); err != nil {
			arena.Close()
			return nil, err
		}
		return arena, nil
	}
	if err := s.Check(); err != nil {
		return nil, err
	}
	return newSharedStore(eng, kvpool.MemfdDir, s)
}

// newSharedStore creates the store as one kvpool file under dir (kvpool.MemfdDir for a memfd)
// and registers the whole file as a MemShared region named by its path.
func newSharedStore(eng rdma.Engine, dir string, s kvxfer.Shape) (*kvxfer.Pool, error) {
	kp, err := kvpool.Create(dir, kvpool.Spec{PageSize: int(s.PageSize), ItemLen: uint64(s.ItemLen), NumLayers: int(s.NumLayers), PageCount: s.PageCount, Name: "kvc-store", MLA: s.MLA})
	if err != nil {
		return nil, fmt.Errorf("arena: shared store: %w", err)
	}
	mem := kvxfer.Memory{Free: []func(){func() { _ = kp.Close() }}}
	for i := 0; i < kp.NumBuffers(); i++ {
		mem.Bufs = append(mem.Bufs, kp.Buffer(i))
	}
	p := kvxfer.Adopt(s, mem)
	r := rdma.Region{
		Addr: addrOf(kp.Buffer(0)), Len: kp.Spec().BufferStride() * uint64(kp.NumBuffers()),
		Kind: rdma.MemShared, Location: kp.Path(),
	}
	if err := p.RegisterRegions(eng, r); err != nil {
		p.Close()
		return nil, fmt.Errorf("arena: register shared store %s: %w", r.Location, err)
	}
	return p, nil
}

func addrOf(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}
