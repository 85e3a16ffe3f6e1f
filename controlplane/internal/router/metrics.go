package router

import (
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	decisions      *prometheus.CounterVec
	decisionByKey  counters2 // by mode, reason (every pair, made up front)
	latency        prometheus.Histogram
	outcomes       *prometheus.CounterVec
	outcomeByKey   counters2 // by mode, error kind (every pair, made up front)
	ttft           *prometheus.HistogramVec
	ttftByMode     []prometheus.Observer // by mode
	errors         *prometheus.CounterVec
	expired        prometheus.Counter
	lateOutcomes   prometheus.Counter
	streamEnd      *prometheus.CounterVec
	migrations     prometheus.Counter
	truncations    prometheus.Counter
	pins           *prometheus.CounterVec
	contentGauge   prometheus.GaugeFunc
	contentLoaded  prometheus.Counter
	admitted       *prometheus.CounterVec
	rejected       *prometheus.CounterVec
	commands       *prometheus.CounterVec
	cmdByKind      map[string]*[2]prometheus.Counter // commands' children by kind: ok, error (made up front; read only)
	reservations   prometheus.GaugeFunc
	reservedTokens prometheus.GaugeFunc
	// Prefill from the snapshot (policy/fromsnap.go): plans that load a prefix from P's store,
	// the tokens they load, and large appends whose D receives only the suffix.
	fromSnapshot       *prometheus.CounterVec
	fromSnapshotByKey  lazyCounters2 // by mode, reason (a child made on its first count)
	fromSnapshotTokens prometheus.Counter
	loadSkippedBusy    prometheus.Counter
	suffixReceives     prometheus.Counter
	// Large appends the session's own idle decode worker prefills itself (LOCAL_LARGE_APPEND):
	// the append tokens computed on D instead of on P.
	localAppendTokens prometheus.Counter
	queued            *prometheus.CounterVec
	queuedByKey       counters2 // by mode, policy.Admission
	keptFallbacks     prometheus.Counter
	wastedKV          prometheus.Counter
	// The new-session bound (policy/newsession.go): queries refused, new sessions' tokens held.
	newRefused    prometheus.Counter
	newReserved   prometheus.GaugeFunc
	rehomes       *prometheus.CounterVec // rehome.go
	rehomeSeconds prometheus.Histogram
	rehomeWaits   prometheus.Counter
	rehomeNoRoom  prometheus.Counter
	landed        *prometheus.CounterVec // landed.go

	admittedMu  sync.RWMutex
	admittedFor map[string]prometheus.Counter
}

// admit counts a session decision placed on worker (counters cached per worker).
func (m *metrics) admit(worker string) { m.admittedOn(worker).Inc() }

// admittedOn is worker's admitted counter.
func (m *metrics) admittedOn(worker string) prometheus.Counter {
	m.admittedMu.RLock()
	c, ok := m.admittedFor[worker]
	m.admittedMu.RUnlock()
	if !ok {
		c = m.admitted.WithLabelValues(worker)
		m.admittedMu.Lock()
		m.admittedFor[worker] = c
		m.admittedMu.Unlock()
	}
	return c
}

// ModeName is the short label of a mode (DIRECT_TO_D, SEED, ...).
func ModeName(m kvcv1.RouteMode) string {
	return strings.TrimPrefix(m.String(), "ROUTE_MODE_")
}

// ReasonName is the short label of a reason (SESSION_RESIDENT, ...).
func ReasonName(r kvcv1.RouteReason) string {
	return strings.TrimPrefix(r.String(), "ROUTE_REASON_")
}

func errorKindName(k kvcv1.RouteErrorKind) string {
	return strings.TrimPrefix(k.String(), "ROUTE_ERROR_KIND_")
}

