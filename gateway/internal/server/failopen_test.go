package server

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Fail-open on every path where the control plane answers but gives no usable decision (issue
// 16: all sidecars restarting, every decode worker draining, an error after a failover): the
// gateway serves from its own worker lists — a decode worker prefills the whole request itself
// (local_prefill: no transfer, so no sidecar is needed; finding 2) — says why in X-KVC-Reason
// and kvc_gateway_failopen_total{reason}, and releases the unusable decision's reservation.
func TestFailOpenOnUnusableDecision(t *testing.T) {
	fallback := kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK
	tests := []struct {
		name       string
		decide     func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse
		reason     string // metric label
		wantReport bool   // the decision's outcome (ABORTED) is reported
	}{
		{"no decode worker (every D draining or restarting)", func(q *kvcv1.RouteQuery, p, _ *fakeWorker) *kvcv1.RouteResponse {
			return fakecp.Decision(q, fallback, kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY, ref(p, "p0", "127.0.0.1:7001"), nil, fakecp.Fallback())
		}, "no_decode_worker", true},
		{"no worker at all (every sidecar restarting)", func(q *kvcv1.RouteQuery, _, _ *fakeWorker) *kvcv1.RouteResponse {
			return fakecp.Decision(q, fallback, kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER, nil, nil, fakecp.Fallback())
		}, "no_decode_worker", true},
		{"no prefill worker for a plain P/D decision", func(q *kvcv1.RouteQuery, _, d *fakeWorker) *kvcv1.RouteResponse {
			r := fakecp.Decision(q, fallback, kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER, nil, ref(d, "d0", ""), fakecp.DecodeOnly())
			r.GetDecision().Execution.CallPrefill = true // the plan needs P but names none
			return r
		}, "no_prefill_worker", true},
		{"decode worker without a URL", func(q *kvcv1.RouteQuery, p, _ *fakeWorker) *kvcv1.RouteResponse {
			return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION,
				ref(p, "p0", "127.0.0.1:7001"), &kvcv1.WorkerRef{WorkerId: "d0"}, fakecp.Seed())
		}, "no_decode_worker", true},
		{"decision without an execution plan", func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
			r := fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, nil, ref(d, "d0", ""), fakecp.Direct())
			r.GetDecision().Execution = nil
			return r
		}, "no_execution", true},
		{"route error other than INVALID_ARGUMENT", func(q *kvcv1.RouteQuery, _, _ *fakeWorker) *kvcv1.RouteResponse {
			return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Error{Error: &kvcv1.RouteError{
				RequestId: q.GetRequestId(), Code: 14, Message: "not leading any more"}}}
		}, "route_error", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := setup(t, tt.decide, nil, nil, 0)
			resp := post(t, e.gw.URL, "/generate", "s1", genBody)
			if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Fail-Open") != "true" || resp.Header.Get("X-KVC-Mode") != "PD_FALLBACK" ||
				resp.Header.Get("X-KVC-Reason") != strings.ToUpper(tt.reason) || resp.Header.Get("X-KVC-Decode-Worker") != "d-static" {
				t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
			}
			if ev := sse(t, resp.Body); ev[len(ev)-1] != "[DONE]" {
				t.Fatalf("events %v", ev)
			}
			checkLocalFailOpen(t, e)
			if got := testutil.ToFloat64(e.m.FailOpen.WithLabelValues(tt.reason)); got != 1 {
				t.Fatalf("failopen_total{%s} = %v", tt.reason, got)
			}
			if tt.wantReport {
				o := outcome(t, e.cp)
				if o.GetSuccess() || o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED || !strings.Contains(o.GetDetail(), tt.reason) {
					t.Fatalf("unusable decision's outcome %v", o)
				}
			}
			select {
			case o := <-e.cp.Outcomes:
				t.Fatalf("fail-open request reported an outcome: %v", o)
			case <-time.After(50 * time.Millisecond):
			}
		})
	}
}

