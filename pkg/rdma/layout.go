package rdma

import (
	"errors"
	"fmt"
	"math"
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

// LayoutFromProto converts the wire form; the result is validated.
func LayoutFromProto(p *kvcv1.KVLayout) (Layout, error) {
	if p == nil {
		return Layout{}, fmt.Errorf("%w: nil layout", ErrInvalidRequest)
	}
	if p.GetItemLen() < 0 {
		return Layout{}, fmt.Errorf("%w: negative item_len %d", ErrInvalidRequest, p.GetItemLen())
	}
	l := Layout{
		PageSize:    int(p.GetPageSize()),
		ItemLen:     uint64(p.GetItemLen()),
		NumLayers:   int(p.GetNumLayers()),
		BufferAddrs: append([]uint64(nil), p.GetBufferAddrs()...),
		PageCount:   p.GetPageCount(),
		MLA:         p.GetNumLayers() > 0 && len(p.GetBufferAddrs()) == int(p.GetNumLayers()),
	}
	return l, l.Validate()
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

// PlanStats counts requests before and after merging runs.
type PlanStats struct {
	// Unmerged is what one request per page (or partial page) per buffer would have been.
	Unmerged int
	// Merged is the number of requests produced.
	Merged int
	// Runs is the number of contiguous runs per buffer.
	Runs int
	// Bytes is the total length of the requests.
	Bytes uint64
}

// String is a one-line summary.
func (s PlanStats) String() string {
	return fmt.Sprintf("%d requests merged from %d (%d runs per buffer, %d bytes)", s.Merged, s.Unmerged, s.Runs, s.Bytes)
}

// ErrBadPages is wrapped by planning errors about page lists.
var ErrBadPages = errors.New("rdma: bad page list")

// piece is one contiguous byte range, as offsets from the start of a buffer on each side.
type piece struct{ src, dst, n uint64 }

// PlanPages turns a page map into the fewest requests: srcPages[i] of the data source moves to
// dstPages[i] of the data destination; runs contiguous on both sides are merged, and each run
// becomes one request per buffer (layer × K/V).
//
// src and dst always name where the data comes from and where it goes. For OpWrite the source is
// local (Request.Source in src) and the destination is the peer target; for OpRead the
// destination is local (Request.Source in dst) and the source is the peer target. Page indices
// must be in range and must not repeat on either side.
func PlanPages(op Opcode, src, dst Layout, srcPages, dstPages []int64, target SegmentID) ([]Request, error) {
	reqs, _, err := PlanPagesStats(op, src, dst, srcPages, dstPages, target)
	return reqs, err
}

// PlanPagesStats is PlanPages that also returns the request counts before and after merging.
func PlanPagesStats(op Opcode, src, dst Layout, srcPages, dstPages []int64, target SegmentID) ([]Request, PlanStats, error) {
	if err := checkPlan(op, src, dst); err != nil {
		return nil, PlanStats{}, err
	}
	if len(srcPages) != len(dstPages) {
		return nil, PlanStats{}, fmt.Errorf("%w: %d source pages, %d destination pages", ErrBadPages, len(srcPages), len(dstPages))
	}
	if err := checkPages("source", srcPages, src.PageCount, len(srcPages)); err != nil {
		return nil, PlanStats{}, err
	}
	if err := checkPages("destination", dstPages, dst.PageCount, len(dstPages)); err != nil {
		return nil, PlanStats{}, err
	}
	ps := make([]piece, 0, len(srcPages))
	for i := range srcPages {
		ps = append(ps, piece{uint64(srcPages[i]) * src.ItemLen, uint64(dstPages[i]) * dst.ItemLen, src.ItemLen})
	}
	return buildRequests(op, src, dst, ps, target)
}

// PlanTokens plans the token range [from, to) of a session: srcPages and dstPages are each
// side's pages in token order (page i holds tokens [i×PageSize, (i+1)×PageSize)) covering at
// least to tokens. Offsets are token-granular within pages (TokenBytes per token per buffer), so
// an incremental snapshot push moves exactly the new tokens. src/dst and op are as in PlanPages.
func PlanTokens(op Opcode, src, dst Layout, srcPages, dstPages []int64, from, to int64, target SegmentID) ([]Request, error) {
	reqs, _, err := PlanTokensStats(op, src, dst, srcPages, dstPages, from, to, target)
	return reqs, err
}

// PlanTokensStats is PlanTokens that also returns the request counts before and after merging.
func PlanTokensStats(op Opcode, src, dst Layout, srcPages, dstPages []int64, from, to int64, target SegmentID) ([]Request, PlanStats, error) {
	if err := checkPlan(op, src, dst); err != nil {
		return nil, PlanStats{}, err
	}
	if from < 0 || to <= from {
		return nil, PlanStats{}, fmt.Errorf("%w: token range [%d, %d)", ErrBadPages, from, to)
	}
	ps64 := int64(src.PageSize)
	first, last := from/ps64, (to-1)/ps64 // page indices (in token order) touched
	if int64(len(srcPages)) <= last || int64(len(dstPages)) <= last {
		return nil, PlanStats{}, fmt.Errorf("%w: %d source and %d destination pages do not cover %d tokens", ErrBadPages, len(srcPages), len(dstPages), to)
	}
	if err := checkPages("source", srcPages[first:last+1], src.PageCount, int(last-first+1)); err != nil {
		return nil, PlanStats{}, err
	}
	if err := checkPages("destination", dstPages[first:last+1], dst.PageCount, int(last-first+1)); err != nil {
		return nil, PlanStats{}, err
	}
	tb := src.TokenBytes()
	ps := make([]piece, 0, last-first+1)
	for i := first; i <= last; i++ {
		t0, t1 := max(from, i*ps64), min(to, (i+1)*ps64)
		in := uint64(t0-i*ps64) * tb
		ps = append(ps, piece{uint64(srcPages[i])*src.ItemLen + in, uint64(dstPages[i])*dst.ItemLen + in, uint64(t1-t0) * tb})
	}
	return buildRequests(op, src, dst, ps, target)
}

func checkPlan(op Opcode, src, dst Layout) error {
	if op != OpRead && op != OpWrite {
		return fmt.Errorf("%w: opcode %v", ErrInvalidRequest, op)
	}
	if err := src.Validate(); err != nil {
		return fmt.Errorf("source layout: %w", err)
	}
	if err := dst.Validate(); err != nil {
		return fmt.Errorf("destination layout: %w", err)
	}
	return src.Compatible(dst)
}

// checkPages rejects out-of-range and repeated pages.
func checkPages(side string, pages []int64, count int64, n int) error {
	seen := make(map[int64]struct{}, n)
	for i, p := range pages {
		if p < 0 || p >= count {
			return fmt.Errorf("%w: %s page %d (position %d) outside [0, %d)", ErrBadPages, side, p, i, count)
		}
		if _, dup := seen[p]; dup {
			return fmt.Errorf("%w: %s page %d repeats (position %d)", ErrBadPages, side, p, i)
		}
		seen[p] = struct{}{}
	}
	return nil
}

// buildRequests merges pieces contiguous on both sides and emits one request per run per buffer.
func buildRequests(op Opcode, src, dst Layout, ps []piece, target SegmentID) ([]Request, PlanStats, error) {
	runs := ps[:0:0]
	for _, p := range ps {
		if n := len(runs); n > 0 {
			last := &runs[n-1]
			if last.src+last.n == p.src && last.dst+last.n == p.dst {
				last.n += p.n
				continue
			}
		}
		runs = append(runs, p)
	}
	nb := src.NumBuffers()
	if len(runs) > math.MaxInt/nb {
		return nil, PlanStats{}, fmt.Errorf("%w: too many runs", ErrBadPages)
	}
	reqs := make([]Request, 0, len(runs)*nb)
	var total uint64
	for b := 0; b < nb; b++ {
		for _, r := range runs {
			s, d := src.BufferAddrs[b]+r.src, dst.BufferAddrs[b]+r.dst
			req := Request{Op: op, Target: target, Length: r.n}
			if op == OpWrite {
				req.Source, req.TargetAddr = s, d
			} else {
				req.Source, req.TargetAddr = d, s
			}
			reqs = append(reqs, req)
			total += r.n
		}
	}
	return reqs, PlanStats{Unmerged: len(ps) * nb, Merged: len(reqs), Runs: len(runs), Bytes: total}, nil
}
