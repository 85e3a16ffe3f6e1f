package state

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type landedRec struct{ got []string }

func (h *landedRec) TransferLanded(worker string, ev *kvcv1.SessionEvent) {
	h.got = append(h.got, worker+"/"+ev.GetSessionId())
}

// TestTransferDoneReachesTheHook: a decode sidecar's TRANSFER_DONE is handed to the transfer
// hook with the reporting worker (the router ends the transfer's slot: router/landed.go);
// TRANSFER_FAILED, a prefill worker's, a rank's of a tensor-parallel group and a closed
// stream's are not.
func TestTransferDoneReachesTheHook(t *testing.T) {
	f := newFixture(t, Config{})
	st := f.st
	h := &landedRec{}
	st.SetTransferHook(h)
	d0, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	must(t, err)
	p0, err := st.Attach(hello("p0", kvcv1.WorkerRole_WORKER_ROLE_PREFILL))
	must(t, err)
	a0, err := st.Attach(tpHello("a0", decodeRole, "A", 0, 2))
	must(t, err)
	old, err := st.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	must(t, err)
	st.Detach(old)
	if _, err := st.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE)); err != nil { // a new stream
		t.Fatal(err)
	}
	ev := func(kind kvcv1.SessionEventKind) *kvcv1.SessionEvent {
		return &kvcv1.SessionEvent{SessionId: "s", Kind: kind, Room: 7, KvLen: 640, Detail: "seed"}
	}
	done, failed := kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_DONE, kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_FAILED
	for _, c := range []struct {
		st   *Stream
		kind kvcv1.SessionEventKind
	}{{d0, failed}, {p0, done}, {a0, done}, {old, done}, {d0, done}} {
		_ = st.ApplyEvent(c.st, ev(c.kind))
	}
	if len(h.got) != 1 || h.got[0] != "d0/s" {
		t.Fatalf("hook got %v, want [d0/s]", h.got)
	}
	st.SetTransferHook(nil)
	must(t, st.ApplyEvent(d0, ev(done)))
	if len(h.got) != 1 {
		t.Fatalf("hook cleared, still got %v", h.got)
	}
}
