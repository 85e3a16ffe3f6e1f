package server

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the gateway's Prometheus series.
type Metrics struct {
	reg          prometheus.Registerer // where lazily made collectors register (the tokenizer gate)
	Requests     *prometheus.CounterVec
	FailOpen     *prometheus.CounterVec
	BadRequests  *prometheus.CounterVec
	TTFT         *prometheus.HistogramVec
	Latency      *prometheus.HistogramVec
	RouteLatency prometheus.Histogram
	Retries      *prometheus.CounterVec
	Inflight     prometheus.Gauge
	CPConnected  prometheus.Gauge
	Orphans      prometheus.Counter
	CPSilent     prometheus.Counter
	Refresh      *prometheus.CounterVec
	Outcomes     *prometheus.CounterVec
	SessionCalls *prometheus.CounterVec
	// AbandonedCloses counts sessions closed on their decode worker because the client left
	// the turn that opened them (exec.go closeAbandoned).
	AbandonedCloses prometheus.Counter
	// HintReleases counts the agent's release hints carried out after the answer.
	HintReleases *prometheus.CounterVec
	// Content (content.go).
	TokenizerLoaded prometheus.Gauge
	EstimatedInputs prometheus.Counter
	TokenizeSeconds prometheus.Histogram
	// ChatRenders counts chat prompts rendered with the per-session cache, by path.
	ChatRenders    *prometheus.CounterVec
	PageSize       prometheus.Gauge
	ContentQueries *prometheus.CounterVec
	// PrefillPriority counts calls to a prefill worker by the decision's prefill priority class.
	PrefillPriority *prometheus.CounterVec
	// Agent tool calling (api/chattools.go, answer.go).
	ToolRequests      *prometheus.CounterVec
	ToolCalls         prometheus.Counter
	ToolParseFailures *prometheus.CounterVec
	ReasoningAnswers  prometheus.Counter
	// Resumes counts requests whose decode worker died mid-stream, by what the gateway did
	// (resume.go: ok, failed, or why it did not resume), and the continuation attempts tried
	// again after failing before their first token (retried).
	Resumes *prometheus.CounterVec
}

