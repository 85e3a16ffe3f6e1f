package bench

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvcentric/kvcentric/sim/internal/cluster"
)

func TestPushBytesSumsLiveDecodeSidecars(t *testing.T) {
	metrics := func(sum string) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				http.NotFound(w, r)
				return
			}
			fmt.Fprintf(w, "# HELP kvc_snapshot_push_bytes x\nkvc_snapshot_push_bytes_bucket{le=\"+Inf\"} 3\nkvc_snapshot_push_bytes_sum %s\nkvc_snapshot_push_bytes_count 3\n", sum)
		}))
	}
	a, b, p := metrics("1.5e+06"), metrics("2500"), metrics("999")
	defer a.Close()
	defer b.Close()
	defer p.Close()
	c := &cluster.Cluster{Workers: []cluster.Worker{
		{ID: "decode-0", Role: "decode", SidecarHTTP: a.URL},
		{ID: "decode-1", Role: "decode", SidecarHTTP: b.URL},
		{ID: "decode-2", Role: "decode", SidecarHTTP: "http://127.0.0.1:1"}, // dead: counted as 0
		{ID: "prefill-0", Role: "prefill", SidecarHTTP: p.URL},              // not a decode sidecar
	}}
	if got := pushBytes(c); got != 1_502_500 {
		t.Fatalf("pushBytes = %d, want 1502500", got)
	}
}

func TestWastedKVFallbacksSumsControlPlanes(t *testing.T) {
	cp := func(v string) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				http.NotFound(w, r)
				return
			}
			fmt.Fprintf(w, "# HELP kvc_router_wasted_kv_fallbacks_total x\n# TYPE kvc_router_wasted_kv_fallbacks_total counter\nkvc_router_wasted_kv_fallbacks_total %s\nkvc_router_wasted_kv_fallbacks_total_other 99\n", v)
		}))
	}
	leader, follower := cp("7"), cp("0")
	defer leader.Close()
	defer follower.Close()
	hc := &http.Client{}
	if got := wastedKVFallbacks(hc, []string{leader.URL, follower.URL, "http://127.0.0.1:1"}); got != 7 {
		t.Fatalf("wastedKVFallbacks = %d, want 7 (a dead control plane left out)", got)
	}
	c := &cluster.Cluster{ControlPlaneHTTP: []string{leader.URL, follower.URL}}
	if n := scrapeNodes(c); n.WastedKVFallbacks != 7 {
		t.Fatalf("scrapeNodes: %d wasted-KV fallbacks, want 7", n.WastedKVFallbacks)
	}
}
