package router

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// histograms is a Prometheus histogram family of fixed buckets whose Observe is the bucket
// search and two atomic adds: client_golang's own keeps a hot and a cold set of counts behind
// an interface call and checks for native buckets, about 130 instructions an observation on the
// decision path (the decision latency per query, the TTFT per outcome). It is exposed as
// client_golang exposes a classic histogram (cumulative buckets, _sum, _count): a scrape sums
// the buckets for the count, so the two always agree.
type histograms struct {
	desc   *prometheus.Desc
	bounds []float64
	mu     sync.Mutex                 // guards children's growth (a label value first seen)
	kids   atomic.Pointer[[]*histKid] // in label order of creation; read without mu
}

// histKid is one child: its label values and counts.
type histKid struct {
	labels []string
	counts []atomic.Uint64 // per bucket, +Inf last
	sum    atomic.Uint64   // float64 bits
}

var _ prometheus.Collector = (*histograms)(nil)

// newHistograms is a family named name with labels (none: one histogram) and bounds (upper
// bounds, increasing, as prometheus.HistogramOpts.Buckets).
func newHistograms(name, help string, bounds []float64, labels ...string) *histograms {
	h := &histograms{desc: prometheus.NewDesc(name, help, labels, nil), bounds: slices.Clone(bounds)}
	h.kids.Store(new([]*histKid))
	return h
}

// child returns the histogram of labels, made when missing.
func (h *histograms) child(labels ...string) *histKid {
	for _, k := range *h.kids.Load() {
		if slices.Equal(k.labels, labels) {
			return k
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	kids := *h.kids.Load()
	for _, k := range kids {
		if slices.Equal(k.labels, labels) {
			return k
		}
	}
	k := &histKid{labels: slices.Clone(labels), counts: make([]atomic.Uint64, len(h.bounds)+1)}
	next := append(slices.Clip(kids), k)
	h.kids.Store(&next)
	return k
}

// observe records v in k, a child of h.
func (h *histograms) observe(k *histKid, v float64) {
	i := 0
	for i < len(h.bounds) && !(v <= h.bounds[i]) { // NaN: +Inf, as client_golang
		i++
	}
	k.counts[i].Add(1)
	for {
		old := k.sum.Load()
		if k.sum.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+v)) {
			return
		}
	}
}

// Describe implements prometheus.Collector.
func (h *histograms) Describe(ch chan<- *prometheus.Desc) { ch <- h.desc }

// Collect implements prometheus.Collector.
func (h *histograms) Collect(ch chan<- prometheus.Metric) {
	for _, k := range *h.kids.Load() {
		buckets := make(map[float64]uint64, len(h.bounds))
		var n uint64
		for i, b := range h.bounds {
			n += k.counts[i].Load()
			buckets[b] = n
		}
		n += k.counts[len(h.bounds)].Load()
		ch <- prometheus.MustNewConstHistogram(h.desc, n, math.Float64frombits(k.sum.Load()), buckets, k.labels...)
	}
}