// NewMetrics registers the series on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	buckets := []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 180}
	m := &Metrics{
		reg: reg,
		Requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_requests_total",
			Help: "Client requests finished, by API, executed mode and result (ok or an error kind)."}, []string{"api", "mode", "result"}),
		FailOpen: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_failopen_total",
			Help: "Requests served as plain P/D round robin from the gateway's own worker lists because the control plane gave no usable decision, by reason (control_plane_unavailable, no_session, route_error, no_decode_worker, no_prefill_worker, no_execution)."}, []string{"reason"}),
		BadRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_bad_requests_total",
			Help: "Requests refused before routing, by error code."}, []string{"code"}),
		TTFT: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvc_gateway_ttft_seconds",
			Help: "Time to first token measured at the gateway, by executed mode.", Buckets: buckets}, []string{"mode"}),
		Latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvc_gateway_request_seconds",
			Help: "End-to-end request latency at the gateway, by executed mode.", Buckets: buckets}, []string{"mode"}),
		RouteLatency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvc_gateway_route_seconds",
			Help: "Time to get a routing decision over the Route stream.", Buckets: prometheus.ExponentialBuckets(0.0001, 4, 10)}),
		Retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_retries_total",
			Help: "Requests retried through a new decision before any byte went to the client, by reason (session_not_resident: D answered 409; worker_unavailable: a worker refused or dropped the connection, or answered 503 other than no_capacity)."},
			[]string{"reason"}),
		Inflight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_inflight_requests", Help: "Requests in flight."}),
		CPConnected: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_control_plane_connected",
			Help: "1 while a Route stream to the control-plane leader is up; 0 means the gateway fails open."}),
		CPSilent: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_gateway_control_plane_silent_total",
			Help: "Route streams left because their control plane answered nothing for half the lease (--cp-lease: a paused leader, a frozen link)."}),
		Orphans: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_gateway_orphan_decisions_total",
			Help: "Decisions that arrived after the route timeout (released at once with an ABORTED outcome)."}),
		Refresh: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_worker_refresh_total",
			Help: "Fail-open worker list refreshes from AdminService/ListWorkers, by result."}, []string{"result"}),
		Outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_outcomes_reported_total",
			Help: "RouteOutcomes sent to the control plane, by result (sent or lost)."}, []string{"result"}),
		SessionCalls: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_session_calls_total",
			Help: "Streaming-session calls to decode workers, by call (open_session, close_session) and result (ok, error)."}, []string{"call", "result"}),
		AbandonedCloses: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_gateway_abandoned_sessions_closed_total",
			Help: "Sessions closed on their decode worker because the client went away before the turn that opened them there (a seed, a reseed) succeeded: their KV is given back instead of staying as the worker's most recent idle session."}),
		HintReleases: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_hint_releases_total",
			Help: "Release hints (X-KVC-Release, metadata kvc_release): sessions ended after their answer, by result (ok, error, skipped_failed: the request failed, the session is kept)."}, []string{"result"}),
		TokenizerLoaded: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_tokenizer_loaded",
			Help: "1 when the model's tokenizer is loaded (--tokenizer): exact input token counts and chat templates; 0: input tokens are estimated from text length."}),
		EstimatedInputs: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_gateway_input_tokens_estimated_total",
			Help: "Requests whose input token count was estimated (⌈bytes/4⌉): no tokenizer, no input_ids, no client count."}),
		TokenizeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvc_gateway_tokenize_seconds",
			Help: "Time to render the chat template and tokenize one prompt.", Buckets: prometheus.ExponentialBuckets(0.00005, 2, 14)}),
		ChatRenders: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_chat_renders_total",
			Help: "Chat prompts of requests with a session id rendered by the chat template, by path (incremental: only the messages from the session's last user message on were rendered, the history before it reused; full: the whole conversation)."}, []string{"path"}),
		PageSize: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_kv_page_size",
			Help: "KV page size the prompt's page hashes are computed with; 0 while unknown (no content addresses)."}),
		ContentQueries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_content_queries_total",
			Help: "Route queries by content address: hashes (the prompt's page chain sent) or lengths (no token ids: the decision goes on lengths alone)."}, []string{"address"}),
		PrefillPriority: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_prefill_priority_total",
			Help: "Calls to a prefill worker by the decision's prefill priority (low: prefill_priority > 0, sent as a negative SGLang priority, its prefix evicted first from P's radix cache under --radix-eviction-policy priority; normal: 0, no priority field; high: < 0)."}, []string{"priority"}),
		ToolRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_tool_requests_total",
			Help: "Chat requests whose tools reached the chat template, by tool_choice (auto, none is not counted: its tools do not reach the template)."}, []string{"choice"}),
		ToolCalls: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_gateway_tool_calls_total",
			Help: "Tool calls parsed from answers (--tool-call-parser) and returned as message.tool_calls (a streamed answer: delta.tool_calls)."}),
		ToolParseFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_tool_parse_failures_total",
			Help: "Answers with tool-call markup that gave no tool call, returned as content as SGLang does, by reason (no_call: no complete call to a declared tool; error: a call that is not a JSON object or whose name is not a string)."}, []string{"reason"}),
		ReasoningAnswers: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_gateway_reasoning_answers_total",
			Help: "Answers whose reasoning was separated into message.reasoning_content (--reasoning-parser)."}),
		Resumes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_resumes_total",
			Help: "Requests whose decode worker went away after tokens were streamed (or buffered), by result: ok (a new decision continued the answer from the prompt and the tokens so far), failed (the continuation found no decision or failed), retried (one per continuation that failed before its first token and was tried again through a new decision), or why it was not resumed (disabled: --resume-mid-stream=false; no_prompt_ids: the prompt's token ids are unknown; ids_mismatch: the streamed ids do not add up to the tokens generated; no_tokens_left; constrained: a regex, EBNF or JSON-schema answer; not_allowed: the decision forbids retries)."}, []string{"result"}),
	}
	for _, r := range resumeResults {
		m.Resumes.WithLabelValues(r)
	}
	reg.MustRegister(m.Resumes)
	for _, r := range []string{"no_call", "error"} {
		m.ToolParseFailures.WithLabelValues(r)
	}
	m.ToolRequests.WithLabelValues("auto")
	reg.MustRegister(m.ToolRequests, m.ToolCalls, m.ToolParseFailures, m.ReasoningAnswers)
	for _, c := range []string{"low", "normal", "high"} {
		m.PrefillPriority.WithLabelValues(c)
	}
	reg.MustRegister(m.PrefillPriority)
	reg.MustRegister(m.TokenizerLoaded, m.EstimatedInputs, m.TokenizeSeconds, m.ChatRenders, m.PageSize, m.ContentQueries)
	// Every fail-open reason from the start, so a dashboard's rate shows 0 rather than nothing.
	for _, why := range []string{foUnavailable, foNoSession, foRouteError, foNoDecode, foNoPrefill, foNoExecution} {
		m.FailOpen.WithLabelValues(why)
	}
	reg.MustRegister(m.Requests, m.FailOpen, m.BadRequests, m.TTFT, m.Latency, m.RouteLatency, m.Retries,
		m.Inflight, m.CPConnected, m.CPSilent, m.Orphans, m.Refresh, m.Outcomes, m.SessionCalls, m.HintReleases,
		m.AbandonedCloses)
	return m
}
