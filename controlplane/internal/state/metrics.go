package state

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	workers  *prometheus.GaugeVec   // by state
	commands *prometheus.CounterVec // by result: sent, acked, failed, queue_full, no_stream
	// commands' children by result, looked up once (a command's send and its ack count without
	// a label lookup each).
	cmdSent, cmdAcked, cmdFailed, cmdQueueFull, cmdNoStream prometheus.Counter
	events                                                  *prometheus.CounterVec // session events by kind
	transfers                                               *prometheus.CounterVec // TRANSFER_DONE / TRANSFER_FAILED
	expired                                                 prometheus.Counter
	dropped                                                 prometheus.Counter // residencies dropped after the unreachable grace
	workerDown                                              prometheus.Counter // sidecars' reports of their worker process down
	loadSeconds                                             prometheus.Gauge
	writeFailures                                           prometheus.Counter
	// sessions' volatile states written to the volatile journal
	volatileFlushed prometheus.Counter
	journalWritten  prometheus.Counter
	journalDeleted  prometheus.Counter
	journalKeys     prometheus.Gauge
	journalBytes    prometheus.Gauge
	drains          *prometheus.CounterVec // drains by event: started, finished, cancelled
	drainMoves      *prometheus.CounterVec // sessions moved off draining workers: with_snapshot, without_snapshot, failed
	forgotten       prometheus.Counter
	staleCopies     prometheus.Counter     // stale copies a decode resync reported, released there
	tpProblems      prometheus.Gauge       // listed workers with a tensor-parallel problem (tp.go)
	claimsRefused   *prometheus.CounterVec // sidecar reports refused for a generation never issued (claims.go)
	termRefused     *prometheus.CounterVec // terms not led on a broken generation term (leader.go)
	generationTerm  prometheus.Gauge
	policyCorrupt   *prometheus.CounterVec // a stored policy that did not decode, by what was done
	commitsAway     *prometheus.CounterVec // commits of a worker the record did not name yet, by fate (commits.go)
}