func newMetrics(reg prometheus.Registerer, s *Service) *metrics {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_decisions_total", Help: "Routing decisions by mode and reason.",
		}, []string{"mode", "reason"}),
		admittedFor: make(map[string]prometheus.Counter),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvc_router_decision_seconds", Help: "Time to answer one query (validation, policy, reservation, effects).",
			Buckets: prometheus.ExponentialBuckets(1e-6, 2, 16),
		}),
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_outcomes_total", Help: "Outcomes reported by gateways, by decided mode and error kind.",
		}, []string{"mode", "error_kind"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvc_router_ttft_seconds", Help: "Time to first token of successful requests, by mode.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}, []string{"mode"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_errors_total", Help: "RouteError answers by gRPC code.",
		}, []string{"code"}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_router_reservations_expired_total", Help: "Reservations released by timeout (no outcome).",
		}),
		lateOutcomes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_router_late_outcomes_total", Help: "Outcomes applied after their reservation expired (the turn waited longer than the reservation timeout, e.g. in a prealloc queue).",
		}),
		streamEnd: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_reservations_stream_end_total", Help: "Reservations whose Route stream ended before their outcome, by how: closed (the client closed the stream: released at once), broken (the stream failed: released after the stream-end grace unless an outcome arrives on another stream).",
		}, []string{"how"}),
		migrations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_router_migrations_total", Help: "Sessions moved to another decode worker (successful outcome).",
		}),
		pins: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_pins_total", Help: "Agent pins asked for (RouteQuery.pin_ms) on turns that left the session resident, by result: granted, clamped (to max_pin_ms), refused_share (max_pinned_share of the decode worker's capacity), refused_disabled (max_pin_ms 0), refused_capacity.",
		}, []string{"result"}),
		truncations: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_router_session_truncations_total", Help: "Successful turns whose decode worker rewrote the session from a token on (truncate_to, or its own check of the partial last page): a new KV generation.",
		}),
		admitted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_worker_admitted_total", Help: "Session decisions (direct, seed, reseed) placed on a decode worker.",
		}, []string{"worker"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_worker_rejected_total", Help: "Rejections of a session by a decode worker: source=d (REJECTED_BY_D outcome), not_resident (SESSION_NOT_RESIDENT outcome: D had evicted it) or local (no capacity after reservations).",
		}, []string{"worker", "source"}),
		commands: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_router_commands_total", Help: "Commands sent to sidecars, by kind and result.",
		}, []string{"kind", "result"}),
	}
	m.fromSnapshot = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvc_router_prefill_from_snapshot_total",
		Help: "Decisions whose prefill worker first loads the session's snapshot prefix from its store and prefills only the rest, by mode and reason.",
	}, []string{"mode", "reason"})
	m.fromSnapshotTokens = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_prefill_from_snapshot_tokens_total",
		Help: "Prompt tokens those decisions load from the prefill store instead of prefilling them.",
	})
	m.loadSkippedBusy = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_prefill_load_skipped_busy_total",
		Help: "Decisions in which P's store held a usable prefix of the prompt but its holder's extra queue cost more than the load would spare: the whole context was prefilled on a less loaded prefill worker.",
	})
	m.suffixReceives = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_suffix_receives_total",
		Help: "Large appends whose decode worker keeps the KV it holds and receives only the pages past it (execution.receive_from).",
	})
	m.localAppendTokens = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_local_large_append_tokens_total",
		Help: "Uncached append tokens of large appends (over direct_max_uncached_tokens) that the session's own idle decode worker prefills itself (DIRECT_TO_D / LOCAL_LARGE_APPEND) instead of a prefill worker; the decisions are kvc_router_decisions_total{reason=\"LOCAL_LARGE_APPEND\"}.",
	})
	m.queued = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvc_router_queued_admissions_total",
		Help: "Decisions sent to a decode worker that cannot admit them now by the control plane's count, to wait in its prealloc queue instead of a downgrade to PD_FALLBACK, by mode and why: capacity (the capacity rule), transfer_budget (a reseed from the store with every store-transfer slot of the D taken), rejecter (a reseed onto a D that rejected the session since its last success).",
	}, []string{"mode", "why"})
	nModes := enumLen(kvcv1.RouteMode_name)
	m.queuedByKey = newCounters2(nModes, int(policy.AdmitRejecter)+1)
	for mv := range kvcv1.RouteMode_name {
		for _, a := range []policy.Admission{policy.AdmitOverCapacity, policy.AdmitOverBudget, policy.AdmitRejecter} {
			m.queuedByKey.set(mv, int32(a), m.queued.WithLabelValues(ModeName(kvcv1.RouteMode(mv)), a.String()))
		}
	}
	m.keptFallbacks = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_fallback_residency_total",
		Help: "PD_FALLBACK decisions of a KV-centric session (a seed refused for capacity, transfer budget or seed_max_inflight_decode) that record the session as resident on their decode worker, so its next turn goes direct.",
	})
	m.wastedKV = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_wasted_kv_fallbacks_total",
		Help: "Plain PD_FALLBACK decisions (nothing kept) of a session that had a usable snapshot or a resident copy on a serving decode worker: KV the cluster held and re-prefilled. Target 0.",
	})
	m.reservations = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvc_router_reservations", Help: "Reservations held (decisions awaiting an outcome).",
	}, func() float64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		return float64(s.led.pending.len())
	})
	m.reservedTokens = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvc_router_reserved_tokens", Help: "KV tokens reserved on decode workers, all workers together.",
	}, func() float64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		return float64(s.led.heldTokens)
	})
	m.newRefused = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_new_session_refusals_total",
		Help: "Queries of new sessions refused (RESOURCE_EXHAUSTED, NO_D_CAPACITY; the gateway answers 503 no_d_capacity) because no routable decode worker had free room for them and every one's new-session reservations were at --new-session-share of its capacity.",
	})
	m.newReserved = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvc_router_new_session_reserved_tokens", Help: "KV tokens reserved on decode workers by decisions opening new sessions (seeds, first turns prefilled on D, kept fallbacks) awaiting their outcome, all workers together (the part of kvc_router_reserved_tokens that --new-session-share bounds per worker).",
	}, func() float64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		n := int64(0)
		for _, w := range s.led.workers {
			n += w.res.NewSession
		}
		return float64(n)
	})
	m.contentGauge = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvc_router_content_sessions", Help: "Sessions whose KV content (page hash chain) the leader knows.",
	}, func() float64 { return float64(s.content.len()) })
	m.contentLoaded = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_content_loaded_total",
		Help: "Sessions' page chains this leader loaded from their records (content_chain) on their first decision.",
	})
	m.cmdByKind = make(map[string]*[2]prometheus.Counter)
	for _, kind := range []string{"push_snapshot", "release_session", "set_snapshot_target", "set_session_hints", "load_session"} {
		m.cmdByKind[kind] = &[2]prometheus.Counter{m.commands.WithLabelValues(kind, "ok"), m.commands.WithLabelValues(kind, "error")}
	}
	m.fromSnapshotByKey = newLazyCounters2(m.fromSnapshot, nModes, enumLen(kvcv1.RouteReason_name))
	m.decisionByKey = newCounters2(nModes, enumLen(kvcv1.RouteReason_name))
	m.outcomeByKey = newCounters2(nModes, enumLen(kvcv1.RouteErrorKind_name))
	m.ttftByMode = make([]prometheus.Observer, nModes)
	for mv := range kvcv1.RouteMode_name {
		for rv := range kvcv1.RouteReason_name {
			m.decisionByKey.set(mv, rv, m.decisions.WithLabelValues(ModeName(kvcv1.RouteMode(mv)), ReasonName(kvcv1.RouteReason(rv))))
		}
		for kv := range kvcv1.RouteErrorKind_name {
			m.outcomeByKey.set(mv, kv, m.outcomes.WithLabelValues(ModeName(kvcv1.RouteMode(mv)), errorKindName(kvcv1.RouteErrorKind(kv))))
		}
		m.ttftByMode[mv] = m.ttft.WithLabelValues(ModeName(kvcv1.RouteMode(mv)))
	}
	rehome := newRehomeMetrics(m)
	m.landed = newLandedMetric()
	if reg != nil {
		reg.MustRegister(rehome...)
		reg.MustRegister(m.landed)
		reg.MustRegister(m.decisions, m.latency, m.outcomes, m.ttft, m.errors, m.expired, m.lateOutcomes, m.migrations,
			m.admitted, m.rejected, m.commands, m.reservations, m.streamEnd, m.reservedTokens, m.truncations, m.contentGauge, m.contentLoaded, m.pins,
			m.fromSnapshot, m.fromSnapshotTokens, m.loadSkippedBusy, m.suffixReceives, m.localAppendTokens,
			m.queued, m.keptFallbacks, m.wastedKV, m.newRefused, m.newReserved)
	}
	return m
}

