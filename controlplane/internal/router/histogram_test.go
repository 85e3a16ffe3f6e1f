package router

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"
)

// TestHistogramsExposeAsClientGolang: the router's histograms, observed with the same values as
// client_golang's histogram of the same name, help, labels and buckets, gather to the same
// metric family (buckets' cumulative counts, count, sum), with one series per child, for
// values on the bounds, between them, below the first, above the last and NaN.
func TestHistogramsExposeAsClientGolang(t *testing.T) {
	bounds := prometheus.ExponentialBuckets(1e-6, 2, 16)
	ours := newHistograms("kvc_test_seconds", "Test histogram.", bounds, "mode")
	ref := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvc_test_seconds", Help: "Test histogram.", Buckets: bounds}, []string{"mode"})
	rng := rand.New(rand.NewPCG(3, 4))
	vals := []float64{0, 1e-7, 1e-6, 2e-6, 3e-6, bounds[len(bounds)-1], 1, 100, math.NaN()}
	for range 1000 {
		vals = append(vals, math.Exp(rng.Float64()*12-14))
	}
	for i, v := range vals {
		mode := []string{"A", "B"}[i%2]
		ours.observe(ours.child(mode), v)
		ref.WithLabelValues(mode).Observe(v)
	}
	gather := func(c prometheus.Collector) *dto.MetricFamily {
		t.Helper()
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(c)
		mfs, err := reg.Gather()
		if err != nil || len(mfs) != 1 {
			t.Fatalf("gather: %v (%d families)", err, len(mfs))
		}
		for _, m := range mfs[0].Metric {
			m.Histogram.CreatedTimestamp = nil // client_golang's own records when it was made
			m.Histogram.SampleSum = proto.Float64(0)
		}
		return mfs[0]
	}
	got, want := gather(ours), gather(ref)
	if !proto.Equal(got, want) {
		t.Fatalf("gathered\n%v\nwant\n%v", got, want)
	}
	// The sums (NaN observed: NaN in both; compare the series without it too).
	clean := newHistograms("kvc_clean_seconds", "h", bounds)
	cref := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvc_clean_seconds", Help: "h", Buckets: bounds})
	for _, v := range vals[:len(vals)-1] {
		if math.IsNaN(v) {
			continue
		}
		clean.observe(clean.child(), v)
		cref.Observe(v)
	}
	var a, b dto.Metric
	if err := cref.Write(&b); err != nil {
		t.Fatal(err)
	}
	ch := make(chan prometheus.Metric, 1)
	clean.Collect(ch)
	if err := (<-ch).Write(&a); err != nil {
		t.Fatal(err)
	}
	if s1, s2 := a.GetHistogram().GetSampleSum(), b.GetHistogram().GetSampleSum(); math.Abs(s1-s2) > 1e-12*math.Abs(s2) {
		t.Fatalf("sum %v, want %v", s1, s2)
	}
}
