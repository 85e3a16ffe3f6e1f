package server

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A client's session end asks the control plane where the session lives (end_session) and
// closes it there; the outcome releases the decision.
func TestCloseSessionEndpoint(t *testing.T) {
	decide := func(q *kvcv1.RouteQuery, _, d *fakeWorker) *kvcv1.RouteResponse {
		if !q.GetEndSession() || q.GetSessionId() != "s1" || q.GetInputTokens() != 0 {
			return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Error{Error: &kvcv1.RouteError{RequestId: q.GetRequestId(), Code: 3, Message: "want a session end"}}}
		}
		return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Decision{Decision: &kvcv1.RouteDecision{
			RequestId: q.GetRequestId(), DecisionId: "d-end", Reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_END,
			Execution: &kvcv1.RouteExecution{CloseSessionOn: []*kvcv1.WorkerRef{ref(d, "d0", "")}},
		}}}
	}
	e := setup(t, decide, nil, nil, 0)
	resp := post(t, e.gw.URL, "/close_session", "", `{"session_id":"s1"}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if c := <-e.d.sessions; c.Path != "/close_session" || c.SessionID != "s1" {
		t.Fatalf("decode worker got %+v", c)
	}
	if o := outcome(t, e.cp); o.GetDecisionId() != "d-end" || !o.GetSuccess() {
		t.Fatalf("outcome %v", o)
	}
	// Bad input never reaches the control plane.
	for _, b := range []string{`{}`, `{"session_id":"a/b"}`, `{`} {
		if resp := post(t, e.gw.URL, "/close_session", "", b); resp.StatusCode != 400 {
			t.Errorf("%s: status %d", b, resp.StatusCode)
		}
	}
	// The session id may come in the header.
	if resp := post(t, e.gw.URL, "/close_session", "s1", ``); resp.StatusCode != 200 {
		t.Fatalf("header id: status %d", resp.StatusCode)
	}
}

func TestCloseSessionWithoutControlPlane(t *testing.T) {
	pool := workers.NewPool(nil, nil)
	s := New(nil, pool, Options{RequestTimeout: time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{RequireSession: true, DefaultMaxTok: 4}}, zerolog.Nop(), NewMetrics(prometheus.NewRegistry()))
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	t.Cleanup(func() { gw.Close(); s.Close() })
	resp := post(t, gw.URL, "/close_session", "", `{"session_id":"s1"}`)
	code, _ := errBody(t, resp.Body)
	if resp.StatusCode != 503 || !strings.Contains(code, "control_plane_unavailable") {
		t.Fatalf("got %d %s", resp.StatusCode, code)
	}
}
