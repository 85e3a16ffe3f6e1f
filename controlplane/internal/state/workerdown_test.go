package state

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type noReservations struct{}

func (noReservations) Reserved(string) policy.Reserved { return policy.Reserved{} }
func (noReservations) TransferPending(string) bool     { return false }

// decide runs the routing policy over the state's live tables, as the router does.
func decide(st *State, session string, input int64) policy.Decision {
	rec, _ := st.Session(session)
	return policy.Decide(&policy.Input{Knobs: policy.Compile(st.Policy()), Query: policy.Query{SessionID: session, Turn: 3,
		InputTokens: input, MaxOutputTokens: 10, MultiturnHint: true}, Session: rec, Workers: st.Workers(), Ledger: noReservations{}})
}

func TestWorkerDownReports(t *testing.T) {
	f := newFixture(t, Config{})
	st := f.st
	D, P := kvcv1.WorkerRole_WORKER_ROLE_DECODE, kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	d0, _ := st.Attach(hello("d0", D))
	d1, _ := st.Attach(hello("d1", D))
	p0, _ := st.Attach(hello("p0", P))
	p1, _ := st.Attach(hello("p1", P))
	// d0 is emptier than d1: with both up, new sessions go to d0.
	must(t, st.ApplyLoad(d1, &kvcv1.WorkerLoad{UsedTokens: 400}))
	must(t, st.ApplyLoad(p1, &kvcv1.WorkerLoad{RunningRequests: 3}))
	must(t, st.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
		{SessionId: "x", KvCommittedLen: 300, Generation: 1}, {SessionId: "y", KvCommittedLen: 200, Generation: 1}}}))
	must(t, st.Reconcile(p0, &kvcv1.ResidentSessions{FullSync: true, Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "x", Seqlen: 300, Generation: 1}}}))
	if d := decide(st, "x", 310); d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != "d0" {
		t.Fatalf("before: %s to %s", d.Mode, d.Decode.GetWorkerId())
	}
	if d := decide(st, "new", 50); d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || d.Decode.GetWorkerId() != "d0" || d.Prefill.GetWorkerId() != "p0" {
		t.Fatalf("before: new session %s to %s/%s", d.Mode, d.Prefill.GetWorkerId(), d.Decode.GetWorkerId())
	}

	// d0's worker dies; its sidecar stays connected and says so.
	must(t, st.ApplyLoad(d0, &kvcv1.WorkerLoad{WorkerDown: true, WorkerDownReason: "bridge closed"}))
	w, _ := st.Worker("d0")
	if w.GetState() != kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN || w.GetWorkerDownReason() != "bridge closed" || w.GetWorkerDownSinceUnixMs() == 0 {
		t.Fatalf("d0 after worker down: %v", w)
	}
	since := w.GetWorkerDownSinceUnixMs()
	for _, id := range []string{"x", "y"} {
		if r, _ := st.Session(id); r.GetDecodeWorker() != "" || r.GetPreviousDecodeWorker() != "d0" {
			t.Fatalf("%s still resident: %v", id, r)
		}
	}
	if got := testutil.ToFloat64(st.m.workerDown); got != 1 {
		t.Fatalf("kvc_cp_worker_down_total %v", got)
	}
	if got := testutil.ToFloat64(st.m.workers.WithLabelValues("decode", "worker_down")); got != 1 {
		t.Fatalf("kvc_cp_workers{role=decode,state=worker_down} %v", got)
	}
	if got := testutil.ToFloat64(st.m.workers.WithLabelValues("decode", "ready")); got != 1 {
		t.Fatalf("kvc_cp_workers{role=decode,state=ready} %v, want d1", got)
	}
	if got := testutil.ToFloat64(st.m.workers.WithLabelValues("prefill", "worker_down")); got != 0 {
		t.Fatalf("kvc_cp_workers{role=prefill,state=worker_down} %v", got)
	}
	// x reseeds from its snapshot onto d1; y (no snapshot) re-prefills onto d1; new work avoids d0.
	if d := decide(st, "x", 310); d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || d.Decode.GetWorkerId() != "d1" || d.Prefill.GetWorkerId() != "p0" {
		t.Fatalf("x after d0 died: %s %s via %s", d.Mode, d.Decode.GetWorkerId(), d.Prefill.GetWorkerId())
	}
	if d := decide(st, "y", 210); d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL || d.Decode.GetWorkerId() != "d1" {
		t.Fatalf("y after d0 died: %s %s", d.Mode, d.Decode.GetWorkerId())
	}
	if d := decide(st, "new", 50); d.Decode.GetWorkerId() != "d1" {
		t.Fatalf("new session after d0 died: %s to %s", d.Mode, d.Decode.GetWorkerId())
	}
	// The state is persisted at once (not at the next periodic load write).
	waitFor(t, "d0 persisted as WORKER_DOWN", func() bool {
		pw, ok, err := f.store.GetWorker(context.Background(), "d0")
		return err == nil && ok && pw.GetState() == kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN
	})
	// Heartbeats while down keep the first down time; draining while down stays WORKER_DOWN.
	must(t, st.ApplyLoad(d0, &kvcv1.WorkerLoad{WorkerDown: true, WorkerDownReason: "bridge closed"}))
	if _, err := st.Drain("d0", true); err != nil {
		t.Fatal(err)
	}
	if w, _ := st.Worker("d0"); w.GetState() != kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN || w.GetWorkerDownSinceUnixMs() != since {
		t.Fatalf("d0 after heartbeat and drain while down: %v", w)
	}
	// Up again: back to DRAINING (it was drained meanwhile), fields cleared.
	must(t, st.ApplyLoad(d0, &kvcv1.WorkerLoad{}))
	if w, _ := st.Worker("d0"); w.GetState() != kvcv1.WorkerState_WORKER_STATE_DRAINING || w.GetWorkerDownSinceUnixMs() != 0 || w.GetWorkerDownReason() != "" {
		t.Fatalf("d0 after recovery: %v", w)
	}
	if _, err := st.Drain("d0", false); err != nil {
		t.Fatal(err)
	}
	if w, _ := st.Worker("d0"); w.GetState() != kvcv1.WorkerState_WORKER_STATE_READY {
		t.Fatalf("d0 after undrain: %v", w)
	}

	// p0's worker dies: its snapshots stay (the store is the sidecar's), it still serves
	// RESEED_SNAPSHOT, but it prefills nothing new.
	must(t, st.ApplyLoad(d0, &kvcv1.WorkerLoad{WorkerDown: true, WorkerDownReason: "again"}))
	must(t, st.ApplyLoad(p0, &kvcv1.WorkerLoad{WorkerDown: true, WorkerDownReason: "3 health probes failed"}))
	if r, _ := st.Session("x"); r.GetSnapshot().GetPrefillWorker() != "p0" {
		t.Fatalf("x's snapshot dropped with p0's worker: %v", r)
	}
	if d := decide(st, "x", 310); d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || d.Prefill.GetWorkerId() != "p0" || d.Decode.GetWorkerId() != "d1" {
		t.Fatalf("x with p0's worker down: %s %s via %s", d.Mode, d.Decode.GetWorkerId(), d.Prefill.GetWorkerId())
	}
	if d := decide(st, "y", 210); d.Prefill.GetWorkerId() != "p1" {
		t.Fatalf("y re-prefilled on %s", d.Prefill.GetWorkerId())
	}

	// A sidecar that connects with its worker already down is never READY.
	st.Detach(d1)
	_, err := st.Attach(&kvcv1.Hello{WorkerId: "d1", Role: D, KvCapacityTokens: 1000, WorkerDown: true, WorkerDownReason: "no worker"})
	if err != nil {
		t.Fatal(err)
	}
	if w, _ := st.Worker("d1"); w.GetState() != kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN || w.GetWorkerDownReason() != "no worker" {
		t.Fatalf("d1 attached down: %v", w)
	}
	if d := decide(st, "new", 50); d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Decode != nil {
		t.Fatalf("every D down: %s to %v", d.Mode, d.Decode.GetWorkerId())
	}
}
