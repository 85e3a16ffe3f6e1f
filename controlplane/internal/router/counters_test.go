package router

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestCounters2(t *testing.T) {
	tab := newCounters2(3, 4)
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "x"})
	tab.set(2, 3, c)
	for _, tc := range []struct {
		a, b int32
		want prometheus.Counter
	}{
		{2, 3, c}, {0, 0, nil}, {2, 2, nil}, {3, 0, nil}, {-1, 3, nil}, {2, -1, nil}, {0, 4, nil}, {1, 7, nil},
	} {
		if got := tab.get(tc.a, tc.b); got != tc.want {
			t.Errorf("get(%d, %d) = %v, want %v", tc.a, tc.b, got, tc.want)
		}
	}
	if n := enumLen(kvcv1.RouteMode_name); n != len(kvcv1.RouteMode_name) {
		t.Errorf("enumLen(RouteMode) = %d, want %d (the values are dense)", n, len(kvcv1.RouteMode_name))
	}
}

// TestMetricTablesCountEveryPair: every (mode, reason) decision counter, (mode, error kind)
// outcome counter and mode's TTFT histogram in the tables is the labelled series of its pair,
// and a value outside the enums still counts (under its number's label).
func TestMetricTablesCountEveryPair(t *testing.T) {
	m := New(routertest.New(), zerolog.Nop(), nil).m
	for mv := range kvcv1.RouteMode_name {
		mode := kvcv1.RouteMode(mv)
		for rv := range kvcv1.RouteReason_name {
			reason := kvcv1.RouteReason(rv)
			before := testutil.ToFloat64(m.decisions.WithLabelValues(ModeName(mode), ReasonName(reason)))
			m.decision(mode, reason)
			if got := testutil.ToFloat64(m.decisions.WithLabelValues(ModeName(mode), ReasonName(reason))); got != before+1 {
				t.Fatalf("decision %s/%s counted %v, want %v", ModeName(mode), ReasonName(reason), got, before+1)
			}
		}
		for kv := range kvcv1.RouteErrorKind_name {
			kind := kvcv1.RouteErrorKind(kv)
			before := testutil.ToFloat64(m.outcomes.WithLabelValues(ModeName(mode), errorKindName(kind)))
			m.outcome(mode, kind)
			if got := testutil.ToFloat64(m.outcomes.WithLabelValues(ModeName(mode), errorKindName(kind))); got != before+1 {
				t.Fatalf("outcome %s/%s counted %v, want %v", ModeName(mode), errorKindName(kind), got, before+1)
			}
		}
		m.observeTTFT(mode, 0.01)
		if n := testutil.CollectAndCount(m.ttft.WithLabelValues(ModeName(mode)).(prometheus.Histogram)); n != 1 {
			t.Fatalf("ttft of %s: %d series", ModeName(mode), n)
		}
	}
	unknown := kvcv1.RouteMode(99)
	m.outcome(unknown, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE)
	if got := testutil.ToFloat64(m.outcomes.WithLabelValues(ModeName(unknown), "NONE")); got != 1 {
		t.Fatalf("outcome of an unknown mode counted %v, want 1", got)
	}
}

// TestLazyCountersAndCommands: the prefill-from-snapshot counters, kept in a table once looked
// up, count each (mode, reason) in its own series and make none for pairs never counted; the
// commands' children count by kind and result, a kind outside the table through its labels.
func TestLazyCountersAndCommands(t *testing.T) {
	m := newMetrics(nil, New(routertest.New(), zerolog.Nop(), nil))
	reseed, snap := kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT
	for range 3 {
		m.fromSnapshotByKey.inc(int32(reseed), int32(snap))
	}
	m.fromSnapshotByKey.inc(int32(kvcv1.RouteMode_ROUTE_MODE_SEED), int32(snap))
	m.fromSnapshotByKey.inc(99, 1) // outside the table: through the labels
	if got := testutil.ToFloat64(m.fromSnapshot.WithLabelValues(ModeName(reseed), ReasonName(snap))); got != 3 {
		t.Errorf("from-snapshot %s/%s = %v, want 3", ModeName(reseed), ReasonName(snap), got)
	}
	if n := testutil.CollectAndCount(m.fromSnapshot); n != 3 {
		t.Errorf("%d from-snapshot series, want 3 (only the pairs counted)", n)
	}
	m.command("push_snapshot", true)
	m.command("push_snapshot", false)
	m.command("push_snapshot", true)
	m.command("brand_new_kind", false)
	for _, tc := range []struct {
		kind, result string
		want         float64
	}{{"push_snapshot", "ok", 2}, {"push_snapshot", "error", 1}, {"brand_new_kind", "error", 1}, {"release_session", "ok", 0}} {
		if got := testutil.ToFloat64(m.commands.WithLabelValues(tc.kind, tc.result)); got != tc.want {
			t.Errorf("commands %s/%s = %v, want %v", tc.kind, tc.result, got, tc.want)
		}
	}
}
