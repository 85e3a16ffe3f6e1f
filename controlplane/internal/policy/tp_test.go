package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// tp makes w a tensor-parallel group of size ranks (as the state's router view shows one).
func tp(w *kvcv1.Worker, size int32) *kvcv1.Worker {
	return with(w, func(w *kvcv1.Worker) { w.TpGroup, w.TpSize = w.WorkerId, size })
}

// Prefill and decode pair only with equal tensor parallelism: rank r sends to rank r.
func TestDecideTensorParallelPairing(t *testing.T) {
	evicted := func(sn *kvcv1.SnapshotInfo) *kvcv1.SessionRecord {
		return &kvcv1.SessionRecord{SessionId: "s", PreviousDecodeWorker: "gone", Generation: 1, Turn: 3, Snapshot: sn}
	}
	cases := []struct {
		name    string
		q       Query
		rec     *kvcv1.SessionRecord
		workers []*kvcv1.Worker
		mode    kvcv1.RouteMode
		reason  kvcv1.RouteReason
		prefill string
		decode  string
	}{
		{"a new session on a TP=2 decode group is prefilled by the TP=2 prefill group, not the emptier TP=1 one", q(1_000, 10, 1), nil,
			[]*kvcv1.Worker{pW("p1", 0), tp(pW("p2", 5), 2), tp(dW("d2", 100_000, 0), 2)},
			mSeed, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, "p2", "d2"},
		{"a decode worker no prefill worker pairs with is not seeded", q(1_000, 10, 1), nil,
			[]*kvcv1.Worker{tp(pW("p2", 0), 2), dW("d1", 100_000, 0), tp(dW("d2", 100_000, 90_000), 2)},
			mSeed, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, "p2", "d2"},
		{"only unpaired decode workers: no prefill worker, D prefills itself", q(1_000, 10, 1), nil,
			[]*kvcv1.Worker{tp(pW("p4", 0), 4), tp(dW("d2", 100_000, 0), 2)},
			mFallback, kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER, "", "d2"},
		{"a snapshot on a TP=2 group reseeds into a TP=2 decode group", q(20_100, 10, 4), evicted(snap("p2", 20_000)),
			[]*kvcv1.Worker{pW("p1", 0), tp(pW("p2", 0), 2), tp(dW("d2", 100_000, 50_000), 2), tp(dW("d3", 100_000, 0), 2)},
			mSnap, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, "p2", "d3"},
		{"a snapshot whose holder has another TP is not read: re-prefill on the decode worker's own TP", q(20_100, 10, 4), evicted(snap("p2", 20_000)),
			[]*kvcv1.Worker{pW("p1", 0), tp(pW("p2", 0), 2), dW("d1", 100_000, 0)},
			mPrefill, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING, "p1", "d1"},
		{"a large append on a TP=2 decode group is prefilled by a TP=2 prefill group", q(30_000, 10, 4), resident("d2", 10_000),
			[]*kvcv1.Worker{pW("p1", 0), tp(pW("p2", 3), 2), tp(dW("d2", 100_000, 0), 2)},
			mFallback, kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND, "p2", "d2"},
		{"a large append without a prefill worker of its TP: plain P/D between equal TP", q(30_000, 10, 4), resident("d2", 10_000),
			[]*kvcv1.Worker{pW("p1", 0), tp(dW("d2", 100_000, 0), 2), dW("d1", 100_000, 0)},
			mFallback, kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER, "p1", "d1"},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			d := Decide(&Input{Knobs: knobs(nil), Query: tt.q, Session: tt.rec, Workers: tt.workers, Ledger: ledger(map[string]Reserved{}), NowMs: nowMs})
			if d.Mode != tt.mode || d.Reason != tt.reason {
				t.Fatalf("got %s/%s, want %s/%s", d.Mode, d.Reason, tt.mode, tt.reason)
			}
			if workerIDOf(d.Prefill) != tt.prefill || workerIDOf(d.Decode) != tt.decode {
				t.Fatalf("prefill %q decode %q, want %q %q", workerIDOf(d.Prefill), workerIDOf(d.Decode), tt.prefill, tt.decode)
			}
			if d.Prefill != nil && d.Decode != nil && TPSize(d.Prefill) != TPSize(d.Decode) {
				t.Fatalf("paired tp_size %d with %d", TPSize(d.Prefill), TPSize(d.Decode))
			}
		})
	}
}

func TestSnapshotTargetTP(t *testing.T) {
	ws := []*kvcv1.Worker{pW("p1", 0), tp(pW("p2", 0), 2), tp(pW("p3", 0), 2)}
	tests := []struct {
		name, current string
		tp            int32
		want          string
	}{
		{"no tensor parallelism", "", 1, "p1"},
		{"a TP=2 decode worker keeps its snapshot on a TP=2 group", "", 2, "p2"},
		{"the current holder when it has the decode worker's TP", "p3", 2, "p3"},
		{"not a current holder of another TP", "p1", 2, "p2"},
		{"none of that TP", "", 4, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := workerIDOf(SnapshotTargetTP(ws, tt.current, tt.tp)); got != tt.want {
				t.Fatalf("target %q, want %q", got, tt.want)
			}
		})
	}
}