// outcome counts an outcome of a decision of mode with error kind (NONE on success).
func (m *metrics) outcome(mode kvcv1.RouteMode, kind kvcv1.RouteErrorKind) {
	if c := m.outcomeByKey.get(int32(mode), int32(kind)); c != nil {
		c.Inc()
		return
	}
	m.outcomes.WithLabelValues(ModeName(mode), errorKindName(kind)).Inc() // an unknown value
}

// observeTTFT records a successful request's time to first token, by executed mode.
func (m *metrics) observeTTFT(mode kvcv1.RouteMode, seconds float64) {
	if mode >= 0 && int(mode) < len(m.ttftByMode) && m.ttftByMode[mode] != nil {
		m.ttftByMode[mode].Observe(seconds)
		return
	}
	m.ttft.WithLabelValues(ModeName(mode)).Observe(seconds)
}

func (m *metrics) decision(mode kvcv1.RouteMode, reason kvcv1.RouteReason) {
	if c := m.decisionByKey.get(int32(mode), int32(reason)); c != nil {
		c.Inc()
	}
}

// plan counts what a decision's execution plan spares: a prefix loaded from P's store, a
// suffix-only receive on D, a large append its idle D prefills itself; and a load skipped for
// the holder's queue.
func (m *metrics) plan(d *policy.Decision) {
	mode, reason, e := d.Mode, d.Reason, &d.Exec
	if d.LoadSkippedBusy {
		m.loadSkippedBusy.Inc()
	}
	if e.LoadPrefixTokens > 0 {
		m.fromSnapshotByKey.inc(int32(mode), int32(reason))
		m.fromSnapshotTokens.Add(float64(e.LoadPrefixTokens))
	}
	if e.ReceiveFrom > 0 {
		m.suffixReceives.Inc()
	}
	if d.LocalAppendTokens > 0 {
		m.localAppendTokens.Add(float64(d.LocalAppendTokens))
	}
}