// A retry after a worker's death does not go back to it: the new query excludes it (the control
// plane then picks another worker), and a session_not_resident 409 (D alive) excludes nothing.
func TestRetryExcludesDeadWorker(t *testing.T) {
	for _, tt := range []struct {
		name    string
		deadD   bool
		behave  string
		exclude []string
	}{
		{"dead decode worker", true, "", []string{"d-bad"}},
		{"decode 503 going away", false, "503gone", []string{"d0"}},
		{"session not resident", false, "409", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			n := 0
			var bad *kvcv1.WorkerRef
			decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
				n++
				if n == 1 {
					dref := ref(d, "d0", "")
					if tt.deadD {
						if bad == nil {
							bad = &kvcv1.WorkerRef{WorkerId: "d-bad", WorkerUrl: deadURL(t)}
						}
						dref = bad
					}
					return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, nil, dref, fakecp.Direct())
				}
				return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_SESSION_EVICTED,
					ref(p, "p0", "127.0.0.1:7001"), ref(d, "d1", ""), fakecp.Seed())
			}
			e := setup(t, decide, nil, func(i int, _ workerReq) string {
				if i == 0 {
					return tt.behave
				}
				return ""
			}, 0)
			resp := post(t, e.gw.URL, "/generate", "s1", genBody)
			if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Retries") != "1" {
				t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
			}
			_ = sse(t, resp.Body)
			first, second := <-e.cp.Queries, <-e.cp.Queries
			if len(first.GetExcludeWorkers()) != 0 || strings.Join(second.GetExcludeWorkers(), ",") != strings.Join(tt.exclude, ",") {
				t.Fatalf("excludes: first %v, second %v, want %v", first.GetExcludeWorkers(), second.GetExcludeWorkers(), tt.exclude)
			}
		})
	}
}

// A fail-open retry after a decision's dead worker skips that worker in round robin too.
func TestRetryFailOpenAfterDecisionSkipsDeadWorker(t *testing.T) {
	n := 0
	var deadD *fakeWorker
	decide := func(q *kvcv1.RouteQuery, p, _ *fakeWorker) *kvcv1.RouteResponse {
		n++
		if n == 1 {
			return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, nil,
				ref(deadD, "d-static", ""), fakecp.Direct())
		}
		// The retry's decision has no decode worker: fail open.
		return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY, ref(p, "p0", "127.0.0.1:7001"), nil, fakecp.Fallback())
	}
	e := setup(t, decide, nil, func(int, workerReq) string { return "close" }, 0)
	deadD = e.d // the pool's only decode worker drops every connection
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	code, _ := errBody(t, resp.Body)
	// The pool has no other decode worker: the first attempt's error stands, and the dead
	// worker got exactly one call.
	if resp.StatusCode != 502 || code != "worker_unreachable" || resp.Header.Get("X-KVC-Error-Kind") != "REJECTED_BY_D" {
		t.Fatalf("got %d %s headers %v", resp.StatusCode, code, resp.Header)
	}
	if got := len(e.d.got); got != 1 {
		t.Fatalf("dead decode worker called %d times, want 1", got)
	}
}

// A decision that moves the session off a decode worker closes it there after the request
// succeeded (in the background); a failed request closes nothing.
func TestCloseSessionOnMove(t *testing.T) {
	for _, fail := range []bool{false, true} {
		old := newFakeWorker(t, nil)
		decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
			r := fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS,
				ref(p, "p0", "127.0.0.1:7001"), ref(d, "d1", ""), fakecp.ReseedSnapshot())
			r.GetDecision().SnapshotSeqlen = 800
			r.GetDecision().Execution.CloseSessionOn = []*kvcv1.WorkerRef{ref(old, "d-old", "")}
			return r
		}
		db := func(int, workerReq) string { return "" }
		if fail {
			db = func(int, workerReq) string { return "502" }
		}
		e := setup(t, decide, nil, db, 0)
		resp := post(t, e.gw.URL, "/generate", "s1", genBody)
		_ = sse(t, resp.Body)
		if open := <-e.d.sessions; open.Path != "/open_session" {
			t.Fatalf("new D got %+v", open)
		}
		if fail {
			select {
			case c := <-old.sessions:
				t.Fatalf("failed request closed the session on the old D: %+v", c)
			case <-time.After(100 * time.Millisecond):
			}
			continue
		}
		select {
		case c := <-old.sessions:
			if c.Path != "/close_session" || c.SessionID != "s1" {
				t.Fatalf("old D got %+v", c)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("old D's session never closed")
		}
	}
}

