package router

import (
	"testing"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestDecodeBatch: the ledger lists a decode worker's batch for a local large append
// (policy.DecodeBatcher) — the decisions in flight there that decode, and the smallest
// max_output among them — and forgets a decision at its outcome.
func TestDecodeBatch(t *testing.T) {
	var _ policy.DecodeBatcher = (*ledger)(nil)
	l := newLedger()
	direct := kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D
	for _, r := range []*reservation{
		{seq: 1, mode: direct, decode: "d1", tokens: 400, maxOut: 362},
		{seq: 2, mode: direct, decode: "d1", tokens: 100, maxOut: 40},
		{seq: 3, mode: direct, decode: "d2", tokens: 100, maxOut: 2},
		// a background re-home decodes nothing
		{seq: 4, mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, decode: "d1", tokens: 9_000, store: true},
	} {
		l.add(r)
	}
	for _, tc := range []struct {
		worker string
		n      int32
		minOut int64
	}{{"d1", 2, 40}, {"d2", 1, 2}, {"d3", 0, 0}} {
		if n, m := l.DecodeBatch(tc.worker); n != tc.n || m != tc.minOut {
			t.Errorf("%s: %d requests, min output %d; want %d, %d", tc.worker, n, m, tc.n, tc.minOut)
		}
	}
	if _, ok := l.remove(2); !ok {
		t.Fatal("remove 2")
	}
	if n, m := l.DecodeBatch("d1"); n != 1 || m != 362 {
		t.Errorf("after the outcome: %d requests, min output %d; want 1, 362", n, m)
	}
}

// TestLocalLargeAppendSeesTheBatch: through the router's ledger, a large append of a session
// resident on d2 is prefilled on d2 itself while d2's batch can take the stall (nothing in
// flight, or a turn of 362 output tokens), and goes to P while a co-running turn of 12 output
// tokens would pass its TPOT SLO ((12 − 1) × 800 < 10 000); the short turn's outcome frees it.
func TestLocalLargeAppendSeesTheBatch(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d2", KvCommittedLen: 10_000, Generation: 1, LastSeenUnixMs: 1})
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "long", DecodeWorker: "d2", KvCommittedLen: 5_000, Generation: 1, LastSeenUnixMs: 1})
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "short", DecodeWorker: "d2", KvCommittedLen: 5_000, Generation: 1, LastSeenUnixMs: 1})
	local := kvcv1.RouteReason_ROUTE_REASON_LOCAL_LARGE_APPEND
	long := f.decide("long", 1, 5_100, 362)
	if long.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || long.Decode.GetWorkerId() != "d2" {
		t.Fatalf("long turn: %v", long)
	}
	d := f.decide("s", 1, 20_000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Reason != local || d.Decode.GetWorkerId() != "d2" ||
		d.CachedTokens != 10_000 || d.Prefill != nil || d.ReservedTokens != 10_100 {
		t.Fatalf("beside a long turn: %v, want DIRECT_TO_D / LOCAL_LARGE_APPEND on d2", d)
	}
	f.report(d.DecisionId, true, okKind, 20_100)
	short := f.decide("short", 1, 5_100, 12)
	d = f.decide("s", 2, 30_200, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Reason != kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND ||
		d.Decode.GetWorkerId() != "d2" {
		t.Fatalf("beside a 12-token turn: %v, want the large append on P", d)
	}
	f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, 0)
	f.report(short.DecisionId, true, okKind, 5_112)
	d = f.decide("s", 3, 30_200, 100)
	if d.Reason != local || d.CachedTokens != 20_100 {
		t.Fatalf("after the short turn's outcome: %v, want LOCAL_LARGE_APPEND", d)
	}
}
