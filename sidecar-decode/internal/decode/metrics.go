package decode

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Collectors are the sidecar's snapshot-staleness gauges, read at scrape time:
// kvc_snapshot_unpushed_tokens (committed tokens of sessions with a snapshot target not yet in
// their prefill store, summed) and kvc_snapshot_stale_seconds (the longest time a session with
// such a tail has had no commit: with the idle flush on, a healthy sidecar keeps it near
// --snapshot-idle-flush plus a push; growing, pushes fail or stall and a reseed would need a
// recompute).
func (s *Sidecar) Collectors() []prometheus.Collector {
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvc_snapshot_unpushed_tokens",
			Help: "Committed tokens of sessions with a snapshot target that are not in their prefill snapshot yet, summed over sessions.",
		}, func() float64 { t, _ := s.staleness(time.Now()); return float64(t) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvc_snapshot_stale_seconds",
			Help: "Longest time since the last commit of a session whose snapshot lacks committed tokens (0: every snapshot current).",
		}, func() float64 { _, d := s.staleness(time.Now()); return d.Seconds() }),
	}
}

// staleness sums the unpushed tails and finds the oldest last commit among them.
func (s *Sidecar) staleness(now time.Time) (tokens int64, oldest time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, ss := range s.sessions {
		if ss.gone || ss.target == nil || ss.committed <= ss.lastPushed {
			continue
		}
		tokens += ss.committed - ss.lastPushed
		if !ss.lastCommit.IsZero() {
			oldest = max(oldest, now.Sub(ss.lastCommit))
		}
	}
	return tokens, oldest
}
