package server

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// The agent hints reach the control plane on the RouteQuery (pin, priority), and a release
// hint ends the session through the session-end path once the answer is out: the control
// plane gets an end_session query after the turn's own, and the decode worker a /close_session.
func TestAgentHintsThroughGateway(t *testing.T) {
	queries := make(chan *kvcv1.RouteQuery, 16)
	decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
		queries <- q
		if q.GetEndSession() {
			return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Decision{Decision: &kvcv1.RouteDecision{
				RequestId: q.GetRequestId(), DecisionId: "d-end", Reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_END,
				Execution: &kvcv1.RouteExecution{CloseSessionOn: []*kvcv1.WorkerRef{ref(d, "d0", "")}},
			}}}
		}
		r := fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, nil, ref(d, "d0", ""), fakecp.Direct())
		r.GetDecision().DecisionId = "d-turn-" + q.GetSessionId()
		return r
	}
	e := setup(t, decide, nil, nil, 0)

	// Turn 1: pinned for 30 s while the agent runs a tool, low priority (metadata).
	req, _ := http.NewRequest(http.MethodPost, e.gw.URL+"/v1/chat/completions", strings.NewReader(
		`{"model":"m","messages":[{"role":"user","content":"run the tests"}],"max_tokens":4,"metadata":{"kvc_priority":"low"}}`))
	req.Header.Set("X-Session-ID", "agent-1")
	req.Header.Set("X-KVC-Pin-Ms", "30000")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	q := <-queries
	if q.GetPinMs() != 30000 || !q.GetLowPriority() || q.GetEndSession() {
		t.Fatalf("query %v: want pin 30000, low priority", q)
	}
	if o := outcome(t, e.cp); o.GetDecisionId() != "d-turn-agent-1" || !o.GetSuccess() {
		t.Fatalf("outcome %v", o)
	}

	// Last turn: the release hint. The answer comes first, then the session end.
	resp = post(t, e.gw.URL, "/generate", "agent-1", `{"text":"done?","sampling_params":{"max_new_tokens":2},"kvc":{"release":true}}`)
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if q := <-queries; q.GetEndSession() || q.GetPinMs() != 0 || q.GetLowPriority() {
		t.Fatalf("turn query %v", q)
	}
	if q := <-queries; !q.GetEndSession() || q.GetSessionId() != "agent-1" {
		t.Fatalf("after the answer: %v, want the session end", q)
	}
	if c := <-e.d.sessions; c.Path != "/close_session" || c.SessionID != "agent-1" {
		t.Fatalf("decode worker got %+v", c)
	}
	got := map[string]bool{}
	for range 2 {
		got[outcome(t, e.cp).GetDecisionId()] = true
	}
	if !got["d-turn-agent-1"] || !got["d-end"] {
		t.Fatalf("outcomes %v: want the turn's and the session end's", got)
	}

	// Bad hints are refused before routing, with their stable code.
	for _, c := range []struct{ hdr, val, code string }{
		{"X-KVC-Pin-Ms", "forever", "invalid_pin_ms"},
		{"X-KVC-Priority", "high", "invalid_priority"},
		{"X-KVC-Release", "maybe", "invalid_release"},
	} {
		req, _ := http.NewRequest(http.MethodPost, e.gw.URL+"/generate", strings.NewReader(`{"text":"x"}`))
		req.Header.Set("X-Session-ID", "agent-2")
		req.Header.Set(c.hdr, c.val)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		code, _ := errBody(t, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(code, c.code) {
			t.Errorf("%s: %s -> %d %s, want 400 %s", c.hdr, c.val, resp.StatusCode, code, c.code)
		}
	}
	select {
	case q := <-queries:
		t.Fatalf("a bad hint reached the control plane: %v", q)
	default:
	}
}

// A release hint on a request that fails keeps the session (the agent may retry the turn): no
// session end reaches the control plane.
func TestReleaseHintSkippedOnFailure(t *testing.T) {
	queries := make(chan *kvcv1.RouteQuery, 16)
	decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
		queries <- q
		if q.GetEndSession() {
			return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Decision{Decision: &kvcv1.RouteDecision{
				RequestId: q.GetRequestId(), DecisionId: "d-end", Reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_END,
				Execution: &kvcv1.RouteExecution{},
			}}}
		}
		return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, nil, ref(d, "d0", ""), fakecp.Direct())
	}
	e := setup(t, decide, nil, func(int, workerReq) string { return "503" }, 0)
	req, _ := http.NewRequest(http.MethodPost, e.gw.URL+"/generate", strings.NewReader(`{"text":"x"}`))
	req.Header.Set("X-Session-ID", "agent-3")
	req.Header.Set("X-KVC-Release", "true")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 {
		t.Fatalf("status %d, want the worker's 503", resp.StatusCode)
	}
	if q := <-queries; q.GetEndSession() {
		t.Fatalf("first query %v", q)
	}
	// The client's own session end is the next query the control plane sees.
	if resp := post(t, e.gw.URL, "/close_session", "agent-3", ``); resp.StatusCode != 200 {
		t.Fatalf("close: %d", resp.StatusCode)
	}
	q := <-queries
	if !q.GetEndSession() {
		t.Fatalf("next query %v", q)
	}
	e.gw.Close() // waits for every handler: the release decision was taken
	if skipped, ok := testutil.ToFloat64(e.m.HintReleases.WithLabelValues("skipped_failed")), testutil.ToFloat64(e.m.HintReleases.WithLabelValues("ok")); skipped != 1 || ok != 0 {
		t.Fatalf("hint releases skipped_failed %v ok %v", skipped, ok)
	}
	select {
	case q := <-queries:
		t.Fatalf("a failed request's release hint ended the session: %v", q)
	default:
	}
}
