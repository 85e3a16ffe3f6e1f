package kvxfer

import (
	"bytes"
	"errors"
	"testing"
	"unsafe"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
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

func cudaPoolRequest() *kvcv1.RegisterKVPoolRequest {
	r := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 64, PageCount: 32, NumLayers: 2}
	for i := 0; i < 4; i++ {
		k := kvcv1.KVKind_KV_KIND_K
		if i%2 == 1 {
			k = kvcv1.KVKind_KV_KIND_V
		}
		h := bytes.Repeat([]byte{byte(i + 1)}, 64)
		r.Buffers = append(r.Buffers, &kvcv1.KVBuffer{Layer: int32(i / 2), Kind: k, SizeBytes: 64 * 32,
			Memory: &kvcv1.KVBuffer_Cuda{Cuda: &kvcv1.CudaIpcRef{IpcHandle: h, Device: 1, Offset: int64(i) * 4096}}})
	}
	return r
}

func TestOpenWorkerPoolCUDA(t *testing.T) {
	tests := []struct {
		name    string
		backend string
		mod     func(r *kvcv1.RegisterKVPoolRequest)
		failAt  int
		want    codes.Code
	}{
		{"ok", "cuda", func(*kvcv1.RegisterKVPoolRequest) {}, 0, codes.OK},
		{"tcp cannot import GPU memory", "tcp", func(*kvcv1.RegisterKVPoolRequest) {}, 0, codes.Unimplemented},
		{"mixed kinds", "cuda", func(r *kvcv1.RegisterKVPoolRequest) {
			r.Buffers[2].Memory = &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: "/dev/shm/x"}}
		}, 0, codes.InvalidArgument},
		{"short handle", "cuda", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[1].GetCuda().IpcHandle = make([]byte, 63) }, 0, codes.InvalidArgument},
		{"negative device", "cuda", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[3].GetCuda().Device = -1 }, 0, codes.InvalidArgument},
		{"negative offset", "cuda", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[0].GetCuda().Offset = -4096 }, 0, codes.InvalidArgument},
		{"buffers out of order", "cuda", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[0], r.Buffers[1] = r.Buffers[1], r.Buffers[0] }, 0, codes.InvalidArgument},
		{"missing buffer", "cuda", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers = r.Buffers[:3] }, 0, codes.InvalidArgument},
		{"size too small", "cuda", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[2].SizeBytes = 100 }, 0, codes.InvalidArgument},
		{"bad geometry", "cuda", func(r *kvcv1.RegisterKVPoolRequest) { r.ItemLen = 66 }, 0, codes.InvalidArgument},
		{"registration fails midway", "cuda", func(*kvcv1.RegisterKVPoolRequest) {}, 3, codes.Internal},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newRegEngine(tt.backend)
			e.failAt = tt.failAt
			req := cudaPoolRequest()
			tt.mod(req)
			p, err := OpenWorkerPool(req, e)
			if status.Code(err) != tt.want {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
			if err != nil {
				if len(e.regs) != 0 {
					t.Fatalf("a refused pool left %d regions registered", len(e.regs))
				}
				return
			}
			l := p.Layout()
			if len(l.BufferAddrs) != 4 || l.PageCount != 32 || l.ItemLen != 64 {
				t.Fatalf("layout %+v", l)
			}
			if err := CompatibleLayouts(l, l); err != nil {
				t.Fatalf("layout of the imported pool: %v", err)
			}
			for i, a := range l.BufferAddrs {
				r, ok := e.regs[a]
				if !ok {
					t.Fatalf("buffer %d at %#x not registered", i, a)
				}
				c := req.Buffers[i].GetCuda()
				if r.Kind != rdma.MemCUDA || r.Len != 64*32 || r.CUDA == nil || r.CUDA.Device != 1 ||
					r.CUDA.Offset != uint64(c.Offset) || !bytes.Equal(r.CUDA.IPCHandle, c.IpcHandle) {
					t.Fatalf("buffer %d registered as %+v", i, r)
				}
				if i > 0 && a < l.BufferAddrs[i-1]+r.Len {
					t.Fatalf("buffers %d and %d overlap", i-1, i)
				}
			}
			p.Close()
			if len(e.regs) != 0 {
				t.Fatalf("Close left %d regions registered", len(e.regs))
			}
		})
	}
}
