package server

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func errBody(t *testing.T, r io.Reader) (code, msg string) {
	t.Helper()
	var e struct {
		Error struct{ Code, Message string } `json:"error"`
	}
	raw, _ := io.ReadAll(r)
	if err := json.Unmarshal(raw, &e); err != nil {
		t.Fatalf("error body %q: %v", raw, err)
	}
	return e.Error.Code, e.Error.Message
}

func TestWorkerFailures(t *testing.T) {
	seed := decideMode(kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, fakecp.Seed())
	direct := decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct())
	snap := decideMode(kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, fakecp.ReseedSnapshot())
	always := func(b string) func(int, workerReq) string { return func(int, workerReq) string { return b } }
	tests := []struct {
		name       string
		decide     func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse
		pb, db     func(int, workerReq) string
		wantStatus int
		wantCode   string
		wantKind   kvcv1.RouteErrorKind
	}{
		{"d full", direct, nil, always("503"), 503, "no_capacity", kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D},
		{"p transfer failed", seed, always("502"), always("slow"), 502, "transfer_failed", kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED},
		{"d transfer failed", seed, nil, always("502"), 502, "transfer_failed", kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED},
		{"snapshot failed", snap, nil, always("502"), 502, "transfer_failed", kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED},
		{"d slow", direct, nil, always("slow"), 504, "timeout", kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := setup(t, tt.decide, tt.pb, tt.db, 500*time.Millisecond)
			resp := post(t, e.gw.URL, "/generate", "s1", genBody)
			code, _ := errBody(t, resp.Body)
			if resp.StatusCode != tt.wantStatus || code != tt.wantCode {
				t.Fatalf("got %d %s", resp.StatusCode, code)
			}
			if got := resp.Header.Get("X-KVC-Error-Kind"); got != strings.TrimPrefix(tt.wantKind.String(), "ROUTE_ERROR_KIND_") {
				t.Fatalf("error kind header %q", got)
			}
			o := outcome(t, e.cp)
			if o.GetSuccess() || o.GetErrorKind() != tt.wantKind {
				t.Fatalf("outcome %v", o)
			}
		})
	}
}

func TestRetryAfter409(t *testing.T) {
	n := 0
	decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
		n++ // the fake control plane answers one query at a time on one stream
		if n == 1 {
			return decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct())(q, p, d)
		}
		return decideMode(kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, kvcv1.RouteReason_ROUTE_REASON_SESSION_EVICTED, fakecp.Seed())(q, p, d)
	}
	e := setup(t, decide, nil, func(n int, _ workerReq) string {
		if n == 0 {
			return "409"
		}
		return ""
	}, 0)
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Mode") != "RESEED_PREFILL" || resp.Header.Get("X-KVC-Retries") != "1" {
		t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
	}
	if ev := sse(t, resp.Body); ev[len(ev)-1] != "[DONE]" {
		t.Fatalf("events %v", ev)
	}
	first, second := outcome(t, e.cp), outcome(t, e.cp)
	if first.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT || !second.GetSuccess() || first.GetDecisionId() == second.GetDecisionId() {
		t.Fatalf("outcomes %v / %v", first, second)
	}
}

func TestDecodeDiesMidStream(t *testing.T) {
	e := setup(t, decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct()), nil,
		func(int, workerReq) string { return "die" }, 0)
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	ev := sse(t, resp.Body)
	if len(ev) != 3 || !strings.Contains(ev[1], `"error"`) || ev[2] != "[DONE]" {
		t.Fatalf("events %v", ev)
	}
	if o := outcome(t, e.cp); o.GetSuccess() || o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR || o.GetTtftUs() <= 0 {
		t.Fatalf("outcome %v", o)
	}
}

func TestClientGoneIsAborted(t *testing.T) {
	e := setup(t, decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct()), nil,
		func(int, workerReq) string { return "slow" }, 0)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.gw.URL+"/generate", strings.NewReader(genBody))
	req.Header.Set("X-Session-ID", "s1")
	errc := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		errc <- err
	}()
	<-e.d.got // the request reached D; now the client leaves
	cancel()
	<-errc
	if o := outcome(t, e.cp); o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED {
		t.Fatalf("outcome %v", o)
	}
}

func TestFailOpen(t *testing.T) {
	tests := []struct {
		name   string
		withCP bool
	}{
		{"no control plane configured", false},
		{"control plane down", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var decide func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse
			if tt.withCP {
				decide = decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct())
			}
			e := setup(t, decide, nil, nil, 0)
			if tt.withCP {
				e.cp.Stop()
			}
			for i := 0; i < 2; i++ {
				resp := post(t, e.gw.URL, "/generate", "s1", genBody)
				if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Mode") != "PD_FALLBACK" || resp.Header.Get("X-KVC-Reason") != "CONTROL_PLANE_UNAVAILABLE" || resp.Header.Get("X-KVC-Fail-Open") != "true" {
					t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
				}
				if ev := sse(t, resp.Body); ev[len(ev)-1] != "[DONE]" {
					t.Fatalf("events %v", ev)
				}
				checkLocalFailOpen(t, e)
			}
			if got := testutil.ToFloat64(e.m.FailOpen.WithLabelValues("control_plane_unavailable")); got != 2 {
				t.Fatalf("failopen_total = %v", got)
			}
		})
	}
}

// A client that leaves the turn that opened its session on a decode worker (a seed) gets the
// session closed there (issue 23 item 5: the aborted seeds of a burst stayed on their workers as
// the most recent idle sessions and pushed the resident ones out); one that leaves a turn of a
// session already resident there (DIRECT_TO_D: nothing opened) does not.
func TestAbandonedSessionClosed(t *testing.T) {
	for _, tt := range []struct {
		name      string
		mode      kvcv1.RouteMode
		reason    kvcv1.RouteReason
		canned    fakecp.Canned
		wantClose bool
	}{
		{"seed", kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, fakecp.Seed(), true},
		{"resident turn", kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct(), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			e := setup(t, decideMode(tt.mode, tt.reason, tt.canned), nil, func(int, workerReq) string { return "slow" }, 0)
			ctx, cancel := context.WithCancel(context.Background())
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.gw.URL+"/generate", strings.NewReader(genBody))
			req.Header.Set("X-Session-ID", "s1")
			errc := make(chan error, 1)
			go func() {
				resp, err := http.DefaultClient.Do(req)
				if err == nil {
					resp.Body.Close()
				}
				errc <- err
			}()
			<-e.d.got // the request reached D; now the client leaves
			cancel()
			<-errc
			if o := outcome(t, e.cp); o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED {
				t.Fatalf("outcome %v", o)
			}
			// The close follows the outcome; without one expected, 200 ms after it shows none.
			wait := 200 * time.Millisecond
			if tt.wantClose {
				wait = 10 * time.Second
			}
			deadline := time.After(wait)
			var calls []string
			closed := false
			for !closed {
				select {
				case c := <-e.d.sessions:
					calls = append(calls, c.Path)
					if c.Path == "/close_session" {
						if c.SessionID != "s1" {
							t.Fatalf("closed %q", c.SessionID)
						}
						closed = true
					}
					continue
				case <-deadline:
				}
				break
			}
			if closed != tt.wantClose {
				t.Fatalf("session calls on D %v, want a close: %v", calls, tt.wantClose)
			}
			if got := testutil.ToFloat64(e.m.AbandonedCloses); got != b2f(tt.wantClose) {
				t.Fatalf("kvc_gateway_abandoned_sessions_closed_total = %v", got)
			}
		})
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
