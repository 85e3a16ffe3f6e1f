package decode

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestDrainFlush: DrainCommand{draining: true} queues, forced, the push of every session's
// unpushed tail below delta_tokens (the drain mover waits for those snapshots); a session
// without a target, with nothing unpushed or already queued gets no second push; undrain
// queues nothing. Before, the command was acknowledged and ignored.
func TestDrainFlush(t *testing.T) {
	ctx := context.Background()
	s := newTestSidecar(t) // delta 8 tokens, page size 4; Run is not started: queued pushes stay queued
	var evlog syncBuffer
	s.ev = sidecar.NewEventLog(&evlog, "d", nil)
	apply := func(cmd *kvcv1.Command) {
		t.Helper()
		if err := s.Apply(ctx, cmd); err != nil {
			t.Fatal(err)
		}
	}
	target := func(sess string) {
		apply(&kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: sess, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}})
	}
	commit := func(sess string, n int64) bool {
		t.Helper()
		res, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: sess, CommittedLen: n, Pages: pages(int((n + 3) / 4))})
		if err != nil {
			t.Fatal(err)
		}
		return res.GetPushEnqueued()
	}
	queued := func() map[string]bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		out := map[string]bool{}
		for _, id := range s.queue {
			out[id] = s.sessions[id].forcePush || s.sessions[id].committed-s.sessions[id].lastPushed >= s.delta
		}
		return out
	}
	drain := func(on bool) {
		apply(&kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{Draining: on}}})
	}

	target("below") // a 5-token tail: below delta, nothing queued on its own
	if commit("below", 5) {
		t.Fatal("a 5-token tail queued below delta")
	}
	target("full") // delta reached: queued already
	if !commit("full", 8) {
		t.Fatal("delta push not queued")
	}
	commit("untargeted", 5) // no snapshot target: nowhere to push
	target("pushed")        // its push landed: nothing unpushed
	commit("pushed", 8)
	s.mu.Lock() // what pushSession does when the queued push lands
	ss := s.sessions["pushed"]
	ss.lastPushed, ss.queued = ss.committed, false
	s.queue = slices.DeleteFunc(s.queue, func(id string) bool { return id == "pushed" })
	s.mu.Unlock()

	drain(false) // undrain: nothing
	if q := queued(); len(q) != 1 || !q["full"] {
		t.Fatalf("undrain queued %v, want only the delta push of full", q)
	}
	drain(true)
	q := queued()
	if len(q) != 2 || !q["full"] || !q["below"] {
		t.Fatalf("after the drain the queue holds %v, want full and below (forced)", q)
	}
	if got := strings.Count(evlog.String(), `"event":"snapshot_drain_flush"`); got != 1 {
		t.Fatalf("%d snapshot_drain_flush events, want 1 (below; full was queued already): %s", got, evlog.String())
	}
	drain(true) // again: everything is queued already
	if q := queued(); len(q) != 2 {
		t.Fatalf("a second drain queued %v", q)
	}
}
