package state

import (
	"time"

	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestResendTargetsAfterSidecarRestart: a restarted decode sidecar's full resync lists its
// re-committed sessions without a snapshot target; the control plane names it again — with the
// snapshot of the same generation as the valid base, so the next push appends — but not for
// sessions whose target the sidecar knows, nor for ones the table holds elsewhere, nor on a
// resync that is not full, nor on a stream that is no longer the worker's.
func TestResendTargetsAfterSidecarRestart(t *testing.T) {
	f := newFixture(t, Config{})
	s := f.st
	d0, err := s.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if err != nil {
		t.Fatal(err)
	}
	d1, err := s.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if err != nil {
		t.Fatal(err)
	}
	p0h := hello("p0", kvcv1.WorkerRole_WORKER_ROLE_PREFILL)
	p0h.PeerAddr, p0h.TransferEndpoint = "127.0.0.1:1", "p0-seg"
	p0, err := s.Attach(p0h)
	if err != nil {
		t.Fatal(err)
	}
	must(t, s.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
		{SessionId: "a", KvCommittedLen: 500, Generation: 2}, {SessionId: "b", KvCommittedLen: 600, Generation: 1},
		{SessionId: "c", KvCommittedLen: 700, Generation: 1}}}))
	must(t, s.Reconcile(d1, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{{SessionId: "e", KvCommittedLen: 100, Generation: 1}}}))
	// p0 holds a's snapshot of generation 2 (pushed by d0) and b's of an older generation
	must(t, s.Reconcile(p0, &kvcv1.ResidentSessions{FullSync: true, Snapshots: []*kvcv1.SnapshotHeld{
		{SessionId: "a", Seqlen: 480, Generation: 2}, {SessionId: "b", Seqlen: 300, Generation: 1}}}))
	// b's residency moved on a generation (a reseed on d0 that has not pushed yet)
	s.UpdateSession("b", func(rec *kvcv1.SessionRecord) { rec.Generation = 2 })
	// a is pinned by its agent and low priority: both follow the target on their own command
	until := time.Now().Add(time.Hour).UnixMilli()
	s.UpdateSession("a", func(rec *kvcv1.SessionRecord) { rec.PinnedUntilUnixMs, rec.LowPriority = until, true })
	commands(d0)

	// the sidecar restarts: a resync not full names nothing
	rs := &kvcv1.ResidentSessions{Sessions: []*kvcv1.ResidentSession{{SessionId: "a", KvCommittedLen: 500}}}
	if n, err := s.ResendTargets(d0, rs); err != nil || n != 0 {
		t.Fatalf("partial resync: %d targets, %v", n, err)
	}
	rs = &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
		{SessionId: "a", KvCommittedLen: 500},                          // no target: named, with its base
		{SessionId: "b", KvCommittedLen: 600},                          // no target, snapshot of an older generation: named, no base
		{SessionId: "c", KvCommittedLen: 700, HasSnapshotTarget: true}, // knows its target
		{SessionId: "e", KvCommittedLen: 100},                          // resident on d1 in the table
		{SessionId: "f", KvCommittedLen: 100, Generation: 3},           // new to the table: resident here now, named
	}}
	must(t, s.Reconcile(d0, rs))
	commands(d0)
	n, err := s.ResendTargets(d0, rs)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*kvcv1.SetSnapshotTargetCommand{}
	hints := map[string]*kvcv1.SetSessionHintsCommand{}
	for _, c := range commands(d0) {
		if st := c.GetSetSnapshotTarget(); st != nil {
			got[st.GetSessionId()] = st
		}
		if h := c.GetSetSessionHints(); h != nil {
			if _, named := got[h.GetSessionId()]; !named {
				t.Fatalf("hints of %s before its target", h.GetSessionId())
			}
			hints[h.GetSessionId()] = h
		}
	}
	if n != 3 || len(got) != 3 || got["f"].GetGeneration() != 3 {
		t.Fatalf("%d targets sent: %v", n, got)
	}
	a := got["a"]
	if a.GetPrefillWorkerId() != "p0" || a.GetPeerAddr() != "127.0.0.1:1" || a.GetTransferEndpoint() != "p0-seg" || a.GetGeneration() != 2 ||
		a.GetValidBaseLen() != 480 || a.GetBaseGeneration() != 2 || a.GetPinnedUntilUnixMs() != 0 || a.GetLowPriority() {
		t.Fatalf("a's target %v", a)
	}
	if len(hints) != 1 || hints["a"].GetPinnedUntilUnixMs() != until || !hints["a"].GetLowPriority() {
		t.Fatalf("hints %v: want a's pin and priority only", hints)
	}
	b := got["b"]
	if b.GetPrefillWorkerId() != "p0" || b.GetGeneration() != 2 || b.GetValidBaseLen() != 0 || b.GetBaseGeneration() != 0 ||
		b.GetPinnedUntilUnixMs() != 0 || b.GetLowPriority() {
		t.Fatalf("b's target %v", b)
	}
	// a stream that is no longer the worker's is refused
	s.Detach(d0)
	if _, err := s.ResendTargets(d0, rs); err == nil {
		t.Fatal("a detached stream's resync named targets")
	}
}
