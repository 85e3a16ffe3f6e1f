package worker

import (
	"context"
	"sync"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A decode worker reports its running requests to its sidecar (ReportDemandRequest
// running_requests; before, none, and the sidecar's load report said 0): a seed waiting for its
// KV holds its pages and runs; a turn waiting for its session's previous turn does not; once
// both are over the report says 0.
func TestDecodeReportsRunningRequests(t *testing.T) {
	h := newHub()
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 256, zeroTiming(), 10*time.Second)
	last := func() *kvcv1.ReportDemandRequest {
		r := d.sc.demandReports()
		if len(r) == 0 {
			return nil
		}
		return r[len(r)-1]
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(1)
	go func() { // the decode half of a seed whose prefill never comes: it waits for its KV
		defer wg.Done()
		post(t, ctx, d.url, body("seed", 4, false, kvcReq{Mode: "SEED", Role: "decode", SessionID: "a", InputTokens: 40, Room: i64(1)}))
	}()
	waitFor(t, func() bool { return last().GetRunningRequests() == 1 })
	// A turn of b behind b's previous turn (held here) is in the worker's hands, not running.
	unlock, err := d.w.lockTurn(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		post(t, ctx, d.url, body("b-1", 4, false, kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "b", InputTokens: 48, CachedTokens: 40, Keep: bptr(true)}))
	}()
	waitFor(t, func() bool { return d.w.demand.serving.Load() == 2 })
	if got := d.w.runningRequests(); got != 1 {
		t.Fatalf("running %d with the seed receiving and b's turn waiting for its previous one; want 1", got)
	}
	unlock() // b's turn runs: b is not resident, it fails
	cancel() // the seed's client goes away
	wg.Wait()
	waitFor(t, func() bool { return d.w.demand.serving.Load() == 0 })
	waitFor(t, func() bool { return last().GetRunningRequests() == 0 })
	for _, r := range d.sc.demandReports() {
		if r.GetRunningRequests() > 1 {
			t.Fatalf("report %v: at most one request ran", r)
		}
	}
}
