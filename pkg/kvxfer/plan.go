package kvxfer

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// PageMap is a page map of one side of a transfer: Pages[i] holds the tokens of token-page
// First+i, i.e. tokens [(First+i)·page_size, (First+i+1)·page_size).
type PageMap struct {
	Layout *kvcv1.KVLayout
	Pages  []int64
	First  int64
}

// CompatibleLayouts checks that two pools have the same geometry (page size, bytes per page,
// layers) and the same shape: both MHA (K and V per layer) or both MLA (one buffer per layer).
func CompatibleLayouts(a, b *kvcv1.KVLayout) error {
	for _, l := range []*kvcv1.KVLayout{a, b} {
		n := len(l.GetBufferAddrs())
		if l.GetNumLayers() <= 0 || (n != int(2*l.GetNumLayers()) && n != int(l.GetNumLayers())) || l.GetPageSize() <= 0 || l.GetItemLen()%int64(l.GetPageSize()) != 0 {
			return status.Errorf(codes.InvalidArgument, "malformed KV layout (%d buffers, %d layers, page_size %d, item_len %d)",
				n, l.GetNumLayers(), l.GetPageSize(), l.GetItemLen())
		}
	}
	if a.GetPageSize() != b.GetPageSize() || a.GetItemLen() != b.GetItemLen() || a.GetNumLayers() != b.GetNumLayers() {
		return status.Errorf(codes.FailedPrecondition, "KV layout mismatch: page_size %d/%d, item_len %d/%d, layers %d/%d",
			a.GetPageSize(), b.GetPageSize(), a.GetItemLen(), b.GetItemLen(), a.GetNumLayers(), b.GetNumLayers())
	}
	if LayoutIsMLA(a) != LayoutIsMLA(b) {
		return status.Errorf(codes.FailedPrecondition, "KV layout mismatch: %s on one side, %s on the other (MLA and MHA pools cannot exchange KV)",
			layoutName(a), layoutName(b))
	}
	return nil
}

// Addr is the address of token tok of buffer buf: an InvalidArgument status when the map does
// not cover tok, OutOfRange when its page is outside the pool.
func (m PageMap) Addr(buf int, tok int64) (uint64, error) {
	ps := int64(m.Layout.GetPageSize())
	i := tok/ps - m.First
	if i < 0 || i >= int64(len(m.Pages)) {
		return 0, status.Errorf(codes.InvalidArgument, "token %d not covered by the page map (pages %d from token-page %d)", tok, len(m.Pages), m.First)
	}
	pg := m.Pages[i]
	if pg < 0 || (m.Layout.GetPageCount() > 0 && pg >= m.Layout.GetPageCount()) {
		return 0, status.Errorf(codes.OutOfRange, "page %d outside the pool of %d pages", pg, m.Layout.GetPageCount())
	}
	tb := m.Layout.GetItemLen() / ps
	return m.Layout.GetBufferAddrs()[buf] + uint64(pg*m.Layout.GetItemLen()+(tok%ps)*tb), nil
}

// PlanTokens returns WRITE requests that copy tokens [from, to) of every buffer from the local
// page map src to the remote page map dst in segment seg, merging runs that are contiguous on
// both sides (one request per run per buffer).
//
// Every buffer of a pool has the same page geometry, so the runs are worked out once, as
// offsets from the first buffer, with every page checked against both maps, and then laid over
// each buffer: a 50,000-token session of 96 buffers costs one pass over its 3,125 pages plus
// one store per request, not 96 passes through the page maps.
func PlanTokens(src, dst PageMap, seg rdma.SegmentID, from, to int64) ([]rdma.Request, error) {
	p, err := PlanRuns(src, dst, from, to)
	if err != nil {
		return nil, err
	}
	return p.Requests(seg), nil
}

// Bytes sums the lengths of reqs.
func Bytes(reqs []rdma.Request) uint64 {
	var n uint64
	for _, r := range reqs {
		n += r.Length
	}
	return n
}
