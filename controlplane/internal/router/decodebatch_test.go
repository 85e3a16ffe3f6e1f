package router

import (
	"fmt"
	"testing"
	"time"

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

// walkDecodeBatch is the old DecodeBatch: a walk of every pending reservation.
func walkDecodeBatch(l *ledger, workerID string) (int32, int64) {
	var n int32
	var minOut int64
	for r := range l.pending.all() {
		if r.decode != workerID || r.maxOut <= 1 {
			continue
		}
		if n == 0 || r.maxOut < minOut {
			minOut = r.maxOut
		}
		n++
	}
	return n, minOut
}

// TestDecodeBatchAccountMatchesTheWalk: the per-worker batch account answers as the walk of
// every pending reservation did, after every add, outcome and expiry of a mixed sequence
// (plain P/D requests that decode on their D, re-homes that decode nothing, equal max_outputs,
// the front removed first), and an idle worker's account is swept without losing a batch.
func TestDecodeBatchAccountMatchesTheWalk(t *testing.T) {
	direct, plain, snap := kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT
	t0 := time.Unix(1_000, 0)
	type step struct {
		add    *reservation
		remove uint64
		expire time.Duration // expired(t0 + expire)
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"front removed first", []step{
			{add: &reservation{seq: 1, mode: direct, decode: "d1", tokens: 100, maxOut: 40}},
			{add: &reservation{seq: 2, mode: direct, decode: "d1", tokens: 100, maxOut: 362}},
			{add: &reservation{seq: 3, mode: direct, decode: "d1", tokens: 100, maxOut: 12}},
			{remove: 3}, {remove: 1}, {remove: 2},
		}},
		{"equal outputs and other workers", []step{
			{add: &reservation{seq: 1, mode: direct, decode: "d1", tokens: 100, maxOut: 50}},
			{add: &reservation{seq: 2, mode: direct, decode: "d2", tokens: 100, maxOut: 50}},
			{add: &reservation{seq: 3, mode: direct, decode: "d1", tokens: 100, maxOut: 50}},
			{remove: 1}, {add: &reservation{seq: 4, mode: direct, decode: "d1", tokens: 100, maxOut: 2}},
			{remove: 4}, {remove: 3},
		}},
		{"plain requests decode, re-homes and one-token requests do not", []step{
			{add: &reservation{seq: 1, mode: plain, decode: "d1", plain: true, prefills: true, prefill: "p1", maxOut: 80}},
			{add: &reservation{seq: 2, mode: snap, decode: "d1", tokens: 9_000, transfer: true, store: true}},
			{add: &reservation{seq: 3, mode: direct, decode: "d1", tokens: 100, maxOut: 1}},
			{add: &reservation{seq: 4, mode: plain, prefills: true, prefill: "p1", maxOut: 30}}, // no D named
			{remove: 2}, {remove: 1}, {remove: 3},
		}},
		{"expiry", []step{
			{add: &reservation{seq: 1, mode: direct, decode: "d1", tokens: 100, maxOut: 20, deadline: t0.Add(time.Second)}},
			{add: &reservation{seq: 2, mode: direct, decode: "d1", tokens: 100, maxOut: 70, deadline: t0.Add(3 * time.Second)}},
			{add: &reservation{seq: 3, mode: direct, decode: "d2", tokens: 100, maxOut: 5, deadline: t0.Add(2 * time.Second)}},
			{expire: 2 * time.Second}, {expire: 5 * time.Second},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLedger()
			for i, st := range tc.steps {
				switch {
				case st.add != nil:
					if st.add.deadline.IsZero() {
						st.add.deadline = t0.Add(time.Hour)
					}
					l.add(st.add)
				case st.remove != 0:
					if _, ok := l.remove(st.remove); !ok {
						t.Fatalf("step %d: remove %d: not pending", i, st.remove)
					}
				default:
					l.expired(t0.Add(st.expire))
				}
				l.sweep() // an idle account may go at any time
				for _, w := range []string{"d1", "d2", "d3", "p1"} {
					gn, gm := l.DecodeBatch(w)
					wn, wm := walkDecodeBatch(l, w)
					if gn != wn || gm != wm {
						t.Errorf("step %d, %s: %d requests, min output %d; the walk says %d, %d", i, w, gn, gm, wn, wm)
					}
				}
			}
			if l.pending.len() == 0 {
				for id, w := range l.workers {
					if w.batch.len() != 0 {
						t.Errorf("%s: %d in its batch with nothing pending", id, w.batch.len())
					}
				}
			}
		})
	}
}

// BenchmarkDecodeBatch: one large-append candidate's question with 4,096 decisions in flight
// on 8 decode workers (the old walk read all of them per call).
func BenchmarkDecodeBatch(b *testing.B) {
	l := newLedger()
	for i := range 4096 {
		l.add(&reservation{seq: uint64(i + 1), mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, decode: fmt.Sprintf("d%d", i%8),
			tokens: 100, maxOut: int64(2 + i%500), deadline: time.Unix(1_000, 0)})
	}
	b.ResetTimer()
	for range b.N {
		if n, _ := l.DecodeBatch("d3"); n != 512 {
			b.Fatalf("%d requests, want 512", n)
		}
	}
}
