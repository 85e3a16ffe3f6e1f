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

// TestSeedThroughStoreWhenShort: with seed_through_store_when_short (decode workers that take
// both), a seed or re-prefill goes through the prefill store only while its decode worker is
// short of pages — the count does not admit it, no decode worker had room (a refused seed's
// fallback), or the worker reports requests waiting for pages — and keeps the direct transfer
// otherwise; seed_through_store (colocated decode workers) still seeds every one through it.
func TestSeedThroughStoreWhenShort(t *testing.T) {
	short := func(p *kvcv1.Policy) { p.SeedThroughStoreWhenShort = proto.Bool(true) }
	both := func(p *kvcv1.Policy) { short(p); p.SeedThroughStore = proto.Bool(true) }
	lost := resident("", 10_000)
	lost.PreviousDecodeWorker, lost.Generation = "d1", 4
	queued := func() []*kvcv1.Worker { // both decode workers have requests waiting for pages
		ws := cluster()
		for _, w := range ws[2:] {
			w.Load.PreallocQueueDepth = 2
		}
		return ws
	}
	full := map[string]Reserved{"d1": {Tokens: 95_000}, "d2": {Tokens: 95_000}} // no D admits 10.6K now
	tests := []struct {
		name    string
		knob    func(p *kvcv1.Policy)
		query   Query
		session *kvcv1.SessionRecord
		workers []*kvcv1.Worker
		res     map[string]Reserved
		mode    kvcv1.RouteMode
		store   bool
	}{
		{"seed with room: direct", short, q(3_000, 100, 1), nil, cluster(), nil, mSeed, false},
		{"seed onto a worker with a prealloc queue", short, q(3_000, 100, 1), nil, queued(), nil, mSeed, true},
		{"refused seed's fallback: no room anywhere", short, q(3_000, 100, 1), nil, cluster(), full, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, true},
		{"re-prefill with room: direct", short, q(10_500, 100, 4), lost, cluster(), nil, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, false},
		{"re-prefill not admitted now", short, q(10_500, 100, 4), lost, cluster(), full, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, true},
		{"knob off, no room", nil, q(10_500, 100, 4), lost, queued(), full, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, false},
		{"colocated: always", both, q(3_000, 100, 1), nil, cluster(), nil, mSeed, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := tt.res
			if res == nil {
				res = map[string]Reserved{}
			}
			in := &Input{Knobs: knobs(tt.knob), Query: tt.query, Session: tt.session, Workers: tt.workers,
				Ledger: ledger(res), NowMs: nowMs}
			d := Decide(in)
			if d.Mode != tt.mode || (d.Exec.StoreGeneration != 0) != tt.store {
				t.Fatalf("%s/%s (admission %s) store_generation %d, want %s through the store %v",
					d.Mode, d.Reason, d.Admission, d.Exec.StoreGeneration, tt.mode, tt.store)
			}
		})
	}
}
