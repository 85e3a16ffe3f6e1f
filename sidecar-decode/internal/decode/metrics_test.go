package decode

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestStalenessGauges: only sessions with a snapshot target and committed tokens beyond the last
// push count; the staleness is the oldest last commit among them; the gauges read it at scrape.
func TestStalenessGauges(t *testing.T) {
	s := newTestSidecar(t)
	now := time.Now()
	target := &kvcv1.SetSnapshotTargetCommand{SessionId: "x", PrefillWorkerId: "p", Generation: 1}
	s.mu.Lock()
	for _, ss := range []*session{
		{id: "behind", target: target, committed: 100, lastPushed: 40, lastCommit: now.Add(-30 * time.Second)},
		{id: "behind-recent", target: target, committed: 20, lastPushed: 10, lastCommit: now.Add(-time.Second)},
		{id: "current", target: target, committed: 50, lastPushed: 50, lastCommit: now.Add(-time.Hour)},
		{id: "no-target", committed: 500, lastCommit: now.Add(-time.Hour)},
		{id: "gone", target: target, committed: 500, gone: true, lastCommit: now.Add(-time.Hour)},
	} {
		s.sessions[ss.id] = ss
	}
	s.mu.Unlock()
	tokens, oldest := s.staleness(now)
	if tokens != 70 || oldest != 30*time.Second {
		t.Fatalf("unpushed %d tokens, oldest %v; want 70 and 30s", tokens, oldest)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.Collectors()...)
	if got := testutil.ToFloat64(s.Collectors()[0]); got != 70 {
		t.Fatalf("kvc_snapshot_unpushed_tokens %v", got)
	}
	if got := testutil.ToFloat64(s.Collectors()[1]); got < 30 || got > 3600 {
		t.Fatalf("kvc_snapshot_stale_seconds %v, want about 30", got)
	}
	if n, err := testutil.GatherAndCount(reg, "kvc_snapshot_unpushed_tokens", "kvc_snapshot_stale_seconds"); err != nil || n != 2 {
		t.Fatalf("gathered %d (%v)", n, err)
	}
	s.mu.Lock()
	s.sessions["behind"].lastPushed, s.sessions["behind-recent"].lastPushed = 100, 20
	s.mu.Unlock()
	if tokens, oldest := s.staleness(now); tokens != 0 || oldest != 0 {
		t.Fatalf("all current: %d tokens, %v", tokens, oldest)
	}
}
