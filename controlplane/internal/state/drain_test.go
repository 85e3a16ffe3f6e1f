package state

import (
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// commands drains a stream's queue (non-blocking) and returns the commands in it.
func commands(st *Stream) []*kvcv1.Command {
	var out []*kvcv1.Command
	for {
		select {
		case m := <-st.Queue():
			out = append(out, m.GetCommand())
		default:
			return out
		}
	}
}

func drainStatus(t *testing.T, s *State, id string) *kvcv1.DrainStatus {
	t.Helper()
	st, ok, err := s.DrainStatus(id)
	if err != nil || !ok {
		t.Fatalf("drain status of %s: %v %v", id, ok, err)
	}
	return st
}

// TestDrainWaitsForSidecarAndSnapshot: a drain of a disconnected decode worker moves nothing
// until its sidecar is back; then a session with a usable snapshot is released at once and one
// without is given a snapshot target and released when the snapshot is ingested. A new leader
// restarts the drain of a worker it loads draining.
func TestDrainWaitsForSidecarAndSnapshot(t *testing.T) {
	f := newFixture(t, Config{DrainSnapshotWait: time.Hour})
	s := f.st
	d0, err := s.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if err != nil {
		t.Fatal(err)
	}
	p0h := hello("p0", kvcv1.WorkerRole_WORKER_ROLE_PREFILL)
	p0h.PeerAddr, p0h.TransferEndpoint = "127.0.0.1:1", "p0-seg"
	p0, err := s.Attach(p0h)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
		{SessionId: "a", KvCommittedLen: 500, Generation: 1}, {SessionId: "b", KvCommittedLen: 600, Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(p0, &kvcv1.ResidentSessions{FullSync: true, Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "a", Seqlen: 500, Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	s.Detach(d0)
	if _, err := s.Drain("d0", true); err != nil {
		t.Fatal(err)
	}
	if st := drainStatus(t, s, "d0"); !st.GetActive() || st.GetSessionsAtStart() != 2 || st.GetMovedWithSnapshot() != 0 {
		t.Fatalf("drain of a disconnected worker moved something: %v", st)
	}
	if recs, _ := s.ListSessions("", 10, "d0"); len(recs) != 2 {
		t.Fatalf("sessions moved without telling the worker: %d left", len(recs))
	}

	d0, err = s.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE)) // the sidecar is back
	if err != nil {
		t.Fatal(err)
	}
	var released []string
	var target *kvcv1.SetSnapshotTargetCommand
	waitFor(t, "a released, b targeted", func() bool {
		for _, c := range commands(d0) {
			if r := c.GetReleaseSession(); r != nil {
				released = append(released, r.GetSessionId())
			}
			if tg := c.GetSetSnapshotTarget(); tg != nil {
				target = tg
			}
		}
		return len(released) == 1 && target != nil
	})
	if released[0] != "a" || target.GetSessionId() != "b" || target.GetPrefillWorkerId() != "p0" || target.GetGeneration() != 1 {
		t.Fatalf("released %v, target %v", released, target)
	}
	if st := drainStatus(t, s, "d0"); !st.GetActive() || st.GetWaitingForSnapshot() != 1 || st.GetMovedWithSnapshot() != 1 {
		t.Fatalf("status %v", st)
	}
	// b's snapshot arrives: released at once.
	if err := s.ApplyEvent(p0, &kvcv1.SessionEvent{SessionId: "b", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED, KvLen: 600, Generation: 1}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "drain finished", func() bool { return !drainStatus(t, s, "d0").GetActive() })
	if st := drainStatus(t, s, "d0"); st.GetMovedWithSnapshot() != 2 || st.GetSessionsLeft() != 0 || st.GetCancelled() {
		t.Fatalf("status %v", st)
	}
	for _, id := range []string{"a", "b"} {
		if r, _ := s.Session(id); r.GetDecodeWorker() != "" || r.GetPreviousDecodeWorker() != "d0" || r.GetSnapshot().GetPrefillWorker() != "p0" {
			t.Fatalf("%s after the drain: %v", id, r)
		}
	}
	if err := s.Flush(t.Context()); err != nil {
		t.Fatal(err)
	}

	// Failover: the new leader loads d0 draining and restarts its drain.
	s.EndTerm(f.term)
	if err := f.sess.Close(); err != nil {
		t.Fatal(err)
	}
	f2 := leadOn(t, f.store, Config{NodeID: "cp-2", DrainSnapshotWait: time.Hour})
	waitFor(t, "restarted drain finished", func() bool {
		st, ok, _ := f2.st.DrainStatus("d0")
		return ok && !st.GetActive() && st.GetStartedUnixMs() > 0
	})
	if w, ok := f2.st.Worker("d0"); !ok || !w.GetDraining() {
		t.Fatalf("d0 on the new leader: %v", w)
	}
}

// TestUndrainStopsTheMove: undrain cancels a drain that waits for a snapshot; the session stays.
func TestUndrainStopsTheMove(t *testing.T) {
	f := newFixture(t, Config{DrainSnapshotWait: time.Hour})
	s := f.st
	d1, err := s.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Reconcile(d1, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{{SessionId: "c", KvCommittedLen: 100}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Drain("d1", true); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "c waiting", func() bool { return drainStatus(t, s, "d1").GetWaitingForSnapshot() == 1 })
	if _, err := s.Drain("d1", false); err != nil {
		t.Fatal(err)
	}
	st := drainStatus(t, s, "d1")
	if st.GetActive() || !st.GetCancelled() || st.GetFinishedUnixMs() == 0 {
		t.Fatalf("status after undrain %v", st)
	}
	if r, _ := s.Session("c"); r.GetDecodeWorker() != "d1" {
		t.Fatalf("c moved after undrain: %v", r)
	}
	for _, c := range commands(d1) {
		if c.GetReleaseSession() != nil {
			t.Fatalf("release sent: %v", c)
		}
	}
	if _, _, err := s.DrainStatus("nope"); err != nil {
		t.Fatal(err)
	}
}
