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
