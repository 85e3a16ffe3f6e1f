package decode

import (
	"context"
	"reflect"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestReleaseOnDemandSmallestFirst: the idle sessions go first, largest first (fewest releases
// for the room); a deficit past them takes the sessions in conversation (committed less than
// MinIdle ago) smallest first, so that the largest session — whose reseed of its whole context
// is the longest — stays resident while smaller ones cover the deficit.
func TestReleaseOnDemandSmallestFirst(t *testing.T) {
	type sess struct {
		id   string
		kv   int64
		idle time.Duration
	}
	cases := []struct {
		name     string
		sessions []sess
		waiting  int64 // tokens the worker's prealloc queue waits for (136 free)
		release  []string
	}{
		{name: "deficit within the idle sessions: largest idle first",
			sessions: []sess{{"idle-small", 20, time.Minute}, {"idle-big", 60, time.Minute}, {"busy-big", 80, 0}},
			waiting:  136 + 50, release: []string{"idle-big"}},
		{name: "deficit past the idle sessions: the smallest in conversation",
			sessions: []sess{{"idle", 20, time.Minute}, {"busy-big", 80, 0}, {"busy-small", 24, 0}},
			waiting:  136 + 40, release: []string{"idle", "busy-small"}},
		{name: "two small ones before the large one",
			sessions: []sess{{"busy-big", 80, 0}, {"busy-a", 16, 0}, {"busy-b", 20, 0}},
			waiting:  136 + 30, release: []string{"busy-a", "busy-b"}},
		{name: "the large one when the small ones are not enough",
			sessions: []sess{{"busy-big", 80, 0}, {"busy-a", 16, 0}},
			waiting:  136 + 60, release: []string{"busy-a", "busy-big"}},
		{name: "a second of conversation more idle goes first, whatever its size",
			sessions: []sess{{"busy-big", 80, 1500 * time.Millisecond}, {"busy-small", 16, 0}},
			waiting:  136 + 10, release: []string{"busy-big"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t) // 64 pages of 4 tokens: 256 tokens
			s.rel = newReleaser(ReleaseConfig{High: 0.9, Low: 0.5, MinIdle: 2 * time.Second})
			ctx := context.Background()
			now := time.Now()
			next := int64(0)
			for _, x := range tc.sessions {
				if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
					SessionId: x.id, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
					t.Fatal(err)
				}
				pg := make([]int64, (x.kv+3)/4)
				for i := range pg {
					pg[i] = next
					next++
				}
				if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: x.id, CommittedLen: x.kv, Pages: pg}); err != nil {
					t.Fatal(err)
				}
				s.mu.Lock()
				ss := s.sessions[x.id]
				ss.lastCommit, ss.lastPushed, ss.queued = now.Add(-x.idle), x.kv, false
				s.queue = s.queue[:0]
				s.mu.Unlock()
			}
			if _, err := s.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: tc.waiting, FreeTokens: 136}); err != nil {
				t.Fatal(err)
			}
			s.mu.Lock()
			p := s.planReleaseLocked(now)
			s.mu.Unlock()
			if !reflect.DeepEqual(p.Release, tc.release) || len(p.Waiting) != 0 {
				t.Fatalf("plan %+v; want release %v", p, tc.release)
			}
		})
	}
}
