package router

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLateOutcomeKeepsContent: a direct turn whose outcome comes after its reservation expired
// (it waited in the decode worker's prealloc queue longer than the reservation timeout) still
// teaches the leader the session's content, so the next turn goes direct on what is resident
// instead of a whole-context reseed with reason PREFIX_MISMATCH; the outcome is applied once.
func TestLateOutcomeKeepsContent(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	prompt := idsN(1_000, 1)
	d := f.contentDecide("c1", prompt, 50)
	gen := idsN(50, 70_000)
	f.contentReport(d, prompt, gen, 0)
	conv := append(append([]uint32(nil), prompt...), gen...)

	next := append(append([]uint32(nil), conv...), idsN(200, 80_000)...)
	d = f.contentDecide("c1", next, 40)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
		t.Fatalf("second turn: %s/%s", d.Mode, d.Reason)
	}
	timeout := time.Duration(policy.DefaultReservationTimeoutMs) * time.Millisecond
	if n := f.s.expire(f.now.Add(timeout + time.Second)); n != 1 {
		t.Fatalf("expired %d, want the direct turn's reservation", n)
	}
	f.checkLedger()
	gen2 := idsN(40, 90_000)
	f.contentReport(d, next, gen2, 0) // late: acknowledged and applied
	conv = append(next, gen2...)
	if v := testutil.ToFloat64(f.s.m.lateOutcomes); v != 1 {
		t.Fatalf("late outcomes %v, want 1", v)
	}
	if rec := f.session("c1"); rec.KvCommittedLen != int64(len(conv)) {
		t.Fatalf("committed %d after the late outcome, want %d", rec.KvCommittedLen, len(conv))
	}
	if e := f.s.Handle(outcome(d.DecisionId, true, okKind, int64(len(conv)))).GetError(); e == nil || e.Code != int32(codes.FailedPrecondition) {
		t.Fatalf("the same late outcome again: %v, want FAILED_PRECONDITION", e)
	}

	third := append(append([]uint32(nil), conv...), idsN(100, 95_000)...)
	d = f.contentDecide("c1", third, 40)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT || d.CachedTokens != int64(len(conv)) {
		t.Fatalf("turn after a late outcome: %s/%s cached %d; want DIRECT_TO_D/SESSION_RESIDENT cached %d", d.Mode, d.Reason, d.CachedTokens, len(conv))
	}
	f.checkLedger()
}

// TestLateBookBounded: past maxLate expired reservations the oldest are forgotten (their late
// outcomes answer FAILED_PRECONDITION as before).
func TestLateBookBounded(t *testing.T) {
	var b lateBook
	for i := uint64(1); i <= maxLate+10; i++ {
		b.add(&reservation{seq: i})
	}
	if _, ok := b.take(10); ok {
		t.Fatal("the oldest expired reservations are kept past the bound")
	}
	if r, ok := b.take(maxLate + 10); !ok || r.seq != maxLate+10 {
		t.Fatal("the newest expired reservation is gone")
	}
	if _, ok := b.take(maxLate + 10); ok {
		t.Fatal("an expired reservation applied twice")
	}
	if len(b.m) != maxLate-1 {
		t.Fatalf("%d kept, want %d", len(b.m), maxLate-1)
	}
}
