package decode

import (
	"context"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestReleaseCommandReachesWorker: the control plane's ReleaseSessionCommand (a stale copy
// found at a resync, a drain, a migration: issue 16 finding 1) is carried out on the worker —
// the sidecar sends it a WorkerReleaseCommand (reason CONTROL_PLANE) through WatchCommands, the
// worker's ReleaseSession that follows is accepted, and the session's KV is gone from both.
func TestReleaseCommandReachesWorker(t *testing.T) {
	s := newTestSidecar(t)
	rep := &recordingReporter{}
	s.SetReporter(rep)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveBridge(t, s)
	st, err := c.WatchCommands(ctx, &kvcv1.WatchCommandsRequest{WorkerInstance: "w"})
	if err != nil {
		t.Fatal(err)
	}
	first, err := st.Recv()
	if err != nil || first.GetAttach() == nil {
		t.Fatalf("attach %v %v", first, err)
	}
	if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: first.GetCommandId(), Ok: true}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"stale", "kept"} {
		if _, err := c.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: id, CommittedLen: 4, Pages: pages(1)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{
		SessionId: "stale", Reason: "stale copy"}}}); err != nil {
		t.Fatal(err)
	}
	m, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if m.GetRelease().GetSessionId() != "stale" || m.GetReason() != kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CONTROL_PLANE {
		t.Fatalf("worker command %v", m)
	}
	// The worker frees it: its ReleaseSession is accepted (the sidecar already dropped it).
	if _, err := c.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "stale", Reason: kvcv1.ReleaseReason_RELEASE_REASON_EVICTED}); err != nil {
		t.Fatalf("worker's release after the command: %v", err)
	}
	if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: m.GetCommandId(), Ok: true, FreedTokens: 4}); err != nil {
		t.Fatal(err)
	}
	si := s.Sessions()
	if len(si) != 1 || si[0].SessionID != "kept" {
		t.Fatalf("sessions after the release: %+v", si)
	}
	// The control plane asked for it: no EVICTED/RELEASED event goes back to it.
	if ev := rep.kinds(kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED); ev["stale"] != nil {
		t.Fatalf("eviction reported: %v", ev)
	}
}
