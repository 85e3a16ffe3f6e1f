package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestOneCapacityRuleNoDowngrade (issue 20 item 1): a plan is admitted by what it needs on its
// D, counting the decisions in flight and the session's own KV but not other sessions' settled
// tokens; no plan of a session whose KV exists is downgraded to a PD_FALLBACK for capacity or
// budget; a refused seed's fallback keeps the session where its KV lands; a plain fallback of a
// session with usable KV is WastedKV.
func TestOneCapacityRuleNoDowngrade(t *testing.T) {
	lostSnap := func(from string, snapLen int64) *kvcv1.SessionRecord {
		return with2(resident(from, 25_000), func(r *kvcv1.SessionRecord) { r.Snapshot = snap("p1", snapLen) })
	}
	full := func(id string) *kvcv1.Worker { return dW(id, 100_000, 90_000) }
	cases := []struct {
		name      string
		k         func(p *kvcv1.Policy)
		q         Query
		rec       *kvcv1.SessionRecord
		workers   []*kvcv1.Worker
		led       fakeLedger
		resyncing bool

		mode      kvcv1.RouteMode
		reason    kvcv1.RouteReason
		decode    string
		admission Admission
		reserved  int64
		keep      bool // KeepsResidency, and the plan opens and keeps the session
		wasted    bool
	}{
		{name: "resident turn over capacity waits on its own D",
			q: q(12_000, 100, 4), rec: resident("d1", 10_000),
			workers: []*kvcv1.Worker{pW("p1", 0), dW("d1", 100_000, 94_000), dW("d2", 100_000, 0)},
			mode:    mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_D_QUEUED, decode: "d1", admission: AdmitOverCapacity, reserved: 2_100},
		{name: "others' settled tokens do not count; the session's own KV does",
			q: q(10_096, 4_500, 4), rec: resident("d1", 10_000), workers: []*kvcv1.Worker{pW("p1", 0), dW("d1", 100_000, 0)},
			led:  ledger(map[string]Reserved{"d1": {Tokens: 50_000, Settling: 40_000}}),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, decode: "d1", reserved: 4_596},
		{name: "the same turn after the report that shows its KV as evictable: the same answer",
			q: q(10_096, 4_500, 4), rec: resident("d1", 10_000),
			workers: []*kvcv1.Worker{pW("p1", 0), evictable(dW("d1", 100_000, 40_000), 40_000)},
			led:     ledger(map[string]Reserved{"d1": {Tokens: 50_000}}),
			mode:    mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, decode: "d1", reserved: 4_596},
		{name: "own KV + in flight + need over capacity: queued (the report shows the own KV as evictable)",
			q: q(40_096, 4_600, 4), rec: resident("d1", 40_000),
			workers: []*kvcv1.Worker{pW("p1", 0), evictable(dW("d1", 100_000, 40_000), 40_000)},
			led:     ledger(map[string]Reserved{"d1": {Tokens: 50_400}}),
			mode:    mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_D_QUEUED, decode: "d1", admission: AdmitOverCapacity, reserved: 4_696},
		{name: "the same before the report: queued alike",
			q: q(40_096, 4_600, 4), rec: resident("d1", 40_000), workers: []*kvcv1.Worker{pW("p1", 0), dW("d1", 100_000, 0)},
			led:  ledger(map[string]Reserved{"d1": {Tokens: 50_400, Settling: 40_000}}),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_D_QUEUED, decode: "d1", admission: AdmitOverCapacity, reserved: 4_696},
		{name: "a D whose pool is mostly sessions in use (the worker's report) is not seeded onto: its sidecar calls them evictable",
			q: q(20_000, 100, 1),
			workers: []*kvcv1.Worker{pW("p1", 0), unevictable(evictable(dW("d1", 100_000, 80_000), 80_000), 80_000),
				evictable(dW("d2", 100_000, 85_000), 85_000)},
			mode: mSeed, reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, decode: "d2", reserved: 20_100},
		{name: "a resident turn on a D whose other sessions are in use (the worker's report): queued, not admitted",
			q: q(10_096, 100, 4), rec: resident("d1", 10_000),
			workers: []*kvcv1.Worker{pW("p1", 0), unevictable(evictable(dW("d1", 100_000, 90_000), 90_000), 85_000), dW("d2", 100_000, 0)},
			mode:    mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_D_QUEUED, decode: "d1", admission: AdmitOverCapacity, reserved: 196},
		{name: "the sidecar's estimate counts when it is the larger: pushes pin more than the worker's requests",
			q: q(10_096, 100, 4), rec: resident("d1", 10_000),
			workers: []*kvcv1.Worker{pW("p1", 0), unevictable(evictable(dW("d1", 100_000, 90_000), 5_000), 1_000), dW("d2", 100_000, 0)},
			mode:    mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_D_QUEUED, decode: "d1", admission: AdmitOverCapacity, reserved: 196},
		{name: "lost with a usable snapshot, every D full: RESEED_SNAPSHOT to the best D, queued",
			q: q(30_000, 100, 5), rec: lostSnap("d1", 28_000),
			workers: []*kvcv1.Worker{pW("p1", 0), unreachable(dW("d1", 100_000, 0)), full("d2"), dW("d3", 100_000, 80_000)},
			mode:    mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, decode: "d3", admission: AdmitOverCapacity, reserved: 30_100},
		{name: "lost with a usable snapshot: a D with room beats an emptier-looking full one",
			q: q(30_000, 100, 5), rec: lostSnap("d1", 28_000),
			workers: []*kvcv1.Worker{pW("p1", 0), unreachable(dW("d1", 100_000, 0)), dW("d2", 100_000, 0), dW("d3", 100_000, 50_000)},
			led:     ledger(map[string]Reserved{"d2": {Tokens: 70_000}}),
			mode:    mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, decode: "d3", reserved: 30_100},
		{name: "lost with a usable snapshot, every store-transfer slot taken: RESEED_SNAPSHOT anyway",
			q: q(30_000, 100, 5), rec: lostSnap("d1", 28_000),
			workers: []*kvcv1.Worker{pW("p1", 0), unreachable(dW("d1", 100_000, 0)), dW("d2", 100_000, 0)},
			led:     ledger(map[string]Reserved{"d2": {Transfers: 4, StoreTransfers: 4}}),
			mode:    mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, decode: "d2", admission: AdmitOverBudget, reserved: 30_100},
		{name: "lost, the only D rejected it: reseeded there anyway",
			q:       q(30_000, 100, 5),
			rec:     with2(lostSnap("d1", 28_000), func(r *kvcv1.SessionRecord) { r.DRejects = map[string]int32{"d2": 1} }),
			workers: []*kvcv1.Worker{pW("p1", 0), unreachable(dW("d1", 100_000, 0)), dW("d2", 100_000, 0)},
			mode:    mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, decode: "d2", admission: AdmitRejecter, reserved: 30_100},
		{name: "evicted without a snapshot, every D full: RESEED_PREFILL keeps the session",
			q: q(30_000, 100, 5), rec: &kvcv1.SessionRecord{SessionId: "s", Generation: 2, PreviousDecodeWorker: "d1", Turn: 4},
			workers: []*kvcv1.Worker{pW("p1", 0), full("d1"), full("d2")},
			mode:    mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING, decode: "d1", admission: AdmitOverCapacity, reserved: 30_100},
		{name: "a new session no D admits: the fallback keeps it where its KV lands",
			q: q(20_000, 100, 1), workers: []*kvcv1.Worker{pW("p1", 0), full("d1"), dW("d2", 100_000, 81_000)},
			mode: mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY, decode: "d2", admission: AdmitOverCapacity,
			reserved: 20_100, keep: true},
		{name: "seed_max_inflight_decode's fallback keeps it too",
			k: func(p *kvcv1.Policy) { p.SeedMaxInflightDecode = i32(1) }, q: q(20_000, 100, 1), workers: cluster(),
			led:  ledger(map[string]Reserved{"d1": {Seeds: 1, Transfers: 1}, "d2": {Seeds: 1, Transfers: 1}}),
			mode: mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_INFLIGHT, decode: "d1", reserved: 20_100, keep: true},
		{name: "a seed gate's fallback keeps nothing (the operator's choice)",
			k: func(p *kvcv1.Policy) { p.SeedMinTurn = i32(3) }, q: q(20_000, 100, 1), workers: cluster(),
			mode: mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_EARLY_TURN, decode: "d1"},
		{name: "a reseed in flight: the second turn's fallback wastes the usable snapshot",
			q: q(30_000, 100, 5), rec: lostSnap("d1", 28_000), led: ledger(nil, "s"),
			workers: []*kvcv1.Worker{pW("p1", 0), unreachable(dW("d1", 100_000, 0)), dW("d2", 100_000, 0)},
			mode:    mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT, decode: "d2", wasted: true},
		{name: "a new leader's resync: a fallback of a session with a snapshot wastes it",
			q: q(30_000, 100, 5), resyncing: true,
			rec:     &kvcv1.SessionRecord{SessionId: "s", Generation: 2, Turn: 4, Snapshot: snap("p1", 28_000)},
			workers: []*kvcv1.Worker{pW("p1", 0), dW("d2", 100_000, 0)},
			mode:    mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE, decode: "d2", wasted: true},
		{name: "a stale snapshot is not usable: not wasted",
			q: q(30_000, 100, 5), resyncing: true,
			rec:     &kvcv1.SessionRecord{SessionId: "s", Generation: 2, Turn: 4, Snapshot: snap("p1", 10_000)},
			workers: []*kvcv1.Worker{pW("p1", 0), dW("d2", 100_000, 0)},
			mode:    mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE, decode: "d2"},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			led := tt.led
			if led.res == nil {
				led.res = map[string]Reserved{}
			}
			d := Decide(&Input{Knobs: knobs(tt.k), Query: tt.q, Session: tt.rec, Workers: tt.workers, Ledger: led, NowMs: nowMs, Resyncing: tt.resyncing})
			if d.Mode != tt.mode || d.Reason != tt.reason || workerIDOf(d.Decode) != tt.decode {
				t.Fatalf("got %s/%s on %q, want %s/%s on %q", d.Mode, d.Reason, workerIDOf(d.Decode), tt.mode, tt.reason, tt.decode)
			}
			if d.Admission != tt.admission || d.ReservedTokens != tt.reserved || d.KeepsResidency != tt.keep || d.WastedKV != tt.wasted {
				t.Errorf("admission %v reserved %d keeps %v wasted %v, want %v %d %v %v",
					d.Admission, d.ReservedTokens, d.KeepsResidency, d.WastedKV, tt.admission, tt.reserved, tt.keep, tt.wasted)
			}
			if d.LocalReject != "" {
				t.Errorf("local reject %q: the control plane refuses nothing for capacity", d.LocalReject)
			}
			if tt.keep && (!d.Exec.KeepSession || !d.Exec.OpenSession || !d.Transfer || d.PrefillPriority != PrefillPriorityLow) {
				t.Errorf("kept fallback: exec %+v transfer %v priority %d", d.Exec, d.Transfer, d.PrefillPriority)
			}
			if !tt.keep && d.Mode == mFallback && (d.Exec.OpenSession || d.Exec.KeepSession) {
				t.Errorf("plain fallback keeps the session: %+v", d.Exec)
			}
		})
	}
}
