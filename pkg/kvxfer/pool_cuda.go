package kvxfer

import (
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
