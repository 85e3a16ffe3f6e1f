package kvstore

import "github.com/prometheus/client_golang/prometheus"

type metrics struct {
	txns     *prometheus.CounterVec // by result: ok, error, fenced
	flushes  prometheus.Counter
	ops      prometheus.Counter
	bytes    prometheus.Counter
	pending  prometheus.Gauge
	oldestMs prometheus.Histogram
	// txnSeconds: one fenced write transaction (Apply) from the call to etcd's answer, retries
	// of an unavailable endpoint included: etcd's write latency as the control plane sees it.
	txnSeconds prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		txns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_kvstore_txns_total", Help: "Fenced write transactions by result (ok, error, fenced).",
		}, []string{"result"}),
		flushes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_kvstore_flushes_total", Help: "Write-behind flushes (each one or more Txns).",
		}),
		ops: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_kvstore_ops_total", Help: "Put/delete operations written.",
		}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_kvstore_bytes_total", Help: "Key and value bytes written.",
		}),
		pending: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_kvstore_pending_ops", Help: "Coalesced operations waiting for the next flush.",
		}),
		oldestMs: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvc_kvstore_flush_oldest_age_ms", Help: "Age of the oldest pending write when a flush is cut.",
			Buckets: []float64{1, 5, 10, 25, 50, 100, 250, 1000, 5000},
		}),
		txnSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvc_kvstore_txn_duration_seconds", Help: "Duration of fenced write transactions to etcd (any result, retries included).",
			Buckets: []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
		}),
	}
	for _, r := range []string{"ok", "error", "fenced"} {
		m.txns.WithLabelValues(r)
	}
	if reg != nil {
		reg.MustRegister(m.txns, m.flushes, m.ops, m.bytes, m.pending, m.oldestMs, m.txnSeconds)
	}
	return m
}
