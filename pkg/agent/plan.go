package agent

import (
	"fmt"

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
// layers, buffers).
func CompatibleLayouts(a, b *kvcv1.KVLayout) error {
	if a.GetPageSize() != b.GetPageSize() || a.GetItemLen() != b.GetItemLen() || a.GetNumLayers() != b.GetNumLayers() {
		return status.Errorf(codes.FailedPrecondition, "KV layout mismatch: page_size %d/%d, item_len %d/%d, layers %d/%d",
			a.GetPageSize(), b.GetPageSize(), a.GetItemLen(), b.GetItemLen(), a.GetNumLayers(), b.GetNumLayers())
	}
	for _, l := range []*kvcv1.KVLayout{a, b} {
		if len(l.GetBufferAddrs()) != int(2*l.GetNumLayers()) || l.GetPageSize() <= 0 || l.GetItemLen()%int64(l.GetPageSize()) != 0 {
			return status.Errorf(codes.InvalidArgument, "malformed KV layout (%d buffers, %d layers, page_size %d, item_len %d)",
				len(l.GetBufferAddrs()), l.GetNumLayers(), l.GetPageSize(), l.GetItemLen())
		}
	}
	return nil
}

func (m PageMap) addr(buf int, tok int64) (uint64, error) {
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
func PlanTokens(src, dst PageMap, seg rdma.SegmentID, from, to int64) ([]rdma.Request, error) {
	if err := CompatibleLayouts(src.Layout, dst.Layout); err != nil {
		return nil, err
	}
	if from < 0 || to < from {
		return nil, status.Errorf(codes.InvalidArgument, "bad token range [%d, %d)", from, to)
	}
	if from == to {
		return nil, nil
	}
	ps := int64(src.Layout.GetPageSize())
	tb := uint64(src.Layout.GetItemLen() / ps)
	nbuf := len(src.Layout.GetBufferAddrs())
	var reqs []rdma.Request
	for b := 0; b < nbuf; b++ {
		var cur *rdma.Request
		for t := from; t < to; {
			end := min((t/ps+1)*ps, to)
			s, err := src.addr(b, t)
			if err != nil {
				return nil, fmt.Errorf("source: %w", err)
			}
			d, err := dst.addr(b, t)
			if err != nil {
				return nil, fmt.Errorf("target: %w", err)
			}
			n := uint64(end-t) * tb
			if cur != nil && cur.Source+cur.Length == s && cur.TargetAddr+cur.Length == d {
				cur.Length += n
			} else {
				reqs = append(reqs, rdma.Request{Op: rdma.OpWrite, Source: s, Target: seg, TargetAddr: d, Length: n})
				cur = &reqs[len(reqs)-1]
			}
			t = end
		}
	}
	return reqs, nil
}

// Bytes sums the lengths of reqs.
func Bytes(reqs []rdma.Request) uint64 {
	var n uint64
	for _, r := range reqs {
		n += r.Length
	}
	return n
}
