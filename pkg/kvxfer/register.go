package kvxfer

import (
	"context"
	"fmt"
	"strconv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Limits on a registration's tensor parallelism and aux rows, and on a transfer's aux bytes.
const (
	MaxTPSize     = 1024
	MaxAuxBuffers = 64
	// MaxAuxBytes bounds the aux rows of one transfer (SendKVRequest.aux, all rows together).
	MaxAuxBytes = 64 << 10
)

// checkRegistration validates the shape of a RegisterKVPool request — geometry, layout (MHA:
// K and V per layer; MLA: one KV_KIND_COMBINED buffer per layer) against the buffers' count,
// layers and kinds, tensor parallelism and aux row lengths — and returns the pool it describes,
// without memory. Errors are INVALID_ARGUMENT with a message naming what is wrong.
func checkRegistration(req *kvcv1.RegisterKVPoolRequest) (*Pool, error) {
	if err := checkGeometry(req.GetPageSize(), req.GetItemLen(), req.GetPageCount(), req.GetNumLayers()); err != nil {
		return nil, err
	}
	p := &Pool{PageSize: req.GetPageSize(), ItemLen: req.GetItemLen(), PageCount: req.GetPageCount(), NumLayers: req.GetNumLayers()}
	switch req.GetLayout() {
	case kvcv1.PoolLayout_POOL_LAYOUT_UNSPECIFIED, kvcv1.PoolLayout_POOL_LAYOUT_MHA:
	case kvcv1.PoolLayout_POOL_LAYOUT_MLA:
		p.MLA = true
	default:
		return nil, status.Errorf(codes.InvalidArgument, "unknown pool layout %v", req.GetLayout())
	}
	bufs := req.GetBuffers()
	if len(bufs) != p.Buffers() {
		want := "K and V per layer"
		if p.MLA {
			want = "one KV_KIND_COMBINED buffer per layer"
		}
		hint := ""
		switch {
		case !p.MLA && len(bufs) == int(p.NumLayers) && len(bufs) > 0 && bufs[0].GetKind() == kvcv1.KVKind_KV_KIND_COMBINED:
			hint = "; an MLA pool must say layout POOL_LAYOUT_MLA"
		case p.MLA && len(bufs) == int(2*p.NumLayers):
			hint = "; layout POOL_LAYOUT_MLA but the buffers look like an MHA pool (K and V)"
		}
		return nil, status.Errorf(codes.InvalidArgument, "%s pool: %d buffers for %d layers; want %d (%s)%s",
			p.LayoutName(), len(bufs), p.NumLayers, p.Buffers(), want, hint)
	}
	need := p.ItemLen * p.PageCount
	for i, b := range bufs {
		wantLayer, wantKind := i/2, kvcv1.KVKind_KV_KIND_K
		if i%2 == 1 {
			wantKind = kvcv1.KVKind_KV_KIND_V
		}
		if p.MLA {
			wantLayer, wantKind = i, kvcv1.KVKind_KV_KIND_COMBINED
		}
		if int(b.GetLayer()) != wantLayer || b.GetKind() != wantKind {
			return nil, status.Errorf(codes.InvalidArgument, "%s pool: buffer %d is layer %d %s; want layer %d %s",
				p.LayoutName(), i, b.GetLayer(), b.GetKind(), wantLayer, wantKind)
		}
		if b.GetSizeBytes() != 0 && b.GetSizeBytes() < need {
			return nil, status.Errorf(codes.InvalidArgument, "buffer %d is %d bytes; %d pages x %d need %d", i, b.GetSizeBytes(), p.PageCount, p.ItemLen, need)
		}
	}
	rank, size := req.GetTpRank(), req.GetTpSize()
	switch {
	case size < 0 || size > MaxTPSize:
		return nil, status.Errorf(codes.InvalidArgument, "tp_size %d out of range [0, %d]", size, MaxTPSize)
	case rank < 0:
		return nil, status.Errorf(codes.InvalidArgument, "tp_rank %d is negative", rank)
	case size == 0 && rank != 0:
		return nil, status.Errorf(codes.InvalidArgument, "tp_rank %d without tp_size", rank)
	case size > 0 && rank >= size:
		return nil, status.Errorf(codes.InvalidArgument, "tp_rank %d must be below tp_size %d", rank, size)
	}
	p.TPRank, p.TPSize = rank, max(size, 1)
	if n := len(req.GetAuxItemLens()); n > MaxAuxBuffers {
		return nil, status.Errorf(codes.InvalidArgument, "%d aux buffers (at most %d)", n, MaxAuxBuffers)
	}
	for i, l := range req.GetAuxItemLens() {
		if l <= 0 || l > MaxAuxBytes {
			return nil, status.Errorf(codes.InvalidArgument, "aux_item_lens[%d] = %d out of range [1, %d]", i, l, MaxAuxBytes)
		}
	}
	p.AuxItemLens = append([]int64(nil), req.GetAuxItemLens()...)
	return p, nil
}

// CheckAux validates the aux rows of a transfer's last chunk against the registered pool:
// none at all, or at most MaxAuxBytes in all and — when the worker registered aux_item_lens —
// exactly one row per aux buffer, each no longer than its item length. Errors are
// INVALID_ARGUMENT.
func (p *Pool) CheckAux(aux [][]byte) error {
	if len(aux) == 0 {
		return nil
	}
	total := 0
	for _, r := range aux {
		total += len(r)
	}
	if total > MaxAuxBytes {
		return status.Errorf(codes.InvalidArgument, "aux rows of %d bytes in all (at most %d)", total, MaxAuxBytes)
	}
	if len(p.AuxItemLens) == 0 {
		return nil
	}
	if len(aux) != len(p.AuxItemLens) {
		return status.Errorf(codes.InvalidArgument, "%d aux rows; the pool registered %d aux buffers", len(aux), len(p.AuxItemLens))
	}
	for i, r := range aux {
		if int64(len(r)) > p.AuxItemLens[i] {
			return status.Errorf(codes.InvalidArgument, "aux row %d is %d bytes; its buffer's item length is %d", i, len(r), p.AuxItemLens[i])
		}
	}
	return nil
}

// LayoutIsMLA reports whether a wire layout describes an MLA pool (one buffer per layer); an MHA
// layout has two per layer. Any other count is malformed (CompatibleLayouts says so).
func LayoutIsMLA(l *kvcv1.KVLayout) bool {
	return l.GetNumLayers() > 0 && len(l.GetBufferAddrs()) == int(l.GetNumLayers())
}

func layoutName(l *kvcv1.KVLayout) string {
	if LayoutIsMLA(l) {
		return "MLA (one buffer per layer)"
	}
	return "MHA (K and V per layer)"
}

// The tensor-parallel shape of a sidecar's worker travels between sidecars as gRPC metadata
// on OfferReceive and ReserveSnapshot ("<rank>/<size>"), so that a transfer between ranks of
// different tensor-parallel sizes is refused before a byte moves.
const tpMetadataKey = "kvc-tp"

// WithTP adds this side's tensor-parallel rank and size to an outgoing peer call.
func WithTP(ctx context.Context, p *Pool) context.Context {
	if p == nil {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, tpMetadataKey, fmt.Sprintf("%d/%d", p.TPRank, max(p.TPSize, 1)))
}

// CheckPeerTP refuses (FAILED_PRECONDITION) an incoming peer call from a sidecar whose worker's
// tensor-parallel size differs from this pool's (unequal TP on P and D is unsupported) or
// whose rank differs (transfers pair rank r with rank r). A caller that sends no TP shape is
// an older sidecar: it is taken as rank 0 of 1.
func CheckPeerTP(ctx context.Context, p *Pool) error {
	rank, size := int32(0), int32(1)
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get(tpMetadataKey); len(v) > 0 {
			var r, s int
			if _, err := fmt.Sscanf(v[0], "%d/%d", &r, &s); err != nil || s < 1 || r < 0 || r >= s {
				return status.Errorf(codes.InvalidArgument, "bad %s metadata %q", tpMetadataKey, v[0])
			}
			rank, size = int32(r), int32(s)
		}
	}
	mySize := max(p.TPSize, 1)
	if size != mySize {
		return status.Errorf(codes.FailedPrecondition, "tensor parallelism differs: the peer's worker is rank %d of tp_size %d, this one rank %d of tp_size %d (unequal TP on prefill and decode is unsupported)",
			rank, size, p.TPRank, mySize)
	}
	if rank != p.TPRank {
		return status.Errorf(codes.FailedPrecondition, "tensor-parallel ranks differ: the peer's worker is rank %d, this one rank %d of %d (transfers pair rank r with rank r)",
			rank, p.TPRank, mySize)
	}
	return nil
}