// A decode worker that refuses open_session (it still holds the id) gets it closed and opened
// again: the decision's KV replaces the stale copy.
func TestOpenSessionReplacesStaleCopy(t *testing.T) {
	e := setup(t, decideMode(kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, fakecp.ReseedSnapshot()), nil, nil, 0)
	e.d.openFails = 1
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	_ = sse(t, resp.Body)
	var paths []string
	for i := 0; i < 3; i++ {
		paths = append(paths, (<-e.d.sessions).Path)
	}
	if strings.Join(paths, " ") != "/open_session /close_session /open_session" {
		t.Fatalf("session calls %v", paths)
	}
	if got := testutil.ToFloat64(e.m.SessionCalls.WithLabelValues("open_session", "error")); got != 1 {
		t.Fatalf("open errors %v", got)
	}
}

// The gateway reports what the plan says and retries only when it allows: the kinds follow
// RouteExecution, not the mode (a SEED-mode decision whose plan says SNAPSHOT_FAILED reports
// that; a plan without retry_allowed is not retried).
func TestFailureKindsFollowThePlan(t *testing.T) {
	always := func(b string) func(int, workerReq) string { return func(int, workerReq) string { return b } }
	for _, tt := range []struct {
		name     string
		mutate   func(e *kvcv1.RouteExecution)
		db       func(int, workerReq) string
		wantKind kvcv1.RouteErrorKind
		wantN    int // decisions asked for
	}{
		{"refused kind from the plan", func(e *kvcv1.RouteExecution) {
			e.OnDecodeRefused = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR
		}, always("503"), kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, 1},
		{"transfer kind from the plan (a failed transfer is retried once)", func(e *kvcv1.RouteExecution) {
			e.OnTransferFailed = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED
		}, always("502"), kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED, 2},
		{"no transfer retry when the plan forbids it", func(e *kvcv1.RouteExecution) { e.RetryAllowed = false },
			always("502"), kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED, 1},
		{"no retry when the plan forbids it", func(e *kvcv1.RouteExecution) { e.RetryAllowed = false },
			always("503gone"), kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 1},
		{"retry when the plan allows it", func(*kvcv1.RouteExecution) {},
			func(n int, _ workerReq) string {
				if n == 0 {
					return "503gone"
				}
				return ""
			}, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			n := 0
			decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
				n++
				r := fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, ref(p, "p0", "127.0.0.1:7001"), ref(d, "d0", ""), fakecp.Seed())
				tt.mutate(r.GetDecision().Execution)
				return r
			}
			e := setup(t, decide, nil, tt.db, 2*time.Second)
			resp := post(t, e.gw.URL, "/generate", "s1", genBody)
			_ = sse(t, resp.Body)
			if o := outcome(t, e.cp); o.GetSuccess() || o.GetErrorKind() != tt.wantKind {
				t.Fatalf("outcome %v, want %v", o, tt.wantKind)
			}
			if n != tt.wantN {
				t.Fatalf("%d decisions, want %d", n, tt.wantN)
			}
		})
	}
}

// checkLocalFailOpen: the fail-open request went to the decode worker alone, as a local prefill
// of the whole request that keeps nothing (no room, no transfer, no prefill worker).
func checkLocalFailOpen(t *testing.T, e *env) {
	t.Helper()
	dr := <-e.d.got
	if dr.KVC.Mode != "PD_FALLBACK" || !dr.KVC.LocalPrefill || dr.KVC.Transfer != "" || dr.KVC.Room != 0 || dr.BootstrapRoom != 0 ||
		dr.KVC.KeepSession || dr.SessionParams != nil || dr.KVC.PrefillPeerAddr != "" {
		t.Fatalf("d %+v", dr)
	}
	select {
	case pr := <-e.p.got:
		t.Fatalf("fail-open called the prefill worker: %+v", pr)
	default:
	}
}

