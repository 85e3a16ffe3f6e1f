package worker

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	requests       *prometheus.CounterVec // mode, code
	ttft           *prometheus.HistogramVec
	receivedBytes  prometheus.Counter
	verifiedBytes  prometheus.Counter
	verifyFailures prometheus.Counter
	sentBytes      prometheus.Counter
	prefillTokens  prometheus.Counter
	decodeTokens   prometheus.Counter
	evictions      prometheus.Counter
	// sidecarlessReleases: sessions freed while the sidecar was gone (ReleaseSession Unavailable, or NotFound from a restarted sidecar not yet re-committed to).
	sidecarlessReleases prometheus.Counter
	capacityRejects     prometheus.Counter
	preallocWaits       prometheus.Counter
	demandReports       prometheus.Counter
	bridgeErrors        *prometheus.CounterVec // call
	transferSeconds     prometheus.Histogram
	residentGauge       prometheus.GaugeFunc
	usedPagesGauge      prometheus.GaugeFunc
	freePagesGauge      prometheus.GaugeFunc
	// content checks (content.go)
	truncations  prometheus.Counter
	tailRewrites prometheus.Counter
	misStitched  prometheus.Counter
	// prefixCachedTokens: tokens local first turns reused from other sessions' KV.
	prefixCachedTokens prometheus.Counter
	// prefillPromptTokens, prefillCacheHitTokens: a prefill worker's prompt tokens and those of
	// them its prefix cache served (P's cache hit rate is their ratio).
	prefillPromptTokens, prefillCacheHitTokens prometheus.Counter
	// bootstrapSeconds: prefill requests' wait for the decode side's pre-allocation.
	bootstrapSeconds prometheus.Histogram
	// prefillBusy: modeled seconds the GPU spent on prefill compute (P's prefill passes, D's
	// append-prefill chunks).
	prefillBusy prometheus.Counter

	// busy is the GPU's busy time (busy.go), pulledBytes the KV bytes a prefill worker pulled
	// from the baselines' tiers (kvc-bench's per-node figures).
	busy        *busyClock
	busyGauge   prometheus.CounterFunc
	pulledBytes prometheus.Counter
	// storeLoads: prefills from the snapshot by result (hit, miss, verify_failed);
	// storeLoadTokens: the tokens they loaded instead of prefilling.
	storeLoads      *prometheus.CounterVec
	storeLoadTokens prometheus.Counter
	// suffixReceives: large appends that kept the held prefix and received only the rest.
	suffixReceives prometheus.Counter
}

