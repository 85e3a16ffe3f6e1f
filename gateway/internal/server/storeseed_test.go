package server

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// storeSeed is a SEED decision through the prefill store (RouteExecution.store_generation).
func storeSeed(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
	r := decideMode(kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, fakecp.Seed())(q, p, d)
	r.GetDecision().Execution.StoreGeneration = 3
	r.GetDecision().Execution.StoreLoadRoom = 5151
	return r
}

// TestSeedThroughStore: the gateway calls P first with to_store and the generation, waits for
// its whole answer, and only then calls D with snapshot_seqlen = the prompt and the load room,
// without bootstrap fields (D loads from P's store; no P→D transfer into a waiting D).
func TestSeedThroughStore(t *testing.T) {
	var pAnswered atomic.Bool
	dCalled := make(chan struct{}, 1)
	pb := func(int, workerReq) string {
		// D must not be called while P has not answered: give a wrong (concurrent) order the
		// chance to show, then answer.
		select {
		case <-dCalled:
		case <-time.After(300 * time.Millisecond):
		}
		pAnswered.Store(true)
		return ""
	}
	var dAfterP atomic.Bool
	db := func(int, workerReq) string {
		dAfterP.Store(pAnswered.Load())
		select {
		case dCalled <- struct{}{}:
		default:
		}
		return ""
	}
	e := setup(t, storeSeed, pb, db, 0)
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if ev := sse(t, resp.Body); len(ev) != 4 || ev[3] != "[DONE]" {
		t.Fatalf("events %v", ev)
	}
	pr, dr := <-e.p.got, <-e.d.got
	if !dAfterP.Load() {
		t.Fatal("D was called before P answered")
	}
	if !pr.KVC.ToStore || pr.KVC.Generation != 3 || pr.KVC.Room != 4242 || pr.BootstrapRoom != 4242 || pr.BootstrapPort != 7001 ||
		pr.KVC.Role != "prefill" || pr.KVC.Mode != "SEED" || pr.SessionParams != nil || pr.KVC.SnapshotSeqlen != 0 {
		t.Fatalf("prefill got %+v", pr)
	}
	if dr.KVC.ToStore || dr.KVC.Generation != 0 || dr.KVC.Room != 5151 || dr.KVC.SnapshotSeqlen != 1000 || dr.BootstrapRoom != 0 ||
		dr.BootstrapHost != "" || dr.KVC.PrefillPeerAddr != "127.0.0.1:7001" || dr.KVC.Mode != "SEED" || dr.SessionParams == nil ||
		dr.SessionParams.ID != "s1" {
		t.Fatalf("decode got %+v", dr)
	}
	if o := outcome(t, e.cp); !o.GetSuccess() || o.GetExecutedMode() != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("outcome %v", o)
	}
}

// TestSeedThroughStoreFails: P cannot store the seed: D is never called and the outcome is the
// plan's transfer failure.
func TestSeedThroughStoreFails(t *testing.T) {
	e := setup(t, storeSeed, func(int, workerReq) string { return "502" }, nil, 0)
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	if resp.StatusCode == 200 {
		t.Fatal("a failed store seed answered 200")
	}
	<-e.p.got
	o := outcome(t, e.cp)
	if o.GetSuccess() || o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED {
		t.Fatalf("outcome %v", o)
	}
	if n := len(e.d.got); n != 0 {
		t.Fatalf("D called %d times after P failed", n)
	}
}
