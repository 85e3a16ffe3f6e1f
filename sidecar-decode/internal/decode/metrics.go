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
// recompute). With them, the worker's last reported prealloc-queue demand (ReportDemand) and
// the release passes it caused.
func (s *Sidecar) Collectors() []prometheus.Collector {
	g := func(name, help string, f func(DemandStats) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return f(s.Demand()) })
	}
	c := func(name, help string, f func(DemandStats) float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return f(s.Demand()) })
	}
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvc_snapshot_unpushed_tokens",
			Help: "Committed tokens of sessions with a snapshot target that are not in their prefill snapshot yet, summed over sessions.",
		}, func() float64 { t, _ := s.staleness(time.Now()); return float64(t) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "kvc_snapshot_stale_seconds",
			Help: "Longest time since the last commit of a session whose snapshot lacks committed tokens (0: every snapshot current).",
		}, func() float64 { _, d := s.staleness(time.Now()); return d.Seconds() }),
		g("kvc_sidecar_prealloc_waiting_requests", "Requests waiting in the worker's prealloc queue for pages, as last reported (ReportDemand).",
			func(d DemandStats) float64 { return float64(d.WaitingRequests) }),
		g("kvc_sidecar_worker_running_requests", "Requests the worker is serving that hold their pages (pre-allocated, receiving, prefilling or decoding), as last reported (ReportDemand); forwarded to the control plane in the load report (running_requests).",
			func(d DemandStats) float64 { return float64(d.RunningRequests) }),
		g("kvc_sidecar_prealloc_waiting_tokens", "Tokens the requests waiting in the worker's prealloc queue need, as last reported.",
			func(d DemandStats) float64 { return float64(d.WaitingTokens) }),
		g("kvc_sidecar_prealloc_free_tokens", "Tokens the worker's pool had free with its last demand report.",
			func(d DemandStats) float64 { return float64(d.FreeTokens) }),
		c("kvc_sidecar_demand_reports_total", "Demand reports (ReportDemand) received from the worker.",
			func(d DemandStats) float64 { return float64(d.Reports) }),
		c("kvc_sidecar_demand_release_passes_total", "Capacity release passes that released or waited for sessions because waiting requests needed more than the free room.",
			func(d DemandStats) float64 { return float64(d.DeficitReleasePasses) }),
		c("kvc_sidecar_release_spared_total", "Capacity releases a pass planned and did not send: the session was committed or loaded after the plan, or less than --release-min-idle ago, by the time its turn came (the releases before it wait for the worker's acks).",
			func(d DemandStats) float64 { return float64(d.SparedReleases) }),
		c("kvc_sidecar_release_on_demand_total", "Capacity releases, for requests waiting for pages, of sessions committed less than --release-min-idle ago (each such session's next turn reseeds from its snapshot).",
			func(d DemandStats) float64 { return float64(d.OnDemandReleases) }),
		c("kvc_sidecar_release_refused_total", "Capacity releases the worker refused: the session was in use (a running request, or a turn waiting for pages while another session was idle).",
			func(d DemandStats) float64 { return float64(d.RefusedReleases) }),
		g("kvc_sidecar_demand_reported", "1 while the demand gauges hold a report the worker sent since it last came up; 0 before its first report and from the worker's down until it reports again (the gauges then read 0: a dead worker's demand is forgotten).",
			func(d DemandStats) float64 { return b2f(d.Reported) }),
		c("kvc_sidecar_demand_forgotten_total", "Demand reports dropped because the worker went down with them current (its waiting and running requests and unevictable KV died with it).",
			func(d DemandStats) float64 { return float64(d.ForgottenReports) }),
		c("kvc_sidecar_demand_reports_discarded_total", "Demand reports not recorded because their caller was gone by the time they were handled (timed out, or its bridge connection closed: the worker died).",
			func(d DemandStats) float64 { return float64(d.DiscardedReports) }),
		g("kvc_sidecar_worker_unevictable_tokens", "The worker's unevictable KV as it last reported it (ReportDemand): committed tokens of the sessions its requests are using; forwarded to the control plane in the load report.",
			func(d DemandStats) float64 { return float64(d.UnevictableTokens) }),
		s.loadIDs,
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

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
