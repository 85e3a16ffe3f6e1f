package policy

import (
	"testing"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestSeedThroughStore: with seed_through_store (colocated decode workers) the plans that
// prefill on P to make a session resident on D (SEED, RESEED_PREFILL) seed through P's store,
// as the snapshot of the generation the session takes with this seed; every other plan, and
// every plan with the knob off, keeps the direct transfer. Under a generation term the seed's
// generation is the term's next one (NextGeneration), above any of an earlier leader.
func TestSeedThroughStore(t *testing.T) {
	on := func(p *kvcv1.Policy) { p.SeedThroughStore = proto.Bool(true) }
	lost := func(gen uint64) *kvcv1.SessionRecord { // residency lost, no snapshot: RESEED_PREFILL
		r := resident("", 10_000)
		r.PreviousDecodeWorker, r.Generation = "d1", gen
		return r
	}
	withSnap := lost(4)
	withSnap.Snapshot = snap("p1", 10_000)
	const term = 3
	base := uint64(term) << GenerationTermBits
	tests := []struct {
		name    string
		knob    func(p *kvcv1.Policy)
		query   Query
		session *kvcv1.SessionRecord
		term    uint64
		unavail bool
		mode    kvcv1.RouteMode
		want    uint64
	}{
		{"new session", on, q(3_000, 100, 1), nil, 0, false, mSeed, 1},
		{"new session under a term", on, q(3_000, 100, 1), nil, term, false, mSeed, base},
		{"knob off", nil, q(3_000, 100, 1), nil, term, false, mSeed, 0},
		{"reseed by prefill", on, q(10_500, 100, 4), lost(4), 0, false, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, 5},
		{"reseed by prefill, generation of an earlier term", on, q(10_500, 100, 4), lost(4), term, false, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, base},
		{"reseed by prefill, generation of this term", on, q(10_500, 100, 4), lost(base + 4), term, false, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, base + 5},
		{"reseed from a snapshot", on, q(10_500, 100, 4), withSnap, term, false, mSnap, 0},
		{"direct", on, q(10_500, 100, 4), resident("d1", 10_000), term, false, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, 0},
		{"large append", on, q(30_000, 100, 4), resident("d1", 10_000), term, false, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, 0},
		{"not leading", on, q(3_000, 100, 1), nil, 0, true, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := &Input{Knobs: knobs(tt.knob), Query: tt.query, Session: tt.session, Workers: cluster(),
				Ledger: ledger(map[string]Reserved{}), NowMs: nowMs, Unavailable: tt.unavail, GenerationTerm: tt.term}
			d := Decide(in)
			if d.Mode != tt.mode || d.Exec.StoreGeneration != tt.want {
				t.Fatalf("%s/%s store_generation %d, want %s with %d", d.Mode, d.Reason, d.Exec.StoreGeneration, tt.mode, tt.want)
			}
			if tt.want != 0 && (!d.Exec.CallPrefill || !d.Exec.OpenSession || d.Exec.Transfer != kvcv1.TransferKind_TRANSFER_KIND_SEED) {
				t.Fatalf("a store seed's plan: %+v", d.Exec)
			}
		})
	}
}