// A transfer that fails before D's first token (a sidecar restarting or killed mid-transfer,
// issue 16 finding 4) is retried once through a new decision that excludes both ends of the
// transfer; the control plane hears the failure first.
func TestRetryAfterTransferFailure(t *testing.T) {
	for _, tt := range []struct {
		name   string
		pb, db func(int, workerReq) string
	}{
		{"decode side", nil, func(i int, _ workerReq) string {
			if i == 0 {
				return "502"
			}
			return ""
		}},
		{"prefill side", func(i int, _ workerReq) string {
			if i == 0 {
				return "502"
			}
			return ""
		}, func(_ int, wr workerReq) string {
			if wr.KVC.PrefillPeerAddr == "127.0.0.1:7001" {
				return "slow" // waits for the first decision's transfer, which fails on P
			}
			return ""
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			n := 0
			decide := func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
				n++
				if n == 1 {
					return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, ref(p, "p0", "127.0.0.1:7001"), ref(d, "d0", ""), fakecp.Seed())
				}
				return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, ref(p, "p1", "127.0.0.1:7002"), ref(d, "d1", ""), fakecp.Seed())
			}
			e := setup(t, decide, tt.pb, tt.db, 2*time.Second)
			resp := post(t, e.gw.URL, "/generate", "s1", genBody)
			if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Retries") != "1" || resp.Header.Get("X-KVC-Decode-Worker") != "d1" {
				t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
			}
			if ev := sse(t, resp.Body); ev[len(ev)-1] != "[DONE]" {
				t.Fatalf("events %v", ev)
			}
			first, second := <-e.cp.Queries, <-e.cp.Queries
			if len(first.GetExcludeWorkers()) != 0 || strings.Join(second.GetExcludeWorkers(), ",") != "p0,d0" {
				t.Fatalf("excludes: first %v, second %v", first.GetExcludeWorkers(), second.GetExcludeWorkers())
			}
			if o := outcome(t, e.cp); o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED {
				t.Fatalf("first outcome %v", o)
			}
			if o := outcome(t, e.cp); !o.GetSuccess() {
				t.Fatalf("second outcome %v", o)
			}
			if got := testutil.ToFloat64(e.m.Retries.WithLabelValues("transfer_failed")); got != 1 {
				t.Fatalf("retries{transfer_failed} = %v", got)
			}
		})
	}
}

// A new session the control plane refuses (RESOURCE_EXHAUSTED: every decode worker at its
// new-session bound, controlplane policy/newsession.go) is answered 503 no_d_capacity with
// Retry-After, not failed open onto a decode worker that would evict resident sessions for it
// (issue 23 item 5); no worker is called and no outcome reported. Before, the gateway failed it
// open (route_error) like any other error.
func TestRefusedNewSessionNotFailedOpen(t *testing.T) {
	e := setup(t, func(q *kvcv1.RouteQuery, _, _ *fakeWorker) *kvcv1.RouteResponse {
		return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Error{Error: &kvcv1.RouteError{
			RequestId: q.GetRequestId(), Code: 8, Message: "NO_D_CAPACITY: no decode worker has room"}}}
	}, nil, nil, 0)
	resp := post(t, e.gw.URL, "/generate", "s1", genBody)
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	body := string(b)
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") != "1" || !strings.Contains(body, `"code":"no_d_capacity"`) ||
		!strings.Contains(body, "NO_D_CAPACITY") {
		t.Fatalf("status %d Retry-After %q body %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if got := testutil.ToFloat64(e.m.FailOpen.WithLabelValues("route_error")); got != 0 {
		t.Fatalf("failopen_total{route_error} = %v", got)
	}
	if got := testutil.ToFloat64(e.m.BadRequests.WithLabelValues(CodeNoDCapacity)); got != 1 {
		t.Fatalf("bad_requests_total{no_d_capacity} = %v", got)
	}
	select {
	case dr := <-e.d.got:
		t.Fatalf("a refused query called the decode worker: %+v", dr)
	case o := <-e.cp.Outcomes:
		t.Fatalf("a refused query reported an outcome: %v", o)
	case <-time.After(50 * time.Millisecond):
	}
}
