package server

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// deadURL is the address of a listener that was closed: connecting to it is refused.
func deadURL(t *testing.T) string {
	srv := httptest.NewServer(http.NotFoundHandler())
	srv.Close()
	return srv.URL
}

// A worker that is gone (connection refused or dropped before any answer, or a 503 other than
// no_capacity) costs one retry through a new decision when nothing went to the client yet; the
// failed attempt's outcome reaches the control plane before the retry's query.
func TestRetryAfterWorkerGone(t *testing.T) {
	const (
		direct = kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D
		seed   = kvcv1.RouteMode_ROUTE_MODE_SEED
	)
	dead := "dead"
	tests := []struct {
		name string
		mode kvcv1.RouteMode // of the first decision (the second is a SEED onto the good workers)
		// which of the first decision's workers is bad, and how: "dead" (refused), or a fakeWorker
		// behaviour for every call
		badP, badD string
		body       string
		wantStatus int
		wantRetry  bool
		wantKind   kvcv1.RouteErrorKind // first outcome
		wantDetail string               // prefix of the first outcome's detail
	}{
		{"decode refused", direct, "", dead, genBody, 200, true,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, "worker_unreachable: decode worker: Post"},
		{"decode drops the connection", direct, "", "close", genBody, 200, true,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, "worker_unreachable: decode worker: Post"},
		{"seed's decode refused (at open_session)", seed, "", dead, genBody, 200, true,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, "worker_unreachable: decode worker: open_session: Post"},
		{"decode 503 going away", direct, "", "503gone", genBody, 200, true,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, "unavailable: decode worker"},
		// D waits for P's KV (as a real D does) until P's failure cancels it
		{"prefill refused", seed, dead, "slow", genBody, 200, true,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, "worker_unreachable: prefill worker"},
		{"prefill 503 going away", seed, "503gone", "slow", genBody, 200, true,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, "unavailable: prefill worker"},
		{"decode full is not retried", direct, "", "503", genBody, 503, false,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, "no_capacity: decode worker"},
		{"decode dies after a token (streaming)", direct, "", "die", genBody, 200, false,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, "worker_unreachable: decode worker"},
		{"decode dies after a token (non-streaming)", direct, "", "die", strings.Replace(genBody, `"stream":true`, `"stream":false`, 1), 502, false,
			kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, "worker_unreachable: decode worker"},
	}
	plans := map[kvcv1.RouteMode]fakecp.Canned{direct: fakecp.Direct(), seed: fakecp.Seed()} // the first decision's plan
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			badRef := func(how, id string, fallback *fakeWorker) *kvcv1.WorkerRef {
				switch how {
				case "":
					return ref(fallback, id, "127.0.0.1:7001")
				case dead:
					return &kvcv1.WorkerRef{WorkerId: id, WorkerUrl: deadURL(t), PeerAddr: "127.0.0.1:7001"}
				}
				w := newFakeWorker(t, func(int, workerReq) string { return how })
				return ref(w, id, "127.0.0.1:7001")
			}
			var first *kvcv1.RouteResponse
			n := 0
			decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
				n++ // one query at a time on the fake control plane's stream
				if n == 1 {
					if first == nil {
						first = fakecp.Decision(q, tt.mode, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT,
							badRef(tt.badP, "p-bad", p), badRef(tt.badD, "d-bad", d), plans[tt.mode])
					}
					return first
				}
				return fakecp.Decision(q, seed, kvcv1.RouteReason_ROUTE_REASON_SESSION_EVICTED, ref(p, "p0", "127.0.0.1:7001"), ref(d, "d0", ""), fakecp.Seed())
			}
			e := setup(t, decide, nil, nil, 0)
			resp := post(t, e.gw.URL, "/generate", "s1", tt.body)
			if resp.StatusCode != tt.wantStatus {
				t.Fatalf("status %d, want %d", resp.StatusCode, tt.wantStatus)
			}
			wantRetries := "0"
			if tt.wantRetry {
				wantRetries = "1"
			}
			if got := resp.Header.Get("X-KVC-Retries"); resp.StatusCode == 200 && tt.body == genBody && got != wantRetries {
				t.Fatalf("X-KVC-Retries %q, want %s", got, wantRetries)
			}
			// The retried attempt's decode worker is named, whichever of its workers failed.
			wantFrom := ""
			if tt.wantRetry {
				wantFrom = "d-bad"
			}
			if got := resp.Header.Get("X-KVC-Retried-From"); resp.StatusCode == 200 && tt.body == genBody && got != wantFrom {
				t.Fatalf("X-KVC-Retried-From %q, want %q", got, wantFrom)
			}
			if tt.wantStatus == 200 && tt.body == genBody {
				ev := sse(t, resp.Body)
				if ev[len(ev)-1] != "[DONE]" {
					t.Fatalf("events %v", ev)
				}
				if errored := strings.Contains(strings.Join(ev, ""), `"error"`); errored == tt.wantRetry {
					t.Fatalf("events %v (retry=%v)", ev, tt.wantRetry)
				}
			}
			o := outcome(t, e.cp)
			if o.GetSuccess() || o.GetErrorKind() != tt.wantKind || !strings.HasPrefix(o.GetDetail(), tt.wantDetail) {
				t.Fatalf("first outcome %v; want kind %v, detail %q...", o, tt.wantKind, tt.wantDetail)
			}
			why := "worker_unavailable"
			if tt.wantRetry {
				second := outcome(t, e.cp)
				if !second.GetSuccess() || second.GetDecisionId() == o.GetDecisionId() {
					t.Fatalf("second outcome %v", second)
				}
				if got := testutil.ToFloat64(e.m.Retries.WithLabelValues(why)); got != 1 {
					t.Fatalf("retries{%s} = %v", why, got)
				}
				return
			}
			if got := testutil.ToFloat64(e.m.Retries.WithLabelValues(why)); got != 0 {
				t.Fatalf("retried: retries{%s} = %v", why, got)
			}
			if n != 1 {
				t.Fatalf("%d decisions asked for; want 1 (no retry)", n)
			}
		})
	}
}

