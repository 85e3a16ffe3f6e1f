package decode

import (
	"context"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func target(id, prefill string, gen uint64) *kvcv1.Command {
	return &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: id, PrefillWorkerId: prefill, PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: gen}}}
}

func sessionHints(id string, until int64, low bool) *kvcv1.Command {
	return &kvcv1.Command{Action: &kvcv1.Command_SetSessionHints{SetSessionHints: &kvcv1.SetSessionHintsCommand{
		SessionId: id, PinnedUntilUnixMs: until, LowPriority: low}}}
}

// TestRetargetKeepsPin: a drain re-targets a pinned session's snapshot to another prefill
// worker with a SetSnapshotTargetCommand that carries no hints; the pin still holds (the
// sidecar used to take the target's zero pin as the session's and release it for capacity).
func TestRetargetKeepsPin(t *testing.T) {
	s := newTestSidecar(t)
	ctx := context.Background()
	until := time.Now().Add(time.Hour).UnixMilli()
	pinned := target("s", "p0", 1)
	pinned.GetSetSnapshotTarget().PinnedUntilUnixMs, pinned.GetSetSnapshotTarget().LowPriority = until, true
	if err := s.Apply(ctx, pinned); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "s", CommittedLen: 8, Pages: []int64{0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := s.Apply(ctx, target("s", "p1", 1)); err != nil { // the drain's re-target
		t.Fatal(err)
	}
	s.mu.Lock()
	ss := s.sessions["s"]
	gotPin, gotLow, gotTarget := pinnedAt(ss, time.Now()), ss.hints.low, ss.target.GetPrefillWorkerId()
	s.mu.Unlock()
	if !gotPin || !gotLow || gotTarget != "p1" {
		t.Fatalf("after the re-target: pinned %v, low %v, target %q; want the pin and priority kept, target p1", gotPin, gotLow, gotTarget)
	}
}

// TestSessionHints: SetSessionHintsCommand sets a session's hints whether it came before the
// session's first commit or after, replaces them (an unpin too), and is refused on bad input;
// hints of a session released before its first commit do not reach a later session of that id.
func TestSessionHints(t *testing.T) {
	until := time.Now().Add(time.Hour).UnixMilli()
	tests := []struct {
		name     string
		before   []*kvcv1.Command // before the first commit
		after    []*kvcv1.Command // after it
		release  bool             // the session is released (and committed again) between the two
		wantPin  bool
		wantLow  bool
		wantFail bool
	}{
		{name: "before the first commit", before: []*kvcv1.Command{sessionHints("s", until, true)}, wantPin: true, wantLow: true},
		{name: "after the first commit", after: []*kvcv1.Command{sessionHints("s", until, false)}, wantPin: true},
		{name: "hints then a target", before: []*kvcv1.Command{sessionHints("s", until, false), target("s", "p0", 1)}, wantPin: true},
		{name: "unpinned by the next hints", before: []*kvcv1.Command{sessionHints("s", until, true)}, after: []*kvcv1.Command{sessionHints("s", 0, false)}},
		{name: "pending hints dropped by a release", before: []*kvcv1.Command{sessionHints("s", until, true)}, release: true},
		{name: "expired pin", after: []*kvcv1.Command{sessionHints("s", time.Now().Add(-time.Second).UnixMilli(), false)}},
		{name: "negative pin refused", after: []*kvcv1.Command{sessionHints("s", -1, false)}, wantFail: true},
		{name: "no session id refused", after: []*kvcv1.Command{sessionHints("", until, false)}, wantFail: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newTestSidecar(t)
			ctx := context.Background()
			for _, c := range tt.before {
				if err := s.Apply(ctx, c); err != nil {
					t.Fatal(err)
				}
			}
			if tt.release {
				if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "other", CommittedLen: 4, Pages: []int64{9}}); err != nil {
					t.Fatal(err)
				}
				s.drop("s") // the control plane's release of a session not committed here yet
			}
			if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "s", CommittedLen: 8, Pages: []int64{0, 1}}); err != nil {
				t.Fatal(err)
			}
			var err error
			for _, c := range tt.after {
				if err = s.Apply(ctx, c); err != nil {
					break
				}
			}
			if (err != nil) != tt.wantFail {
				t.Fatalf("apply: %v, want failure %v", err, tt.wantFail)
			}
			s.mu.Lock()
			ss := s.sessions["s"]
			pin, low := pinnedAt(ss, time.Now()), ss.hints.low
			s.mu.Unlock()
			if pin != tt.wantPin || low != tt.wantLow {
				t.Fatalf("pinned %v low %v, want %v %v", pin, low, tt.wantPin, tt.wantLow)
			}
		})
	}
}