func newMetrics(reg prometheus.Registerer, sessions func() float64) *metrics {
	m := &metrics{
		workers: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvc_cp_workers", Help: "Workers by role (prefill, decode) and state (leader only).",
		}, []string{"role", "state"}),
		commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_commands_total", Help: "Commands to sidecars by result (sent, acked, failed, queue_full, no_stream).",
		}, []string{"result"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_session_events_total", Help: "Session events from sidecars by kind.",
		}, []string{"kind"}),
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_transfers_reported_total", Help: "Transfers reported by sidecars by result.",
		}, []string{"result"}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_sessions_expired_total", Help: "Idle sessions expired after the session TTL.",
		}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_residency_dropped_total", Help: "Session residencies or snapshots dropped because their worker stayed unreachable past the grace period.",
		}),
		workerDown: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_worker_down_total", Help: "Times a connected sidecar reported its worker process down (the worker left routing; a decode worker's sessions were dropped).",
		}),
		loadSeconds: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_leader_load_seconds", Help: "Time the last new leader took to load etcd before serving.",
		}),
		writeFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_persist_enqueue_failures_total", Help: "Writes that could not be queued for etcd (deposed or closed batcher).",
		}),
		volatileFlushed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_sessions_volatile_flushed_total", Help: "Sessions' volatile-only changes (turn, last_seen, kv_committed_len, d_rejects) written to the volatile journal (entries carried forward by compaction included).",
		}),
		journalWritten: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_volatile_journal_keys_written_total", Help: "Volatile journal keys written (each holds up to 1024 sessions' volatile fields).",
		}),
		journalDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_volatile_journal_keys_deleted_total", Help: "Volatile journal keys deleted once none of their entries was live.",
		}),
		journalKeys: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_volatile_journal_keys", Help: "Volatile journal keys in etcd (leader only).",
		}),
		journalBytes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_volatile_journal_bytes", Help: "Value bytes of the volatile journal keys in etcd (leader only).",
		}),
		drains: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_drains_total", Help: "Worker drains by event (started, finished, cancelled).",
		}, []string{"event"}),
		drainMoves: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_drain_moves_total", Help: "Sessions released off draining workers by result (with_snapshot, without_snapshot, failed: release not queued, retried).",
		}, []string{"result"}),
		forgotten: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_workers_forgotten_total", Help: "Workers removed by AdminService.ForgetWorker.",
		}),
		tpProblems: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_tp_problem_workers", Help: "Workers (ranks and groups) listed with a tensor-parallel problem: a group missing a rank or its rank 0, a rank held twice, a worker no worker of the other role has the same tp_size as (leader only).",
		}),
		staleCopies: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_stale_copies_released_total", Help: "Sessions a decode sidecar's resync reported that the record says moved on (a newer generation elsewhere): the record stood and the copy was released on that worker.",
		}),
		claimsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_generation_claims_refused_total", Help: "Sidecar reports refused (nothing applied, the stream ended) for a KV generation the control plane never issued: above_issued (above the highest generation issued), not_given (a generation of this term on a session the worker was never given).",
		}, []string{"reason"}),
		termRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_generation_term_refused_total", Help: "Terms this replica refused to lead on a broken generation term: exhausted (the durable term or a loaded generation is at the last term whose generations stay below 2^53), unreadable (the stored term is not a number).",
		}, []string{"reason"}),
		generationTerm: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_generation_term", Help: "The generation term this leader numbers KV generations in (0 when not leading).",
		}),
	}
	m.commitsAway = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvc_cp_commits_before_residency_total",
		Help: "Decode commits of sessions the record did not name that worker for yet (a seed's, ahead of its outcome), by fate: kept, taken (the outcome made the worker the session's: its committed length), superseded (the named worker's commit or another residency came first), evicted (the table was full).",
	}, []string{"fate"})
	for _, f := range []string{"kept", "taken", "superseded", "evicted"} {
		m.commitsAway.WithLabelValues(f)
	}
	m.policyCorrupt = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvc_cp_policy_corrupt_total", Help: "Stored policy records that did not decode, by what was done: kept_last_good (the policy in use stays), refused_to_lead (no earlier version known: this replica did not lead).",
	}, []string{"action"})
	for _, r := range []string{"kept_last_good", "refused_to_lead"} {
		m.policyCorrupt.WithLabelValues(r)
	}
	for _, r := range []string{claimAboveIssued, claimNotGiven} {
		m.claimsRefused.WithLabelValues(r)
	}
	for _, r := range []string{"exhausted", "unreadable"} {
		m.termRefused.WithLabelValues(r)
	}
	for _, role := range []string{"prefill", "decode"} {
		for _, s := range []string{"ready", "draining", "unreachable", "worker_down"} {
			m.workers.WithLabelValues(role, s)
		}
	}
	for _, r := range []string{"done", "failed"} {
		m.transfers.WithLabelValues(r) // the alert rules' ratio has both from the start
	}
	for r, c := range map[string]*prometheus.Counter{"sent": &m.cmdSent, "acked": &m.cmdAcked, "failed": &m.cmdFailed,
		"queue_full": &m.cmdQueueFull, "no_stream": &m.cmdNoStream} {
		*c = m.commands.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(m.workers, m.commands, m.events, m.transfers, m.expired, m.dropped, m.workerDown, m.loadSeconds, m.writeFailures, m.volatileFlushed,
			m.journalWritten, m.journalDeleted, m.journalKeys, m.journalBytes, m.drains, m.drainMoves, m.forgotten, m.staleCopies, m.tpProblems,
			m.claimsRefused, m.termRefused, m.generationTerm, m.policyCorrupt, m.commitsAway,
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "kvc_cp_sessions", Help: "Session records held in memory (leader only).",
			}, sessions))
	}
	return m
}
