package bench

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvcentric/kvcentric/sim/internal/cluster"
)

// metricsPage serves page as /metrics (404 elsewhere) until the test ends.
func metricsPage(t *testing.T, page string) string {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, page)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func TestPushBytesSumsLiveDecodeSidecars(t *testing.T) {
	push := func(sum string) string {
		return metricsPage(t, "# HELP kvc_snapshot_push_bytes x\nkvc_snapshot_push_bytes_bucket{le=\"+Inf\"} 3\nkvc_snapshot_push_bytes_sum "+
			sum+"\nkvc_snapshot_push_bytes_count 3\n")
	}
	c := &cluster.Cluster{Workers: []cluster.Worker{
		{ID: "decode-0", Role: "decode", SidecarHTTP: push("1.5e+06")},
		{ID: "decode-1", Role: "decode", SidecarHTTP: push("2500")},
		{ID: "decode-2", Role: "decode", SidecarHTTP: "http://127.0.0.1:1"}, // dead: counted as 0
		{ID: "prefill-0", Role: "prefill", SidecarHTTP: push("999")},        // not a decode sidecar
	}}
	if got := pushBytes(c); got != 1_502_500 {
		t.Fatalf("pushBytes = %d, want 1502500", got)
	}
}

func TestWastedKVFallbacksSumsControlPlanes(t *testing.T) {
	cp := func(v string) string {
		return metricsPage(t, "# HELP kvc_router_wasted_kv_fallbacks_total x\n# TYPE kvc_router_wasted_kv_fallbacks_total counter\n"+
			"kvc_router_wasted_kv_fallbacks_total "+v+"\nkvc_router_wasted_kv_fallbacks_total_other 99\n")
	}
	leader, follower := cp("7"), cp("0")
	hc := &http.Client{}
	if got := wastedKVFallbacks(hc, []string{leader, follower, "http://127.0.0.1:1"}); got != 7 {
		t.Fatalf("wastedKVFallbacks = %d, want 7 (a dead control plane left out)", got)
	}
	c := &cluster.Cluster{ControlPlaneHTTP: []string{leader, follower}}
	if n := scrapeNodes(c); n.WastedKVFallbacks != 7 {
		t.Fatalf("scrapeNodes: %d wasted-KV fallbacks, want 7", n.WastedKVFallbacks)
	}
}
