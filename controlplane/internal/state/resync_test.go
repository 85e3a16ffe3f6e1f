package state

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestResyncWindow: a new leader that loaded decode workers from etcd is Resyncing until each
// of them sent its full resync (issue 16: a session etcd did not get may be resident on one of
// them); prefill workers do not hold it open, and a leader with no decode worker to wait for
// never opens it.
func TestResyncWindow(t *testing.T) {
	f := newFixture(t, Config{})
	if f.st.Resyncing() {
		t.Fatal("a first leader with no workers is resyncing")
	}
	for _, id := range []string{"d0", "d1"} {
		if _, err := f.st.Attach(hello(id, kvcv1.WorkerRole_WORKER_ROLE_DECODE)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.st.Attach(hello("p0", kvcv1.WorkerRole_WORKER_ROLE_PREFILL)); err != nil {
		t.Fatal(err)
	}
	must(t, f.st.Flush(t.Context()))
	f.st.EndTerm(f.term)
	must(t, f.sess.Close())

	f2 := leadOn(t, f.store, Config{NodeID: "cp-2"})
	st := f2.st
	if !st.Resyncing() {
		t.Fatal("a new leader with decode workers to hear from is not resyncing")
	}
	d0, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	must(t, err)
	if !st.Resyncing() {
		t.Fatal("closed on attach, before the worker's resync")
	}
	must(t, st.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true}))
	p0, err := st.Attach(hello("p0", kvcv1.WorkerRole_WORKER_ROLE_PREFILL))
	must(t, err)
	must(t, st.Reconcile(p0, &kvcv1.ResidentSessions{FullSync: true}))
	if !st.Resyncing() {
		t.Fatal("closed while d1 has not reported")
	}
	d1, err := st.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	must(t, err)
	must(t, st.Reconcile(d1, &kvcv1.ResidentSessions{Sessions: []*kvcv1.ResidentSession{{SessionId: "x", KvCommittedLen: 4}}}))
	if !st.Resyncing() {
		t.Fatal("closed by a report that is not a full resync")
	}
	must(t, st.Reconcile(d1, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{{SessionId: "x", KvCommittedLen: 4}}}))
	if st.Resyncing() {
		t.Fatal("still resyncing after every decode worker reported")
	}
}

// The window is bounded by the unreachable grace: a decode worker that never comes back does
// not keep it open.
func TestResyncWindowBounded(t *testing.T) {
	f := newFixture(t, Config{})
	if _, err := f.st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE)); err != nil {
		t.Fatal(err)
	}
	must(t, f.st.Flush(t.Context()))
	f.st.EndTerm(f.term)
	must(t, f.sess.Close())
	f2 := leadOn(t, f.store, Config{NodeID: "cp-2"})
	if !f2.st.Resyncing() {
		t.Fatal("not resyncing")
	}
	f2.st.mu.Lock()
	f2.st.resyncUntil.Store(1) // the grace has passed
	f2.st.mu.Unlock()
	if f2.st.Resyncing() {
		t.Fatal("resyncing past the grace")
	}
}
