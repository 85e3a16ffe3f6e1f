package router

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestAdmittedCountedPerDecodeWorker: kvc_router_worker_admitted_total counts every decision
// that keeps its session on a decode worker, on that worker, through the counter its ledger
// account keeps, and again after the account was swept (a new account looks it up again).
func TestAdmittedCountedPerDecodeWorker(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	want := map[string]float64{}
	run := func(sessions int) {
		for i := range sessions {
			d := f.decide(fmt.Sprintf("s%d", i), 1, 1000, 100)
			if d.GetExecution().GetKeepSession() {
				want[d.GetDecode().GetWorkerId()]++
			}
			// A failed turn: its account holds nothing after it (no settling tokens).
			f.s.Handle(outcome(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT, 0))
		}
	}
	run(6)
	f.s.mu.Lock()
	f.s.led.sweep() // every account idle after its outcomes: all dropped
	n := len(f.s.led.workers)
	f.s.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d accounts after the sweep, want 0", n)
	}
	run(6)
	if len(want) == 0 {
		t.Fatal("no decision kept its session")
	}
	for _, id := range []string{"d1", "d2"} {
		if got := testutil.ToFloat64(f.s.m.admitted.WithLabelValues(id)); got != want[id] {
			t.Errorf("admitted on %s = %v, want %v", id, got, want[id])
		}
	}
}
