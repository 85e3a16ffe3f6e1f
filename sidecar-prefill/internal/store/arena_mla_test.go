package store

import (
	"bytes"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// An MLA pool of GPU memory (CUDA IPC handles) is imported one buffer per layer, and a
// snapshot store shaped like it has one buffer per layer in every kind of memory.
func TestMLAPoolCUDAAndStoreArenas(t *testing.T) {
	req := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 64, PageCount: 32, NumLayers: 3, Layout: kvcv1.PoolLayout_POOL_LAYOUT_MLA, TpRank: 1, TpSize: 2}
	for i := 0; i < 3; i++ {
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: int32(i), Kind: kvcv1.KVKind_KV_KIND_COMBINED, SizeBytes: 64 * 32,
			Memory: &kvcv1.KVBuffer_Cuda{Cuda: &kvcv1.CudaIpcRef{IpcHandle: bytes.Repeat([]byte{byte(i + 1)}, 64), Device: 0}}})
	}
	e := newRegEngine("cuda")
	p, err := kvxfer.OpenWorkerPool(req, e)
	if err != nil {
		t.Fatal(err)
	}
	if !p.MLA || p.Buffers() != 3 || len(p.Layout().GetBufferAddrs()) != 3 || len(e.regs) != 3 || p.TPString() != "1/2" {
		t.Fatalf("MLA GPU pool: mla %v, %d buffers, %d addrs, %d regions, tp %s", p.MLA, p.Buffers(), len(p.Layout().GetBufferAddrs()), len(e.regs), p.TPString())
	}
	if l := p.Layout(); kvxfer.CompatibleLayouts(l, l) != nil || !kvxfer.LayoutIsMLA(l) {
		t.Fatalf("layout of the MLA pool: %+v %v", l, kvxfer.CompatibleLayouts(l, l))
	}
	// MHA kinds under an MLA layout on the cuda path are refused like on the shm path.
	bad := req
	bad.Buffers[1].Kind = kvcv1.KVKind_KV_KIND_V
	if _, err := kvxfer.OpenWorkerPool(bad, newRegEngine("cuda")); err == nil {
		t.Fatal("MLA layout with a V buffer accepted")
	}
	bad.Buffers[1].Kind = kvcv1.KVKind_KV_KIND_COMBINED

	for _, c := range []struct {
		name, backend, memory string
	}{{"host tcp", "tcp", MemoryHost}, {"pinned shared cuda", "cuda", MemoryHost}, {"device", "cuda", MemoryCUDA}} {
		t.Run(c.name, func(t *testing.T) {
			se := newRegEngine(c.backend)
			shape := p.Shape()
			shape.PageCount = 16
			a, err := NewArena(se, c.memory, shape)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			l := a.Layout()
			if !a.MLA || a.Buffers() != 3 || len(l.GetBufferAddrs()) != 3 || a.PageCount != 16 || !kvxfer.LayoutIsMLA(l) {
				t.Fatalf("store arena: mla %v, %d buffers, %d addrs, %d pages", a.MLA, a.Buffers(), len(l.GetBufferAddrs()), a.PageCount)
			}
			if err := kvxfer.CompatibleLayouts(l, p.Layout()); err != nil {
				t.Fatalf("store vs worker pool: %v", err)
			}
		})
	}
	p.Close()
}
