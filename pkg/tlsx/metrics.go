package tlsx

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// RegisterMetrics exports s on reg under the label identity=name:
// kvc_tls_cert_expiry_timestamp_seconds (the current certificate's NotAfter; alert well before
// it), kvc_tls_reloads_total{result="ok"|"failed"} and kvc_tls_handshake_failures_total
// (server handshakes refused). A nil s registers nothing.
func RegisterMetrics(reg prometheus.Registerer, name string, s *Source) error {
	if s == nil || reg == nil {
		return nil
	}
	labels := prometheus.Labels{"identity": name}
	cs := []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_tls_cert_expiry_timestamp_seconds", ConstLabels: labels,
			Help: "NotAfter of the TLS certificate in use (Unix seconds); files are re-read on change."},
			func() float64 { return float64(s.NotAfter().Unix()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvc_tls_reloads_total", ConstLabels: mergeLabels(labels, "result", "ok"),
			Help: "Reloads of TLS files after a change on disk, by result (failed: the previous certificates stay in use)."},
			func() float64 { return float64(s.Reloads()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvc_tls_reloads_total", ConstLabels: mergeLabels(labels, "result", "failed"),
			Help: "Reloads of TLS files after a change on disk, by result (failed: the previous certificates stay in use)."},
			func() float64 { return float64(s.Failures()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "kvc_tls_handshake_failures_total", ConstLabels: labels,
			Help: "TLS handshakes this server refused (no, expired or foreign client certificate; not TLS)."},
			func() float64 { return float64(s.HandshakeFailures()) }),
	}
	var errs []error
	for _, c := range cs {
		errs = append(errs, reg.Register(c))
	}
	return errors.Join(errs...)
}

func mergeLabels(l prometheus.Labels, k, v string) prometheus.Labels {
	out := prometheus.Labels{k: v}
	for a, b := range l {
		out[a] = b
	}
	return out
}
