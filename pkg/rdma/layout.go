package rdma

import (
	"fmt"
	"math/bits"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Layout describes a worker's KV pool as SGLang registers it: 2×NumLayers buffers (order layer 0
// K, layer 0 V, layer 1 K, ...), each PageCount pages of ItemLen bytes; page p of buffer b starts
// at BufferAddrs[b] + p×ItemLen. A page holds PageSize tokens, so one token of one buffer is
// ItemLen/PageSize bytes. It mirrors kvcv1.KVLayout.
type Layout struct {
	PageSize    int
	ItemLen     uint64
	NumLayers   int
	BufferAddrs []uint64
	PageCount   int64
	// MLA: one buffer per layer (SGLang's MLATokenToKVPool, KV_KIND_COMBINED) instead of a K
	// and a V buffer. On the wire (kvcv1.KVLayout) it is implied by the buffer count.
	MLA bool
}

// ToProto converts to the wire form.
func (l Layout) ToProto() *kvcv1.KVLayout {
	return &kvcv1.KVLayout{
		PageSize:    int32(l.PageSize),
		ItemLen:     int64(l.ItemLen),
		NumLayers:   int32(l.NumLayers),
		BufferAddrs: append([]uint64(nil), l.BufferAddrs...),
		PageCount:   l.PageCount,
	}
}

// NumBuffers is 2×NumLayers (K and V per layer), or NumLayers for an MLA pool.
func (l Layout) NumBuffers() int {
	if l.MLA {
		return l.NumLayers
	}
	return 2 * l.NumLayers
}

// TokenBytes is the bytes of one token in one buffer (ItemLen / PageSize).
func (l Layout) TokenBytes() uint64 {
	if l.PageSize <= 0 {
		return 0
	}
	return l.ItemLen / uint64(l.PageSize)
}

// BytesPerToken is the bytes of one token over every buffer of the pool.
func (l Layout) BytesPerToken() uint64 { return l.TokenBytes() * uint64(l.NumBuffers()) }

// BufferLen is the length of each buffer (PageCount × ItemLen).
func (l Layout) BufferLen() uint64 { return uint64(l.PageCount) * l.ItemLen }

// Validate checks that the layout is self-consistent and that no buffer wraps the address space.
func (l Layout) Validate() error {
	switch {
	case l.PageSize <= 0:
		return fmt.Errorf("%w: page size %d", ErrInvalidRequest, l.PageSize)
	case l.ItemLen == 0:
		return fmt.Errorf("%w: item length 0", ErrInvalidRequest)
	case l.ItemLen%uint64(l.PageSize) != 0:
		return fmt.Errorf("%w: item length %d is not a multiple of page size %d", ErrInvalidRequest, l.ItemLen, l.PageSize)
	case l.NumLayers <= 0:
		return fmt.Errorf("%w: %d layers", ErrInvalidRequest, l.NumLayers)
	case len(l.BufferAddrs) != l.NumBuffers():
		want := "K and V per layer"
		if l.MLA {
			want = "one buffer per layer (MLA)"
		}
		return fmt.Errorf("%w: %d buffer addresses for %d layers (want %s)", ErrInvalidRequest, len(l.BufferAddrs), l.NumLayers, want)
	case l.PageCount <= 0:
		return fmt.Errorf("%w: page count %d", ErrInvalidRequest, l.PageCount)
	}
	hi, size := bits.Mul64(uint64(l.PageCount), l.ItemLen)
	if hi != 0 {
		return fmt.Errorf("%w: %d pages of %d bytes overflow", ErrInvalidRequest, l.PageCount, l.ItemLen)
	}
	for i, a := range l.BufferAddrs {
		if a == 0 {
			return fmt.Errorf("%w: buffer %d has address 0", ErrInvalidRequest, i)
		}
		if a+size < a {
			return fmt.Errorf("%w: buffer %d wraps the address space", ErrInvalidRequest, i)
		}
	}
	return nil
}

// Compatible reports whether KV can move between l and o: same page size, item length and layer
// count. The error wraps ErrLayoutMismatch.
func (l Layout) Compatible(o Layout) error {
	if l.PageSize != o.PageSize || l.ItemLen != o.ItemLen || l.NumLayers != o.NumLayers {
		return fmt.Errorf("%w: page size %d/%d, item length %d/%d, layers %d/%d", ErrLayoutMismatch,
			l.PageSize, o.PageSize, l.ItemLen, o.ItemLen, l.NumLayers, o.NumLayers)
	}
	if l.MLA != o.MLA {
		return fmt.Errorf("%w: MLA (one buffer per layer) on one side, MHA (K and V per layer) on the other", ErrLayoutMismatch)
	}
	return nil
}

// Regions returns one region per buffer, for RegisterMemory.
func (l Layout) Regions(kind MemKind, location string) []Region {
	out := make([]Region, len(l.BufferAddrs))
	for i, a := range l.BufferAddrs {
		out[i] = Region{Addr: a, Len: l.BufferLen(), Kind: kind, Location: location}
	}
	return out
}
