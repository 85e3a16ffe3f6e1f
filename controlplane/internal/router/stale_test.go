package router

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A seed that lands while another decode worker re-reported the session (its sidecar came back
// and re-committed what it still held: the record named it meanwhile) leaves that worker with a
// stale copy: it is told to release it (issue 16 finding 1).
func TestSeedReleasesCopyReportedMeanwhile(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 4000, 200)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("seed: %v", d)
	}
	seedD := d.Decode.WorkerId
	other := "d1"
	if seedD == other {
		other = "d2"
	}
	before := len(f.c.Commands(other))
	// The returning worker's re-commit makes the record name it before the seed's outcome.
	f.c.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.DecodeWorker, r.KvCommittedLen = other, 3000 })
	f.report(d.DecisionId, true, okKind, 4150)
	rec := f.session("s")
	if rec.DecodeWorker != seedD || rec.Generation != 1 {
		t.Fatalf("after the seed: %v", rec)
	}
	c := f.c.Commands(other)
	if len(c) != before+1 || c[len(c)-1].GetReleaseSession().GetSessionId() != "s" {
		t.Fatalf("the worker re-reporting the session was not told to release it: %v", c)
	}
}
