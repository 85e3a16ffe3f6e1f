package router

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestNewSessionsSpreadBetweenHeartbeats replays the placement bug seen on a local cluster:
// seeds completed one after another, faster than the decode workers' load heartbeats, all
// landed on one D because its reported used_tokens had not caught up. Successful outcomes now
// keep their tokens counted until a heartbeat newer than the success arrives.
func TestNewSessionsSpreadBetweenHeartbeats(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d0", 100_000, 0), routertest.Decode("d1", 100_000, 0))
	hb := f.now.UnixMilli()
	for _, id := range []string{"d0", "d1"} {
		f.c.UpdateWorker(id, func(w *kvcv1.Worker) { w.LastHeartbeatUnixMs = hb })
	}
	placed := map[string]int{}
	for i := range 6 {
		f.now = f.now.Add(10 * time.Millisecond)
		d := f.decide(fmt.Sprintf("s%d", i), 0, 10_000, 100)
		if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
			t.Fatalf("session %d: mode %v", i, d.Mode)
		}
		placed[d.Decode.WorkerId]++
		f.report(d.DecisionId, true, okKind, 10_100)
	}
	if placed["d0"] != 3 || placed["d1"] != 3 {
		t.Fatalf("placement %v, want 3 and 3", placed)
	}

	// A heartbeat that includes the sessions replaces the settling tokens: nothing is counted
	// twice.
	f.now = f.now.Add(time.Second)
	for _, id := range []string{"d0", "d1"} {
		f.c.UpdateWorker(id, func(w *kvcv1.Worker) {
			w.LastHeartbeatUnixMs = f.now.UnixMilli()
			w.Load = &kvcv1.WorkerLoad{UsedTokens: 3 * 10_100}
		})
	}
	f.now = f.now.Add(10 * time.Millisecond)
	d := f.decide("late", 0, 10_000, 100)
	f.s.mu.Lock()
	got := f.s.led.Reserved("d0").Tokens + f.s.led.Reserved("d1").Tokens
	f.s.mu.Unlock()
	if got != d.ReservedTokens {
		t.Fatalf("reserved after fresh heartbeats = %d, want only the new decision's %d", got, d.ReservedTokens)
	}
}

// TestDirectTurnSameAnswerAcrossHeartbeat: the same 96-token direct turn gets the same answer
// before and after the load report that first includes its session (issue 20 item 1). The
// capacity rule counts the requesting session's own KV (its turn pins it) and the in-flight
// reservations, never other sessions' settled (idle, evictable) tokens; a heartbeat only moves
// tokens between "settling" and "reported", so the answer cannot flip with its timing. Before,
// the turn was a PD_FALLBACK / NO_D_CAPACITY (a 40K prefill sent to d2, which had 15K free)
// until d1's heartbeat, and DIRECT_TO_D after it.
func TestDirectTurnSameAnswerAcrossHeartbeat(t *testing.T) {
	build := func(heartbeat bool) *fixture {
		f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 100_000, 0), routertest.Decode("d2", 100_000, 80_000))
		start := f.now.UnixMilli()
		for _, id := range []string{"d1", "d2"} {
			f.c.UpdateWorker(id, func(w *kvcv1.Worker) { w.LastHeartbeatUnixMs = start })
		}
		f.now = f.now.Add(10 * time.Millisecond)
		a := f.decide("a", 0, 40_000, 256)
		if a.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || a.Decode.GetWorkerId() != "d1" {
			t.Fatalf("a's seed: %v on %s", a.Mode, a.Decode.GetWorkerId())
		}
		f.report(a.DecisionId, true, okKind, 40_000)
		f.now = f.now.Add(10 * time.Millisecond)
		b := f.decide("b", 0, 50_000, 400) // in flight on d1 while a's next turn comes
		if b.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || b.Decode.GetWorkerId() != "d1" {
			t.Fatalf("b's seed: %v on %s", b.Mode, b.Decode.GetWorkerId())
		}
		if heartbeat {
			// d1's report includes a's 40K, idle and so evictable; b's seed has not landed.
			f.now = f.now.Add(time.Second)
			f.c.UpdateWorker("d1", func(w *kvcv1.Worker) {
				w.LastHeartbeatUnixMs = f.now.UnixMilli()
				w.Load = &kvcv1.WorkerLoad{UsedTokens: 40_000, EvictableTokens: 40_000, ResidentSessions: 1}
			})
		}
		f.now = f.now.Add(10 * time.Millisecond)
		return f
	}
	var got [2]*kvcv1.RouteDecision
	for i, hb := range []bool{false, true} {
		f := build(hb)
		got[i] = f.decide("a", 1, 40_096, 4_500)
		if d := got[i]; d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != "d1" ||
			d.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT || d.ReservedTokens != 96+4_500 {
			t.Errorf("heartbeat %v: %v / %v on %s reserving %d, want DIRECT_TO_D / SESSION_RESIDENT on d1 reserving %d",
				hb, d.Mode, d.Reason, d.Decode.GetWorkerId(), d.ReservedTokens, 96+4_500)
		}
	}
	if got[0].Mode != got[1].Mode || got[0].Reason != got[1].Reason {
		t.Fatalf("answer flips with the heartbeat: before %v/%v, after %v/%v", got[0].Mode, got[0].Reason, got[1].Mode, got[1].Reason)
	}
}