// admission counts a decision's admission effects: queued over the control plane's count, a
// fallback that keeps residency, a plain fallback that wasted KV the cluster held.
func (m *metrics) admission(d *policy.Decision) {
	if d.Admission != policy.AdmitFits {
		if c := m.queuedByKey.get(int32(d.Mode), int32(d.Admission)); c != nil {
			c.Inc()
		}
	}
	if d.KeepsResidency {
		m.keptFallbacks.Inc()
	}
	if d.WastedKV {
		m.wastedKV.Inc()
	}
}

// counters2 is a dense table of counters by two small non-negative enum values, made up front
// (an index per decision or outcome instead of a map lookup).
type counters2 struct {
	n2 int
	c  []prometheus.Counter
}

func newCounters2(n1, n2 int) counters2 {
	return counters2{n2: n2, c: make([]prometheus.Counter, n1*n2)}
}

func (t counters2) set(a, b int32, c prometheus.Counter) { t.c[int(a)*t.n2+int(b)] = c }

// get is the counter of (a, b); nil for a value the table was not made for.
func (t counters2) get(a, b int32) prometheus.Counter {
	if a < 0 || b < 0 || int(b) >= t.n2 {
		return nil
	}
	if i := int(a)*t.n2 + int(b); i < len(t.c) {
		return t.c[i]
	}
	return nil
}

// lazyCounters2 is counters2 for a vector whose children appear on their first count (no
// zero series for pairs that never happen): the child is looked up by its labels once, then
// kept in the table.
type lazyCounters2 struct {
	vec *prometheus.CounterVec
	n2  int
	c   []atomic.Pointer[prometheus.Counter]
}

func newLazyCounters2(vec *prometheus.CounterVec, n1, n2 int) lazyCounters2 {
	return lazyCounters2{vec: vec, n2: n2, c: make([]atomic.Pointer[prometheus.Counter], n1*n2)}
}

// inc counts (mode a, reason b); a pair outside the table is counted through its labels.
func (t lazyCounters2) inc(a, b int32) {
	i := int(a)*t.n2 + int(b)
	if a < 0 || b < 0 || int(b) >= t.n2 || i >= len(t.c) {
		t.vec.WithLabelValues(ModeName(kvcv1.RouteMode(a)), ReasonName(kvcv1.RouteReason(b))).Inc()
		return
	}
	p := t.c[i].Load()
	if p == nil {
		c := t.vec.WithLabelValues(ModeName(kvcv1.RouteMode(a)), ReasonName(kvcv1.RouteReason(b)))
		p = &c
		t.c[i].Store(p) // a racing first count stores the same child
	}
	(*p).Inc()
}

// command counts a command sent to a sidecar by kind and result.
func (m *metrics) command(kind string, ok bool) {
	i, result := 0, "ok"
	if !ok {
		i, result = 1, "error"
	}
	if c := m.cmdByKind[kind]; c != nil {
		c[i].Inc()
		return
	}
	m.commands.WithLabelValues(kind, result).Inc()
}

// enumLen is one more than the largest value of a proto enum's name map.
func enumLen(names map[int32]string) int {
	n := 0
	for v := range names {
		n = max(n, int(v)+1)
	}
	return n
}
