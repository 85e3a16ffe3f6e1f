package agent

import (
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// cudaPoolBase is where the addresses of an imported GPU pool start. Such a pool has no address
// in this process that page math could use (the worker's own addresses are not sent), so each
// buffer gets a name in a range no process address reaches (user space ends below 1<<47);
// the cuda engine resolves names to the imported memory, and peers target the names.
const cudaPoolBase = 1 << 60

// OpenWorkerPool makes the worker's pool of a RegisterKVPool request usable by eng and
// registers it:
//   - shared-memory buffers: mapped (MapPool) and registered as shared memory, any backend;
//   - CUDA IPC buffers (an SGLang worker's GPU pool): the cuda backend only; each buffer is
//     registered as device memory imported from its handle (rdma.MemCUDA with CUDAMemory), and
//     the pool has addresses (Layout) but no CPU view.
//
// Errors are gRPC statuses: InvalidArgument for a bad request, Unimplemented for GPU memory
// on a backend that cannot import it, Internal when registration fails.
func OpenWorkerPool(req *kvcv1.RegisterKVPoolRequest, eng rdma.Engine) (*Pool, error) {
	cudaBufs := 0
	for _, b := range req.GetBuffers() {
		if _, ok := b.GetMemory().(*kvcv1.KVBuffer_Cuda); ok {
			cudaBufs++
		}
	}
	if cudaBufs == 0 || eng.Backend() != "cuda" {
		p, err := MapPool(req) // refuses CUDA buffers with Unimplemented
		if err != nil {
			return nil, err
		}
		if err := p.Register(eng, "shm"); err != nil {
			p.Close()
			return nil, status.Errorf(codes.Internal, "register pool: %v", err)
		}
		return p, nil
	}
	if cudaBufs != len(req.GetBuffers()) {
		return nil, status.Errorf(codes.InvalidArgument, "%d of %d buffers are CUDA IPC handles; a pool is all GPU or all shared memory", cudaBufs, len(req.GetBuffers()))
	}
	p, err := checkRegistration(req)
	if err != nil {
		return nil, err
	}
	need := p.ItemLen * p.PageCount
	stride := (uint64(need) + 0xffff) &^ 0xffff // checkGeometry: need <= 1<<46, so 2048 buffers fit below 1<<58
	for i, b := range req.GetBuffers() {
		c := b.GetCuda()
		switch {
		case len(c.GetIpcHandle()) != 64:
			return nil, status.Errorf(codes.InvalidArgument, "buffer %d: CUDA IPC handle of %d bytes, want 64", i, len(c.GetIpcHandle()))
		case c.GetDevice() < 0:
			return nil, status.Errorf(codes.InvalidArgument, "buffer %d: device %d", i, c.GetDevice())
		case c.GetOffset() < 0:
			return nil, status.Errorf(codes.InvalidArgument, "buffer %d: negative offset %d", i, c.GetOffset())
		}
	}
	for i, b := range req.GetBuffers() {
		c := b.GetCuda()
		r := rdma.Region{
			Addr: cudaPoolBase + uint64(i)*stride, Len: uint64(need), Kind: rdma.MemCUDA,
			Location: fmt.Sprintf("cuda:%d", c.GetDevice()),
			CUDA:     &rdma.CUDAMemory{Device: int(c.GetDevice()), IPCHandle: append([]byte(nil), c.GetIpcHandle()...), Offset: uint64(c.GetOffset())},
		}
		if err := eng.RegisterMemory(r); err != nil {
			p.eng = eng
			p.unregister()
			return nil, status.Errorf(codes.Internal, "register pool: buffer %d: %v", i, err)
		}
		p.regions = append(p.regions, r)
		p.addrs = append(p.addrs, r.Addr)
	}
	p.eng = eng
	return p, nil
}

// pinnedAllocator is the part of the cuda engine (rdma.CUDAEngine) NewReader needs.
type pinnedAllocator interface {
	AllocPinned(n uint64) (uint64, []byte, error)
	FreeMemory(p uint64) error
}

// NewStoreArena allocates a prefill snapshot store of the given geometry and registers it with
// eng: anonymous host memory (NewArena) for the tcp and mooncake backends; with the cuda
// backend a shared-memory file (a memfd, reachable by path as /proc/<pid>/fd/<n> to processes
// of the same user while this one lives) mapped here and registered as one rdma.MemShared
// region with its path as Location. The cuda engine page-locks and device-maps it, and so does
// a peer's engine that opens this segment (it maps the file by that path), so a decode
// sidecar's copy kernel pushes into it one-sided, as into its own pinned memory. The store
// keeps a CPU view (the HTTP snapshot endpoint reads it). Close unregisters, unmaps and
// releases it.
func NewStoreArena(eng rdma.Engine, pageSize int32, itemLen, pageCount int64, layers int32) (*Pool, error) {
	return newStoreArena(eng, pageSize, itemLen, pageCount, layers, false)
}

// NewStoreArenaLike allocates a snapshot store of pageCount pages with the shape of a worker's
// pool (page size, item length, layers, MHA or MLA) in memory (StoreMemoryHost, the default,
// as NewStoreArena; StoreMemoryCUDA as NewDeviceStoreArena).
func NewStoreArenaLike(eng rdma.Engine, memory string, like *Pool, pageCount int64) (*Pool, error) {
	if memory == StoreMemoryCUDA {
		return newDeviceStoreArena(eng, like.PageSize, like.ItemLen, pageCount, like.NumLayers, like.MLA)
	}
	return newStoreArena(eng, like.PageSize, like.ItemLen, pageCount, like.NumLayers, like.MLA)
}

func newStoreArena(eng rdma.Engine, pageSize int32, itemLen, pageCount int64, layers int32, mla bool) (*Pool, error) {
	if eng.Backend() != "cuda" {
		arena, err := newArena(pageSize, itemLen, pageCount, layers, mla)
		if err != nil {
			return nil, err
		}
		if err := arena.Register(eng, "host"); err != nil {
			arena.Close()
			return nil, err
		}
		return arena, nil
	}
	if err := checkGeometry(pageSize, itemLen, pageCount, layers); err != nil {
		return nil, err
	}
	return newSharedStore(eng, kvpool.MemfdDir, pageSize, itemLen, pageCount, layers, mla)
}

// newSharedStore creates the store as one kvpool file under dir (kvpool.MemfdDir for a memfd)
// and registers the whole file as a MemShared region named by its path.
func newSharedStore(eng rdma.Engine, dir string, pageSize int32, itemLen, pageCount int64, layers int32, mla bool) (*Pool, error) {
	kp, err := kvpool.Create(dir, kvpool.Spec{PageSize: int(pageSize), ItemLen: uint64(itemLen), NumLayers: int(layers), PageCount: pageCount, Name: "kvc-store", MLA: mla})
	if err != nil {
		return nil, fmt.Errorf("arena: shared store: %w", err)
	}
	p := &Pool{PageSize: pageSize, ItemLen: itemLen, PageCount: pageCount, NumLayers: layers, MLA: mla}
	for i := 0; i < kp.NumBuffers(); i++ {
		p.bufs = append(p.bufs, kp.Buffer(i))
	}
	p.frees = append(p.frees, func() { _ = kp.Close() })
	r := rdma.Region{
		Addr: addrOf(kp.Buffer(0)), Len: kp.Spec().BufferStride() * uint64(kp.NumBuffers()),
		Kind: rdma.MemShared, Location: kp.Path(),
	}
	p.eng = eng
	if err := eng.RegisterMemory(r); err != nil {
		p.unmap()
		return nil, fmt.Errorf("arena: register shared store %s: %w", r.Location, err)
	}
	p.regions = append(p.regions, r)
	return p, nil
}
