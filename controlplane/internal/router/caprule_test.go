package router

import (
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestRefusedSeedFallbackKeepsResidency: a new session no decode worker admits is a PD_FALLBACK
// that computes and moves its whole context onto a D anyway; it reserves its pages there and
// records residency, so the next turn goes direct instead of being a fresh seed (issue 20 item
// 1: the cascades of plain fallbacks under a burst).
func TestRefusedSeedFallbackKeepsResidency(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 100_000, 90_000))
	d := f.decide("s", 0, 20_000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Reason != kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY ||
		d.Decode.GetWorkerId() != "d1" || !d.Execution.GetOpenSession() || !d.Execution.GetKeepSession() || d.ReservedTokens != 20_100 {
		t.Fatalf("refused seed: %v/%v on %s open %v keep %v reserved %d", d.Mode, d.Reason, d.Decode.GetWorkerId(),
			d.Execution.GetOpenSession(), d.Execution.GetKeepSession(), d.ReservedTokens)
	}
	f.s.mu.Lock()
	res, pending := f.s.led.Reserved("d1"), f.s.led.TransferPending("s")
	f.s.mu.Unlock()
	if res.Tokens != 20_100 || res.Plain != 0 || !pending {
		t.Fatalf("the fallback's pages must be visible to the next decision: %+v, transfer pending %v", res, pending)
	}
	if got := testutil.ToFloat64(f.s.m.keptFallbacks); got != 1 {
		t.Fatalf("kvc_router_fallback_residency_total = %v", got)
	}
	f.checkLedger()
	f.report(d.DecisionId, true, okKind, 20_050)
	if rec := f.session("s"); rec.DecodeWorker != "d1" || rec.KvCommittedLen != 20_050 || rec.Generation == 0 {
		t.Fatalf("record after the fallback: decode %q committed %d generation %d", rec.DecodeWorker, rec.KvCommittedLen, rec.Generation)
	}
	f.now = f.now.Add(time.Second)
	if next := f.decide("s", 1, 20_200, 100); next.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || next.Decode.GetWorkerId() != "d1" {
		t.Fatalf("next turn: %v/%v on %s, want DIRECT_TO_D on d1", next.Mode, next.Reason, next.Decode.GetWorkerId())
	}
	if got := testutil.ToFloat64(f.s.m.wastedKV); got != 0 {
		t.Fatalf("kvc_router_wasted_kv_fallbacks_total = %v", got)
	}
}

// TestLostSessionReseedsFromStoreOverBudget: a lost session with a usable snapshot is a
// RESEED_SNAPSHOT to the best decode worker even when every D is full and out of store-transfer
// slots (it queues there: d1 has room but no slot, d2 a slot but no room; room wins), never a
// whole-context PD_FALLBACK; the store slot is held until its outcome and counted apart from
// the seeds in flight.
func TestLostSessionReseedsFromStoreOverBudget(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 100_000, 0), routertest.Decode("d2", 100_000, 90_000))
	if err := f.c.SetPolicy(&kvcv1.Policy{MaxConcurrentTransfers: i32p(1)}); err != nil {
		t.Fatal(err)
	}
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "lost", Generation: 3, PreviousDecodeWorker: "d1", Turn: 4, KvCommittedLen: 0,
		Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 30_000, Generation: 3, UpdatedUnixMs: f.now.UnixMilli()}})
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "other", Generation: 2, PreviousDecodeWorker: "d1", Turn: 4,
		Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 60_000, Generation: 2, UpdatedUnixMs: f.now.UnixMilli()}})
	// "other" takes d1's only store-transfer slot and most of its room.
	o := f.decide("other", 5, 60_000, 100)
	if o.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || o.Decode.GetWorkerId() != "d1" {
		t.Fatalf("other: %v/%v on %s", o.Mode, o.Reason, o.Decode.GetWorkerId())
	}
	d := f.decide("lost", 5, 30_000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT ||
		d.Decode.GetWorkerId() != "d1" || d.Prefill.GetWorkerId() != "p1" || d.ReservedTokens != 30_100 {
		t.Fatalf("lost: %v/%v on %s from %s reserving %d, want RESEED_SNAPSHOT/SNAPSHOT_HIT on d1 from p1 reserving 30100",
			d.Mode, d.Reason, d.Decode.GetWorkerId(), d.Prefill.GetWorkerId(), d.ReservedTokens)
	}
	f.s.mu.Lock()
	res := f.s.led.Reserved("d1")
	f.s.mu.Unlock()
	if res.StoreTransfers != 2 || res.Transfers != 2 || res.Seeds != 0 {
		t.Fatalf("d1's reservations %+v, want 2 store transfers", res)
	}
	if got := testutil.ToFloat64(f.s.m.queued.WithLabelValues("RESEED_SNAPSHOT", "transfer_budget")); got != 1 {
		t.Fatalf("queued{RESEED_SNAPSHOT,transfer_budget} = %v", got)
	}
	f.checkLedger()
	f.report(d.DecisionId, true, okKind, 30_000)
	f.report(o.DecisionId, true, okKind, 60_000)
	f.s.mu.Lock()
	res = f.s.led.Reserved("d1")
	f.s.mu.Unlock()
	if res.StoreTransfers != 0 || res.Transfers != 0 {
		t.Fatalf("after the outcomes: %+v", res)
	}
	if got := testutil.ToFloat64(f.s.m.wastedKV); got != 0 {
		t.Fatalf("kvc_router_wasted_kv_fallbacks_total = %v", got)
	}
}

// TestWastedKVFallbackCounted: a plain fallback of a session whose snapshot was usable (a second
// turn while its reseed is in flight) counts in kvc_router_wasted_kv_fallbacks_total.
func TestWastedKVFallbackCounted(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 100_000, 0))
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", Generation: 3, PreviousDecodeWorker: "d0", Turn: 4,
		Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 30_000, Generation: 3, UpdatedUnixMs: f.now.UnixMilli()}})
	if d := f.decide("s", 5, 30_000, 100); d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
		t.Fatalf("first: %v/%v", d.Mode, d.Reason)
	}
	d := f.decide("s", 6, 30_100, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT {
		t.Fatalf("second: %v/%v", d.Mode, d.Reason)
	}
	if got := testutil.ToFloat64(f.s.m.wastedKV); got != 1 {
		t.Fatalf("kvc_router_wasted_kv_fallbacks_total = %v, want 1", got)
	}
}

func i32p(v int32) *int32 { return &v }
