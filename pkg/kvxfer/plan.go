package kvxfer

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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
