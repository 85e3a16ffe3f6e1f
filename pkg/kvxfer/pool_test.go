package kvxfer

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestMapPool(t *testing.T) {
	kp, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 64, NumLayers: 2, PageCount: 32})
	if err != nil {
		t.Fatal(err)
	}
	defer kp.Close()
	good := func() *kvcv1.RegisterKVPoolRequest {
		r := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 64, PageCount: 32, NumLayers: 2}
		for i := 0; i < 4; i++ {
			k := kvcv1.KVKind_KV_KIND_K
			if i%2 == 1 {
				k = kvcv1.KVKind_KV_KIND_V
			}
			r.Buffers = append(r.Buffers, &kvcv1.KVBuffer{Layer: int32(i / 2), Kind: k, SizeBytes: 64 * 32,
				Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: kp.Path(), Offset: kp.Offset(i)}}})
		}
		return r
	}
	tests := []struct {
		name string
		mod  func(r *kvcv1.RegisterKVPoolRequest)
		want codes.Code
	}{
		{"ok", func(*kvcv1.RegisterKVPoolRequest) {}, codes.OK},
		{"page size 0", func(r *kvcv1.RegisterKVPoolRequest) { r.PageSize = 0 }, codes.InvalidArgument},
		{"item len not a multiple", func(r *kvcv1.RegisterKVPoolRequest) { r.ItemLen = 66 }, codes.InvalidArgument},
		{"too many pages", func(r *kvcv1.RegisterKVPoolRequest) { r.PageCount = 1 << 40 }, codes.InvalidArgument},
		{"missing buffer", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers = r.Buffers[:3] }, codes.InvalidArgument},
		{"buffers out of order", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[0], r.Buffers[1] = r.Buffers[1], r.Buffers[0] }, codes.InvalidArgument},
		{"size too small", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[2].SizeBytes = 100 }, codes.InvalidArgument},
		{"beyond the file", func(r *kvcv1.RegisterKVPoolRequest) {
			r.Buffers[3].GetShm().Offset = kp.Offset(3) + 4096
		}, codes.InvalidArgument},
		{"no such file", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[1].GetShm().Path = "/nonexistent/pool" }, codes.InvalidArgument},
		{"no memory", func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[1].Memory = nil }, codes.InvalidArgument},
		{"cuda handle", func(r *kvcv1.RegisterKVPoolRequest) {
			r.Buffers[0].Memory = &kvcv1.KVBuffer_Cuda{Cuda: &kvcv1.CudaIpcRef{IpcHandle: make([]byte, 64)}}
		}, codes.Unimplemented},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := good()
			tt.mod(r)
			p, err := MapPool(r)
			if status.Code(err) != tt.want {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
			if err != nil {
				return
			}
			defer p.Close()
			// the mapping shares the worker's memory
			kp.Buffer(3)[5*64+7] = 0xAB
			if p.Buffer(3)[5*64+7] != 0xAB || p.BytesPerToken() != 4*16 || p.CapacityTokens() != 128 {
				t.Fatal("mapped pool does not see the worker's bytes")
			}
			if err := p.CheckPages([]int64{0, 31}); err != nil {
				t.Fatal(err)
			}
			if err := p.CheckPages([]int64{32}); status.Code(err) != codes.OutOfRange {
				t.Fatalf("page 32: %v", err)
			}
		})
	}
}
