package prefill

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/kvxfer/kvxfertest"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestReserveSnapshotCredit: a decode peer writes the first tokens of a full push into its store
// credit over tcp before it reserves, then reserves naming the credit: the reservation starts
// with the credit pages, the rest goes into the reserved pages, and the snapshot verifies byte for
// byte. Another peer cannot write into the credit; a stale credit id is FAILED_PRECONDITION.
func TestReserveSnapshotCredit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := newTestSidecar(t, true) // store: 16 pages of 4 tokens; credits capped at 1 page (a tenth)
	storeName := s.eng.SegmentName()
	d1, d2 := newGuardPeer(t, ctx, storeName), newGuardPeer(t, ctx, storeName)
	xfer := func(p *guardPeer, reqs []rdma.Request) batchResult {
		t.Helper()
		return runBatch(t, ctx, p.eng, reqs)
	}
	reserve := func(session string, tokens int64, cr *kvcv1.ReserveSnapshotRequest) (*kvcv1.ReserveSnapshotResponse, error) {
		return s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: session, Generation: 1, Tokens: tokens,
			SourceLayout: d1.pool.Layout(), SourceWorkerId: "d", SourceTransferEndpoint: d1.eng.SegmentName(),
			CreditPages: cr.GetCreditPages(), UseCreditPages: cr.GetUseCreditPages(), CreditId: cr.GetCreditId()})
	}
	commit := func(id uint64) {
		t.Helper()
		if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id}); err != nil {
			t.Fatal(err)
		}
	}
	// A first push asks for credit.
	pages := []int64{7, 3, 10}
	d1.fill("s1", pages, 4)
	r1, err := reserve("s1", 4, &kvcv1.ReserveSnapshotRequest{CreditPages: 8})
	if err != nil {
		t.Fatal(err)
	}
	if len(r1.GetCreditPages()) != 1 || r1.GetCreditId() == 0 {
		t.Fatalf("credit %v id %d, want the cap of 1 page", r1.GetCreditPages(), r1.GetCreditId())
	}
	if res := xfer(d1, d1.plan(t, pages, r1, 0, 4)); res.Failed != 0 {
		t.Fatalf("push of s1: %+v", res.Tasks)
	}
	commit(r1.GetIngestId())

	// The next full push: tokens [0, 4) go into the credit page before any reservation exists.
	d1.fill("s2", pages, 10)
	credit := &kvcv1.ReserveSnapshotResponse{StoreLayout: r1.GetStoreLayout(), Pages: r1.GetCreditPages()}
	if res := xfer(d1, d1.plan(t, pages, credit, 0, 4)); res.Failed != 0 {
		t.Fatalf("write into the credit: %+v", res.Tasks)
	}
	// d2 may not write into d1's credit.
	res := xfer(d2, []rdma.Request{{Op: rdma.OpWrite, Source: d2.pool.Layout().GetBufferAddrs()[0], Target: d2.seg,
		TargetAddr: r1.GetStoreLayout().GetBufferAddrs()[0] + uint64(r1.GetCreditPages()[0]*int64(d2.pool.ItemLen)), Length: 8}})
	if res.Failed != 1 || !strings.Contains(res.Tasks[0].Err.Error(), "belongs to peer") {
		t.Fatalf("another peer's write into a credit: %+v", res.Tasks)
	}
	if _, err := reserve("s2", 10, &kvcv1.ReserveSnapshotRequest{UseCreditPages: 1, CreditId: r1.GetCreditId() + 1}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("stale credit id: %v", err)
	}
	r2, err := reserve("s2", 10, &kvcv1.ReserveSnapshotRequest{UseCreditPages: 1, CreditId: r1.GetCreditId(), CreditPages: 8})
	if err != nil {
		t.Fatal(err)
	}
	if len(r2.GetPages()) != 3 || r2.GetPages()[0] != r1.GetCreditPages()[0] {
		t.Fatalf("reservation %v does not start with the credit %v", r2.GetPages(), r1.GetCreditPages())
	}
	if len(r2.GetCreditPages()) != 1 || r2.GetCreditId() == r1.GetCreditId() || r2.GetCreditPages()[0] == r1.GetCreditPages()[0] {
		t.Fatalf("credit after use: %v id %d", r2.GetCreditPages(), r2.GetCreditId())
	}
	reqs, err := kvxfertest.Requests(kvxfer.PageMap{Layout: d1.pool.Layout(), Pages: pages},
		kvxfer.PageMap{Layout: r2.GetStoreLayout(), Pages: r2.GetPages()}, d1.seg, 4, 10)
	if err != nil {
		t.Fatal(err)
	}
	if res := xfer(d1, reqs); res.Failed != 0 {
		t.Fatalf("push of the rest: %+v", res.Tasks)
	}
	commit(r2.GetIngestId())
	verifySnapshot(t, s, "s2", 10)
	verifySnapshot(t, s, "s1", 4)
}
