package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func workerDown(w *kvcv1.Worker) *kvcv1.Worker {
	return with(w, func(w *kvcv1.Worker) { w.State = kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN })
}

// A worker whose sidecar reports the worker process down takes no new work; a prefill
// sidecar in that state still serves RESEED_SNAPSHOT from its store (no prefill compute).
func TestDecideWorkerDown(t *testing.T) {
	withSnap := func(r *kvcv1.SessionRecord) *kvcv1.SessionRecord {
		r.Snapshot = snap("p1", 20_000)
		return r
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
		{"resident on a D whose worker died: reseed from the snapshot elsewhere", q(20_100, 10, 4), withSnap(resident("d1", 20_000)),
			[]*kvcv1.Worker{pW("p1", 0), workerDown(dW("d1", 100_000, 0)), dW("d2", 100_000, 50_000)},
			mSnap, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, "p1", "d2"},
		{"resident on a dead D, no snapshot: re-prefill elsewhere", q(20_100, 10, 4), resident("d1", 20_000),
			[]*kvcv1.Worker{pW("p1", 0), workerDown(dW("d1", 100_000, 0)), dW("d2", 100_000, 50_000)},
			mPrefill, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING, "p1", "d2"},
		{"evicted session, snapshot on a P whose worker died: still RESEED_SNAPSHOT from its store", q(20_100, 10, 4),
			withSnap(&kvcv1.SessionRecord{SessionId: "s", PreviousDecodeWorker: "d1", Generation: 1, Turn: 3}),
			[]*kvcv1.Worker{workerDown(pW("p1", 0)), pW("p2", 0), workerDown(dW("d1", 100_000, 0)), dW("d2", 100_000, 0)},
			mSnap, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, "p1", "d2"},
		{"new session: never seeded on a dead D nor prefilled on a dead P", q(1_000, 10, 1), nil,
			[]*kvcv1.Worker{workerDown(pW("p1", 0)), pW("p2", 5), dW("d1", 100_000, 90_000), workerDown(dW("d2", 100_000, 0))},
			mSeed, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, "p2", "d1"},
		{"only dead prefill workers: no prefill worker", q(1_000, 10, 1), nil,
			[]*kvcv1.Worker{workerDown(pW("p1", 0)), dW("d1", 100_000, 0)},
			mFallback, kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER, "", "d1"},
		{"only dead decode workers: plain fallback names no D", q(1_000, 10, 1), nil,
			[]*kvcv1.Worker{pW("p1", 0), workerDown(dW("d1", 100_000, 0))},
			mFallback, kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY, "p1", ""},
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
			for _, w := range []*kvcv1.Worker{d.Prefill, d.Decode} {
				if w != nil && w.State == kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN && d.Mode != mSnap {
					t.Fatalf("%s work on %s, whose worker is down", d.Mode, w.WorkerId)
				}
			}
		})
	}
}