func newMetrics(reg prometheus.Registerer, w *Worker) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_sim_requests_total", Help: "Generate requests by mode and result code.",
		}, []string{"mode", "code"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvc_sim_ttft_seconds", Help: "Time to first token at the worker, by mode.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}, []string{"mode"}),
		receivedBytes:  prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_received_bytes_total", Help: "KV bytes received into this worker's pages (real bytes)."}),
		verifiedBytes:  prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_verified_bytes_total", Help: "Received KV bytes that matched the known pattern."}),
		verifyFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_verify_failures_total", Help: "Received token slots (token x buffer) that did not match the known pattern."}),
		sentBytes:      prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_sent_bytes_total", Help: "KV bytes this prefill worker's sidecar sent (SendKV)."}),
		prefillTokens:  prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_prefill_tokens_total", Help: "Tokens (append-)prefilled by the timing model."}),
		decodeTokens:   prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_decode_tokens_total", Help: "Output tokens decoded."}),
		evictions:      prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_evictions_total", Help: "Sessions evicted (LRU) to make room."}),
		sidecarlessReleases: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_releases_without_sidecar_total",
			Help: "Sessions freed (evicted or released) while the sidecar was gone: ReleaseSession failed Unavailable (or NotFound: a restarted sidecar this worker has not re-committed to yet); the sidecar reads no pages then."}),
		capacityRejects: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_capacity_rejections_total", Help: "Requests rejected with no_capacity."}),
		preallocWaits:   prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_prealloc_waits_total", Help: "Times a decode allocation waited for running requests to free pages."}),
		demandReports:   prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_demand_reports_total", Help: "Prealloc-queue demand reports (WorkerBridge ReportDemand) sent to the sidecar (--evict watermark)."}),
		bridgeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_sim_bridge_errors_total", Help: "Failed WorkerBridge calls to the sidecar.",
		}, []string{"call"}),
		transferSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvc_sim_transfer_wait_seconds", Help: "Real time from PrepareReceive to WaitReceive's answer.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
	}
	m.truncations = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_session_truncations_total", Help: "Held sessions cut before a turn's append-prefill (truncate_to, or a divergence in the partial last page)."})
	m.tailRewrites = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_tail_rewrites_total", Help: "Turns whose prompt diverged from the held KV inside its partial last page (invisible to page hashes)."})
	m.misStitched = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_mis_stitched_total", Help: "Turns refused because the held KV they were to reuse is not a prefix of the prompt inside its full pages."})
	m.prefixCachedTokens = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_prefix_cached_tokens_total", Help: "Tokens of new sessions' local first turns reused from KV this worker held for other sessions (not prefilled)."})
	m.prefillPromptTokens = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_prefill_prompt_tokens_total", Help: "Prompt tokens of the prefill passes this prefill worker ran, less any prefix it loaded from its store (prefill from the snapshot)."})
	m.prefillCacheHitTokens = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_prefill_cache_hit_tokens_total", Help: "Prompt tokens this prefill worker's prefix cache served instead of prefilling them (not counting tier pulls or prefixes loaded from its store)."})
	m.bootstrapSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvc_sim_bootstrap_wait_seconds",
		Help: "Prefill: time a request waited for the decode side's pre-allocation before it could prefill.", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)})
	m.prefillBusy = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_prefill_gpu_seconds_total", Help: "Wall seconds the GPU spent on (append-)prefill compute."})
	m.storeLoads = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_sim_store_loads_total",
		Help: "Prefill: snapshot prefixes loaded from the sidecar's store before a prefill (prefill from the snapshot), by result: hit, miss (the whole context prefilled), verify_failed."}, []string{"result"})
	m.storeLoadTokens = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_store_load_tokens_total", Help: "Prefill: tokens loaded from the store instead of prefilled."})
	m.suffixReceives = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_suffix_receives_total", Help: "Decode: large appends that kept the session's held prefix and received only the pages past it (receive_from)."})
	m.residentGauge = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_sim_resident_sessions", Help: "Sessions resident in the KV pool."},
		func() float64 { return float64(w.stats().Sessions) })
	m.usedPagesGauge = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_sim_used_pages", Help: "KV pages in use."},
		func() float64 { s := w.stats(); return float64(s.PageCount - s.FreePages) })
	m.freePagesGauge = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_sim_free_pages", Help: "KV pages free."},
		func() float64 { return float64(w.stats().FreePages) })
	m.busy = newBusyClock(nil)
	m.busyGauge = prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvc_sim_busy_seconds_total", Help: "Seconds the worker's GPU had at least one prefill, append-prefill or decode step running (wall time: divide by the time scale for model seconds)."},
		m.busy.seconds)
	m.pulledBytes = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_sim_pulled_bytes_total", Help: "KV bytes (at the worker's bytes per token) this prefill worker pulled from a baseline tier (L3 prefetch, a decode host's CPU tier) instead of prefilling."})
	if reg != nil {
		reg.MustRegister(m.busyGauge, m.pulledBytes, m.prefillPromptTokens, m.prefillCacheHitTokens)
		reg.MustRegister(m.requests, m.ttft, m.receivedBytes, m.verifiedBytes, m.verifyFailures, m.sentBytes,
			m.prefillTokens, m.decodeTokens, m.evictions, m.sidecarlessReleases, m.capacityRejects, m.preallocWaits, m.demandReports, m.bridgeErrors, m.transferSeconds,
			m.residentGauge, m.usedPagesGauge, m.freePagesGauge, m.truncations, m.tailRewrites, m.misStitched, m.prefixCachedTokens,
			m.bootstrapSeconds, m.prefillBusy, m.storeLoads, m.storeLoadTokens, m.suffixReceives)
	}
	return m
}
