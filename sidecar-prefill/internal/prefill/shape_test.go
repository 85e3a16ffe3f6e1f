package prefill

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestSendKVAuxValidation(t *testing.T) {
	s := newTestSidecar(t, true)
	ctx := context.Background()
	if _, err := s.SendKV(ctx, &kvcv1.SendKVRequest{Room: 5, Pages: []int64{0}, Aux: [][]byte{{1}}}); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "last chunk") {
		t.Fatalf("aux on a middle chunk: %v", err)
	}
	if _, err := s.SendKV(ctx, &kvcv1.SendKVRequest{Room: 5, Last: true, Aux: [][]byte{make([]byte, kvxfer.MaxAuxBytes), {1}}}); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), "at most 65536") {
		t.Fatalf("oversized aux: %v", err)
	}
}

// tpCtx is an incoming peer call from a sidecar whose worker is rank/size.
func tpCtx(rank, size int32) context.Context {
	md, _ := metadata.FromOutgoingContext(kvxfer.WithTP(context.Background(), &kvxfer.Pool{TPRank: rank, TPSize: size}))
	return metadata.NewIncomingContext(context.Background(), md)
}

func TestOfferAndReserveRefuseOtherShapes(t *testing.T) {
	s := newTestSidecar(t, true) // MHA, 1 layer, no tensor parallelism
	offer := func(l *kvcv1.KVLayout) *kvcv1.OfferReceiveRequest {
		return &kvcv1.OfferReceiveRequest{Room: 9, SessionId: "a", Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, DecodeLayout: l,
			Pages: []int64{0, 1}, Tokens: 8, DecodePeerAddr: "127.0.0.1:1", DecodeTransferEndpoint: "127.0.0.1:1"}
	}
	mla := layout()
	mla.BufferAddrs = mla.BufferAddrs[:1] // one buffer for one layer: an MLA pool
	if _, err := s.OfferReceive(context.Background(), offer(mla)); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "MLA") {
		t.Fatalf("MLA offer to an MHA worker: %v", err)
	}
	if _, err := s.OfferReceive(tpCtx(0, 2), offer(layout())); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "unequal TP") {
		t.Fatalf("offer from TP 2: %v", err)
	}
	if _, err := s.ReserveSnapshot(tpCtx(1, 4), &kvcv1.ReserveSnapshotRequest{SessionId: "a", Tokens: 4, SourceLayout: layout()}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("reserve from TP 4: %v", err)
	}
	if _, err := s.ReserveSnapshot(context.Background(), &kvcv1.ReserveSnapshotRequest{SessionId: "a", Tokens: 4, SourceLayout: mla}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("MLA reserve into an MHA store: %v", err)
	}
	if _, err := s.OfferReceive(tpCtx(0, 1), offer(layout())); err != nil {
		t.Fatalf("matching offer: %v", err)
	}
	if st := s.Status(); !st.PoolRegistered || st.Layout != "MHA" || st.TPSize != 1 || !st.Ready {
		t.Fatalf("status %+v", st)
	}
}