// MaxTPGroupLen bounds a tensor-parallel group name (--tp-group, or the worker URL standing in
// for it); the control plane refuses a longer one in a hello.
const MaxTPGroupLen = 1024

// HelloTP fills a hello's tensor parallelism from the registered pool: its rank and size, and
// the group — group (--tp-group), else, for a worker of more than one rank, the hello's worker
// URL (every rank of one SGLang server shares it). Without a pool it leaves the hello as it is.
func HelloTP(h *kvcv1.Hello, p *Pool, group string) {
	if p == nil {
		return
	}
	h.TpRank, h.TpSize = p.TPRank, max(p.TPSize, 1)
	h.TpGroup = group
	if group == "" && h.TpSize > 1 {
		h.TpGroup = h.GetWorkerUrl()
	}
}

// CheckTPUnchanged refuses (FAILED_PRECONDITION) a re-registration that changes the pool's
// tensor-parallel rank or size: the control plane knows this sidecar as that rank of its group
// (the hello), so a worker restarted with another shape needs its sidecar restarted too.
func CheckTPUnchanged(old, p *Pool) error {
	if old == nil || (old.TPRank == p.TPRank && max(old.TPSize, 1) == max(p.TPSize, 1)) {
		return nil
	}
	return status.Errorf(codes.FailedPrecondition, "tensor parallelism changed from rank %s to %s: this sidecar registered as the former with the control plane; restart the sidecar with the worker",
		old.TPString(), p.TPString())
}

// TPString is "rank/size" of a pool (for logs and status).
func (p *Pool) TPString() string {
	return strconv.Itoa(int(p.TPRank)) + "/" + strconv.Itoa(int(max(p.TPSize, 1)))
}
