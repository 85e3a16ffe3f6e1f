package router

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestGenerationsOfANewTerm: under a generation term, the residencies a leader makes (snapshot
// reseeds, seeds and reseeds through the prefill store) take generations of its own range, above
// those of an earlier leader; the generation a decision predicts (store_generation) is the one
// its outcome gives the session, and a reseed's snapshot target re-tags the earlier term's
// snapshot.
func TestGenerationsOfANewTerm(t *testing.T) {
	const term = 5
	base := uint64(term) << policy.GenerationTermBits
	old := uint64(3)<<policy.GenerationTermBits | 7 // made by an earlier leader
	for _, tc := range []struct {
		name string
		// the record this leader loaded (nil: a new session)
		rec        *kvcv1.SessionRecord
		storeSeeds bool
		mode       kvcv1.RouteMode
		want       uint64
		wantBase   uint64 // the snapshot target's base generation
	}{
		{"reseed from an earlier term's snapshot", &kvcv1.SessionRecord{SessionId: "s", Generation: old, PreviousDecodeWorker: "d1", LastSeenUnixMs: 1,
			Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 5000, Generation: old}}, false,
			kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, base, old},
		{"reseed of a session of this term", &kvcv1.SessionRecord{SessionId: "s", Generation: base + 2, PreviousDecodeWorker: "d1", LastSeenUnixMs: 1,
			Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 5000, Generation: base + 2}}, false,
			kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, base + 3, base + 2},
		{"seed through the store", nil, true, kvcv1.RouteMode_ROUTE_MODE_SEED, base, base},
		{"reseed through the store, earlier term", &kvcv1.SessionRecord{SessionId: "s", Generation: old, PreviousDecodeWorker: "d1", LastSeenUnixMs: 1}, true,
			kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, base, base},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, basicCluster()...)
			f.c.SetGenerationTerm(term)
			if err := f.c.SetPolicy(&kvcv1.Policy{SeedThroughStore: proto.Bool(tc.storeSeeds)}); err != nil {
				t.Fatal(err)
			}
			input := int64(4000)
			if tc.rec != nil {
				if tc.rec.Snapshot != nil {
					tc.rec.Snapshot.UpdatedUnixMs = f.now.UnixMilli()
				}
				f.c.PutSession(tc.rec)
				input = 5500
			}
			d := f.decide("s", 4, input, 100)
			if d.Mode != tc.mode {
				t.Fatalf("decision %s/%s, want %s", d.Mode, d.Reason, tc.mode)
			}
			if sg := d.GetExecution().GetStoreGeneration(); tc.storeSeeds && sg != tc.want {
				t.Fatalf("store_generation %#x, want %#x", sg, tc.want)
			}
			f.report(d.DecisionId, true, okKind, input+100)
			if rec := f.session("s"); rec.DecodeWorker != d.Decode.WorkerId || rec.Generation != tc.want {
				t.Fatalf("after the outcome: on %q, generation %#x; want %s, %#x", rec.DecodeWorker, rec.Generation, d.Decode.WorkerId, tc.want)
			}
			tg := lastTarget(t, f.c, d.Decode.WorkerId)
			if tg.GetGeneration() != tc.want || tg.GetBaseGeneration() != tc.wantBase || tg.GetValidBaseLen() == 0 {
				t.Fatalf("snapshot target: generation %#x, base %d of generation %#x; want %#x over a base of %#x",
					tg.GetGeneration(), tg.GetValidBaseLen(), tg.GetBaseGeneration(), tc.want, tc.wantBase)
			}
			f.checkLedger()
		})
	}
}
