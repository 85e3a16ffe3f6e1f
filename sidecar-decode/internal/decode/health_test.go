package decode

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type recordingReporter struct {
	mu  sync.Mutex
	evs []*kvcv1.SessionEvent
}

func (r *recordingReporter) Report(ev *kvcv1.SessionEvent) {
	r.mu.Lock()
	r.evs = append(r.evs, ev)
	r.mu.Unlock()
}

func (r *recordingReporter) kinds(kind kvcv1.SessionEventKind) map[string]*kvcv1.SessionEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]*kvcv1.SessionEvent{}
	for _, ev := range r.evs {
		if ev.GetKind() == kind {
			out[ev.GetSessionId()] = ev
		}
	}
	return out
}

func TestWorkerDownDropsEverySession(t *testing.T) {
	s := newTestSidecar(t)
	rep := &recordingReporter{}
	s.SetReporter(rep)
	ctx := context.Background()
	for _, c := range []struct {
		id string
		n  int64
	}{{"a", 8}, {"b", 13}} {
		if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: c.id, CommittedLen: c.n, Pages: pages(int((c.n + 3) / 4))}); err != nil {
			t.Fatal(err)
		}
	}
	// A target named for a session not committed yet, and a room waiting for its transfer.
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "c", PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	room := &recvRoom{req: &kvcv1.PrepareReceiveRequest{Room: 7, SessionId: "e"}, created: time.Now(), done: make(chan struct{})}
	s.mu.Lock()
	s.rooms[7] = room
	s.mu.Unlock()

	s.WorkerHealth(true, "bridge closed")

	if got := s.Resync().GetSessions(); len(got) != 0 {
		t.Fatalf("resync after the worker died lists %v", got)
	}
	if l := s.Load(); l.GetResidentSessions() != 0 || l.GetUsedTokens() != 0 || l.GetTransferQueueDepth() != 0 {
		t.Fatalf("load after the worker died: %v", l)
	}
	ev := rep.kinds(kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED)
	if len(ev) != 2 || ev["a"].GetKvLen() != 8 || ev["b"].GetKvLen() != 13 || !strings.Contains(ev["a"].GetDetail(), "worker down: bridge closed") {
		t.Fatalf("evicted events %v", ev)
	}
	select {
	case <-room.done:
		if room.res.GetOk() || !strings.Contains(room.res.GetError(), "worker down") {
			t.Fatalf("room result %v", room.res)
		}
	default:
		t.Fatal("the waiting room was not failed")
	}
	s.mu.Lock()
	_, pending := s.targets["c"]
	s.mu.Unlock()
	if pending {
		t.Fatal("a pending target survived the worker")
	}
	// A worker that was only slow may still release what it held: OK, not NOT_FOUND.
	if _, err := s.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "a"}); err != nil {
		t.Fatalf("release of a dropped session: %v", err)
	}
	// Up again: nothing to do; new commits are tracked as before.
	s.WorkerHealth(false, "worker registered its KV pool")
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 4, Pages: pages(1)}); err != nil {
		t.Fatal(err)
	}
	if got := s.Resync().GetSessions(); len(got) != 1 || got[0].GetSessionId() != "a" {
		t.Fatalf("resync after recovery %v", got)
	}
}
