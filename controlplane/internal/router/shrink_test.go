package router

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A session evicted from its D whose next turn is shorter than its snapshot (a shrunken context,
// issue 14 item 8) is reseeded from the snapshot up to the input — not re-prefilled as
// SNAPSHOT_STALE: the holder is told to push [0, input) of its snapshot, and the new D's target
// names that as its valid base (the store's entry is longer, so D's first push turns full).
func TestReseedFromSnapshotLongerThanTheInput(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 12_000, 200)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("seed: %v", d)
	}
	seedD := d.Decode.WorkerId
	f.report(d.DecisionId, true, okKind, 12_200)
	// D evicts the session; p2 holds its snapshot of 12,200 tokens (generation 1).
	f.c.UpdateSession("s", func(r *kvcv1.SessionRecord) {
		r.PreviousDecodeWorker, r.DecodeWorker = r.DecodeWorker, ""
		r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p2", Seqlen: 12_200, Generation: 1, UpdatedUnixMs: f.now.UnixMilli()}
	})
	// The next turn drops part of the history: 9,000 tokens.
	d = f.decide("s", 1, 9_000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT ||
		d.Prefill.GetWorkerId() != "p2" || d.SnapshotSeqlen != 9_000 || d.CachedTokens != 9_000 || d.SnapshotGeneration != 1 {
		t.Fatalf("shrunken turn after an eviction: %v", d)
	}
	push := f.c.Commands("p2")
	if len(push) != 1 || push[0].GetPushSnapshot().GetSeqlen() != 9_000 || push[0].GetPushSnapshot().GetGeneration() != 1 {
		t.Fatalf("push_snapshot to the holder: %v", push)
	}
	newD := d.Decode.WorkerId
	f.report(d.DecisionId, true, okKind, 9_100)
	rec := f.session("s")
	if rec.DecodeWorker != newD || rec.KvCommittedLen != 9_100 || rec.Generation != 2 {
		t.Fatalf("after the reseed: %v", rec)
	}
	c := f.c.Commands(newD)
	if newD == seedD {
		c = c[len(c)-1:]
	}
	if len(c) != 1 {
		t.Fatalf("commands to %s: %v", newD, c)
	}
	if st := c[0].GetSetSnapshotTarget(); st.GetPrefillWorkerId() != "p2" || st.GetValidBaseLen() != 9_000 || st.GetBaseGeneration() != 1 {
		t.Fatalf("new D's snapshot target: %v", st)
	}
	f.checkLedger()
}
