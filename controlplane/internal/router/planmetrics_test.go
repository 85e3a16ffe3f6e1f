package router

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestPlanMetrics: a decision's plan is counted by what it spares — a prefix loaded from P's
// store (and its tokens), a suffix-only receive, a large append its idle D prefills (its
// tokens) — and by a load skipped for a busy holder.
func TestPlanMetrics(t *testing.T) {
	m := newMetrics(prometheus.NewRegistry(), nil)
	la := kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND
	m.plan(&policy.Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, Reason: la,
		Exec: policy.Execution{CallPrefill: true, LoadPrefixTokens: 16_000, ReceiveFrom: 16_384}})
	m.plan(&policy.Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, Reason: la, LoadSkippedBusy: true,
		Exec: policy.Execution{CallPrefill: true, ReceiveFrom: 16_384}})
	m.plan(&policy.Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D})
	m.plan(&policy.Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, Reason: kvcv1.RouteReason_ROUTE_REASON_LOCAL_LARGE_APPEND,
		LocalAppendTokens: 12_516})
	if got := testutil.ToFloat64(m.fromSnapshot.WithLabelValues("PD_FALLBACK", ReasonName(la))); got != 1 {
		t.Fatalf("kvc_router_prefill_from_snapshot_total %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.fromSnapshotTokens); got != 16_000 {
		t.Fatalf("kvc_router_prefill_from_snapshot_tokens_total %v, want 16000", got)
	}
	if got := testutil.ToFloat64(m.loadSkippedBusy); got != 1 {
		t.Fatalf("kvc_router_prefill_load_skipped_busy_total %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.suffixReceives); got != 2 {
		t.Fatalf("kvc_router_suffix_receives_total %v, want 2", got)
	}
	if got := testutil.ToFloat64(m.localAppendTokens); got != 12_516 {
		t.Fatalf("kvc_router_local_large_append_tokens_total %v, want 12516", got)
	}
}
