package router

import (
	"testing"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestSeedThroughStore: with seed_through_store the SEED decision names the generation of the
// store seed and a room of its own for D's load; after it succeeded, D's snapshot target is the
// seed's prefill worker (also before its SNAPSHOT_INGESTED arrived, and even when another
// prefill worker has more room) with the seed as valid base, so D's first push appends onto it.
func TestSeedThroughStore(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	if err := f.c.SetPolicy(&kvcv1.Policy{SeedThroughStore: proto.Bool(true)}); err != nil {
		t.Fatal(err)
	}
	d := f.decide("s", 0, 4000, 200)
	e := d.GetExecution()
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || e.GetStoreGeneration() != 1 || !e.GetCallPrefill() ||
		e.GetTransfer() != kvcv1.TransferKind_TRANSFER_KIND_SEED {
		t.Fatalf("seed: %v", d)
	}
	if r := e.GetStoreLoadRoom(); r <= 0 || r > 1<<53 || r == d.BootstrapRoom {
		t.Fatalf("load room %d (bootstrap room %d)", r, d.BootstrapRoom)
	}
	p, dec := d.Prefill.WorkerId, d.Decode.WorkerId
	f.c.UpdateWorker(p, func(w *kvcv1.Worker) { w.Load.SnapshotBytesUsed = 1 << 30 }) // the other P looks emptier
	f.report(d.DecisionId, true, okKind, 4150)
	if rec := f.session("s"); rec.DecodeWorker != dec || rec.Generation != 1 {
		t.Fatalf("after the seed: %v", rec)
	}
	cmds := f.c.Commands(dec)
	if len(cmds) != 1 {
		t.Fatalf("commands to %s: %v", dec, cmds)
	}
	st := cmds[0].GetSetSnapshotTarget()
	if st.GetPrefillWorkerId() != p || st.GetGeneration() != 1 || st.GetValidBaseLen() != 4000 || st.GetBaseGeneration() != 1 {
		t.Fatalf("snapshot target after a store seed: %v", st)
	}
	// Knob off: the direct transfer, and the snapshot target without a valid base.
	if err := f.c.SetPolicy(&kvcv1.Policy{SeedThroughStore: proto.Bool(false)}); err != nil {
		t.Fatal(err)
	}
	d = f.decide("s2", 0, 4000, 200)
	if e := d.GetExecution(); e.GetStoreGeneration() != 0 || e.GetStoreLoadRoom() != 0 {
		t.Fatalf("seed with the knob off: %v", d)
	}
	f.report(d.DecisionId, true, okKind, 4150)
	cmds = f.c.Commands(d.Decode.WorkerId)
	if st := cmds[len(cmds)-1].GetSetSnapshotTarget(); st.GetSessionId() != "s2" || st.GetValidBaseLen() != 0 {
		t.Fatalf("snapshot target after a direct seed: %v", st)
	}
	f.checkLedger()
}