// The retry is bounded: a second failure is the client's answer, with its stable code.
func TestRetryBounded(t *testing.T) {
	decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
		return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT,
			ref(p, "p0", "127.0.0.1:7001"), &kvcv1.WorkerRef{WorkerId: "d-dead", WorkerUrl: deadURL(t)}, fakecp.Direct())
	}
	e := setup(t, decide, nil, nil, 0)
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	code, _ := errBody(t, resp.Body)
	if resp.StatusCode != http.StatusBadGateway || code != "worker_unreachable" || resp.Header.Get("X-KVC-Error-Kind") != "REJECTED_BY_D" ||
		resp.Header.Get("X-KVC-Retries") != "1" || resp.Header.Get("X-KVC-Retried-From") != "d-dead" {
		t.Fatalf("got %d %s, headers %v", resp.StatusCode, code, resp.Header)
	}
	a, b := outcome(t, e.cp), outcome(t, e.cp)
	if a.GetSuccess() || b.GetSuccess() || a.GetDecisionId() == b.GetDecisionId() ||
		a.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D || b.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D {
		t.Fatalf("outcomes %v / %v", a, b)
	}
	if got := testutil.ToFloat64(e.m.Retries.WithLabelValues("worker_unavailable")); got != 1 {
		t.Fatalf("retries = %v, want 1", got)
	}
}

// Fail-open requests retry too: round robin moves on to the next worker.
func TestRetryFailOpenSkipsDeadWorker(t *testing.T) {
	p, d := newFakeWorker(t, nil), newFakeWorker(t, nil)
	pool := workers.NewPool([]workers.Worker{{ID: "p0", URL: p.URL, PeerAddr: "127.0.0.1:7777"}},
		[]workers.Worker{{ID: "d-dead", URL: deadURL(t)}, {ID: "d1", URL: d.URL}})
	m := NewMetrics(prometheus.NewRegistry())
	s := New(nil, pool, Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{RequireSession: true, DefaultMaxTok: 4}}, zerolog.Nop(), m)
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	t.Cleanup(func() { gw.Close(); s.Close() })
	resp := post(t, gw.URL, "/generate", "s1", genBody)
	if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Fail-Open") != "true" || resp.Header.Get("X-KVC-Retries") != "1" ||
		resp.Header.Get("X-KVC-Decode-Worker") != "d1" || resp.Header.Get("X-KVC-Retried-From") != "d-dead" {
		t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
	}
	if ev := sse(t, resp.Body); ev[len(ev)-1] != "[DONE]" {
		t.Fatalf("events %v", ev)
	}
	if got := testutil.ToFloat64(m.Retries.WithLabelValues("worker_unavailable")); got != 1 {
		t.Fatalf("retries = %v, want 1", got)
	}
}
