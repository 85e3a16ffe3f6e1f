package worker

import (
	"fmt"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Geometry is the shape of the worker's paged KV pool.
type Geometry struct {
	PageSize      int   // tokens per page
	Layers        int   // the pool has 2*Layers buffers: layer 0 K, layer 0 V, layer 1 K, ...
	BytesPerToken int   // real bytes per token per buffer (scaled down from the model's)
	PageCount     int64 // pages per buffer
}

// ItemLen is the bytes per page per buffer.
func (g Geometry) ItemLen() int64 { return int64(g.PageSize) * int64(g.BytesPerToken) }

// Buffers is the number of buffers (2 per layer).
func (g Geometry) Buffers() int { return 2 * g.Layers }

// BufferSize is the bytes of one buffer.
func (g Geometry) BufferSize() int64 { return g.PageCount * g.ItemLen() }

// Validate checks the geometry (and that one pool stays below 64 GiB).
func (g Geometry) Validate() error {
	switch {
	case g.PageSize <= 0 || g.PageSize > 1024:
		return fmt.Errorf("page size %d out of range [1, 1024]", g.PageSize)
	case g.Layers <= 0 || g.Layers > 1024:
		return fmt.Errorf("layers %d out of range [1, 1024]", g.Layers)
	case g.BytesPerToken <= 0 || g.BytesPerToken > 1<<20:
		return fmt.Errorf("bytes per token per buffer %d out of range [1, 1048576]", g.BytesPerToken)
	case g.PageCount <= 0:
		return fmt.Errorf("page count %d must be > 0", g.PageCount)
	case g.BufferSize()*int64(g.Buffers()) > 64<<30:
		return fmt.Errorf("pool of %d bytes is larger than 64 GiB", g.BufferSize()*int64(g.Buffers()))
	}
	return nil
}

// CreatePool creates the worker's pool (kvpool.Create) as a file in dir ("" = /dev/shm), named
// after the worker. The file is removed again by Close.
func CreatePool(dir, workerID string, g Geometry) (*kvpool.Pool, error) {
	if err := g.Validate(); err != nil {
		return nil, err
	}
	if err := kvcv1.ValidateID("worker id", workerID); err != nil {
		return nil, err
	}
	return kvpool.Create(dir, kvpool.Spec{
		PageSize: g.PageSize, ItemLen: uint64(g.ItemLen()), NumLayers: g.Layers, PageCount: g.PageCount,
		Name: "kvc-sim-" + workerID,
	})
}

// poolRefs describes the pool's buffers for RegisterKVPool.
func poolRefs(p *kvpool.Pool, g Geometry) []*kvcv1.KVBuffer {
	out := make([]*kvcv1.KVBuffer, 0, g.Buffers())
	for i := 0; i < g.Buffers(); i++ {
		kind := kvcv1.KVKind_KV_KIND_K
		if i%2 == 1 {
			kind = kvcv1.KVKind_KV_KIND_V
		}
		out = append(out, &kvcv1.KVBuffer{
			Layer:     int32(i / 2),
			Kind:      kind,
			Memory:    &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}},
			SizeBytes: g.BufferSize(),
		})
	}
	return out
}
