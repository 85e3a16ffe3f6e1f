package server

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	"github.com/kvcentric/kvcentric/gateway/internal/routeclient"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// workerReq is what a fake worker received.
type workerReq struct {
	Stream        bool   `json:"stream"`
	BootstrapHost string `json:"bootstrap_host"`
	BootstrapPort int    `json:"bootstrap_port"`
	BootstrapRoom int64  `json:"bootstrap_room"`
	// Priority is SGLang's request priority (absent: nil).
	Priority      *int64 `json:"priority"`
	SessionParams *struct {
		ID string `json:"id"`
	} `json:"session_params"`
	Text    string          `json:"text"`
	KVHints json.RawMessage `json:"kv_hints"`
	// Payload is the kv_hints envelope's "kvc" action (kvhints.Parse); KVC its flat view.
	Payload        *kvcv1.ExecutionPayload `json:"-"`
	MessageID      string                  `json:"-"`
	KVC            kvcPayload              `json:"-"`
	OldKVC         *struct{}               `json:"kvc"` // the pre-kv_hints block: must not be sent any more
	SamplingParams struct {
		MaxNewTokens int64 `json:"max_new_tokens"`
	} `json:"sampling_params"`
}

// flatten is the tests' flat view of a payload: room, peer and transfer from the receive (D)
// or the send (P), snapshot_seqlen = a SNAPSHOT receive's tokens.
func flatten(p *kvcv1.ExecutionPayload) kvcPayload {
	k := kvcPayload{Mode: strings.TrimPrefix(p.GetMode().String(), "ROUTE_MODE_"), Role: kvhints.RoleName(p.GetRole()),
		SessionID: p.GetSessionId(), InputTokens: p.GetInputTokens(), CachedTokens: p.GetCachedTokens(),
		KeepSession: p.GetKeepSession(), OpenSession: p.GetOpenSession(), DecisionID: p.GetDecisionId(), LocalPrefill: p.GetLocalPrefill()}
	if r := p.GetReceive(); r != nil {
		k.Room, k.PrefillPeerAddr, k.PrefillPeers = r.GetRoom(), r.GetPeerAddr(), r.GetPeerAddrs()
		k.Transfer = strings.TrimPrefix(r.GetKind().String(), "TRANSFER_KIND_")
		if r.GetKind() == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
			k.SnapshotSeqlen = r.GetTokens()
		}
	}
	if s := p.GetSend(); s != nil {
		k.Room, k.Transfer = s.GetRoom(), "SEED"
		k.ToStore, k.Generation = s.GetStoreGeneration() != 0, s.GetStoreGeneration()
	}
	return k
}

type kvcPayload struct {
	Mode            string   `json:"mode"`
	Role            string   `json:"role"`
	SessionID       string   `json:"session_id"`
	InputTokens     int64    `json:"input_tokens"`
	CachedTokens    int64    `json:"cached_tokens"`
	Room            int64    `json:"room"`
	Transfer        string   `json:"transfer"`
	PrefillPeerAddr string   `json:"prefill_peer_addr"`
	PrefillPeers    []string `json:"prefill_peer_addrs"`
	SnapshotSeqlen  int64    `json:"snapshot_seqlen"`
	KeepSession     bool     `json:"keep_session"`
	OpenSession     bool     `json:"open_session"`
	DecisionID      string   `json:"decision_id"`
	LocalPrefill    bool     `json:"local_prefill"`
	ToStore         bool     `json:"to_store"`
	Generation      uint64   `json:"generation"`
}

// sessionCall is an /open_session or /close_session a fake worker received.
type sessionCall struct {
	Path      string
	SessionID string  `json:"session_id"`
	Streaming bool    `json:"streaming"`
	Timeout   float64 `json:"timeout"`
}

// fakeWorker is an SGLang-compatible worker over real HTTP. behave decides the answer to the
// n-th call (0-based): "" streams tokens; "409", "503", "502" answer that error; "503gone" a 503
// other than no_capacity; "close" drops the connection before answering; "die" drops the
// connection after one token; "slow" waits for the caller to go away.
type fakeWorker struct {
	*httptest.Server
	got      chan workerReq
	sessions chan sessionCall
	// openFails: how many /open_session calls answer 400 (the session id is taken) first
	openFails int
	mu        sync.Mutex
	n         int
	behave    func(n int, r workerReq) string
	// arrived, when set, must be closed before this (decode) worker answers: it checks that P
	// and D are called together.
	arrived chan struct{}
}

func newFakeWorker(t *testing.T, behave func(n int, r workerReq) string) *fakeWorker {
	fw := &fakeWorker{got: make(chan workerReq, 64), sessions: make(chan sessionCall, 64), behave: behave}
	fw.Server = httptest.NewServer(http.HandlerFunc(fw.serve))
	t.Cleanup(fw.Close)
	return fw
}

func writeWorkerErr(w http.ResponseWriter, status int, code string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	fmt.Fprintf(w, `{"error":{"code":%q,"message":"fake %s"}}`, code, code)
}

func (fw *fakeWorker) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/open_session" || r.URL.Path == "/close_session" {
		sc := sessionCall{Path: r.URL.Path}
		if err := json.NewDecoder(r.Body).Decode(&sc); err != nil || sc.SessionID == "" {
			writeWorkerErr(w, 400, "bad_request")
			return
		}
		fw.sessions <- sc
		fw.mu.Lock()
		fail := r.URL.Path == "/open_session" && fw.openFails > 0
		if fail {
			fw.openFails--
		}
		fw.mu.Unlock()
		if fail {
			writeWorkerErr(w, 400, "session_exists")
			return
		}
		fmt.Fprintf(w, "%q", sc.SessionID)
		return
	}
	var wr workerReq
	if err := json.NewDecoder(r.Body).Decode(&wr); err != nil || wr.OldKVC != nil {
		writeWorkerErr(w, 400, "bad_request")
		return
	}
	var env kvhints.Envelope
	pl, err := kvhints.Parse(wr.KVHints)
	if err != nil || pl == nil || json.Unmarshal(wr.KVHints, &env) != nil || len(env.Actions) != 1 {
		writeWorkerErr(w, 400, "bad_request")
		return
	}
	wr.Payload, wr.KVC, wr.MessageID = pl, flatten(pl), env.MessageID
	fw.mu.Lock()
	n := fw.n
	fw.n++
	fw.mu.Unlock()
	fw.got <- wr
	if fw.arrived != nil {
		select {
		case <-fw.arrived:
		case <-time.After(5 * time.Second):
			writeWorkerErr(w, 502, "transfer_failed") // the prefill half never came
			return
		}
	}
	b := ""
	if fw.behave != nil {
		b = fw.behave(n, wr)
	}
	switch b {
	case "409":
		writeWorkerErr(w, 409, "session_not_resident")
		return
	case "503":
		writeWorkerErr(w, 503, "no_capacity")
		return
	case "502":
		writeWorkerErr(w, 502, "transfer_failed")
		return
	case "503gone": // a worker on its way down (or the proxy in front of a dead one)
		writeWorkerErr(w, 503, "unavailable")
		return
	case "close": // the connection drops before any answer
		if hj, ok := w.(http.Hijacker); ok {
			if conn, _, err := hj.Hijack(); err == nil {
				conn.Close()
			}
		}
		return
	case "slow":
		<-r.Context().Done()
		return
	}
	if !wr.Stream {
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"text":"","meta_info":{"id":"x","prompt_tokens":%d,"completion_tokens":0}}`, wr.KVC.InputTokens)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	fl := w.(http.Flusher)
	max := wr.SamplingParams.MaxNewTokens
	for i := int64(0); i < max; i++ {
		meta := map[string]any{"prompt_tokens": wr.KVC.InputTokens, "completion_tokens": i + 1, "cached_tokens": wr.KVC.CachedTokens,
			"kvc": map[string]any{"kv_len_after": wr.KVC.InputTokens + i + 1, "received_bytes": 4096, "verified_bytes": 4096, "verify_failures": 0}}
		c, _ := json.Marshal(map[string]any{"text": fmt.Sprintf("t%d ", i), "meta_info": meta})
		fmt.Fprintf(w, "data: %s\n\n", c)
		fl.Flush()
		if b == "die" {
			hj, ok := w.(http.Hijacker)
			if ok {
				conn, _, _ := hj.Hijack()
				conn.Close()
			}
			return
		}
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

type env struct {
	cp      *fakecp.Server
	gw      *httptest.Server
	reg     *prometheus.Registry
	m       *Metrics
	p, d    *fakeWorker
	timeout time.Duration
}

// setup starts fake P and D workers, a fake control plane answering with decide (nil: no
// control plane at all), the Route client and the gateway's HTTP server.
func setup(t *testing.T, decide func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse, pb, db func(int, workerReq) string, reqTimeout time.Duration) *env {
	t.Helper()
	e := &env{p: newFakeWorker(t, pb), d: newFakeWorker(t, db), reg: prometheus.NewRegistry(), timeout: reqTimeout}
	m := NewMetrics(e.reg)
	e.m = m
	pool := workers.NewPool([]workers.Worker{{ID: "p-static", URL: e.p.URL, PeerAddr: "127.0.0.1:7777"}}, []workers.Worker{{ID: "d-static", URL: e.d.URL}})
	var router Router
	if decide != nil {
		e.cp = fakecp.Start(t, func(q *kvcv1.RouteQuery) *kvcv1.RouteResponse { return decide(q, e.p, e.d) })
		up := make(chan struct{}, 1)
		rc := routeclient.New([]string{e.cp.Addr}, time.Second, zerolog.Nop(), routeclient.Observer{Connected: func(_ string, ok bool) {
			if ok {
				select {
				case up <- struct{}{}:
				default:
				}
			}
		}})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = rc.Run(ctx); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
		select {
		case <-up:
		case <-time.After(5 * time.Second):
			t.Fatal("route stream never came up")
		}
		router = rc
	}
	if reqTimeout == 0 {
		reqTimeout = 10 * time.Second
	}
	s := New(router, pool, Options{RequestTimeout: reqTimeout, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{RequireSession: true, DefaultMaxTok: 4}}, zerolog.Nop(), m)
	mux := http.NewServeMux()
	s.Register(mux)
	e.gw = httptest.NewServer(mux)
	t.Cleanup(func() { e.gw.Close(); s.Close() })
	return e
}

func ref(w *fakeWorker, id, peer string) *kvcv1.WorkerRef {
	return &kvcv1.WorkerRef{WorkerId: id, WorkerUrl: w.URL, PeerAddr: peer}
}

// decideMode answers every query with a decision of mode and reason and the canned plan c.
func decideMode(mode kvcv1.RouteMode, reason kvcv1.RouteReason, c fakecp.Canned) func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
	return func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
		r := fakecp.Decision(q, mode, reason, ref(p, "p0", "127.0.0.1:7001"), ref(d, "d0", ""), c)
		r.GetDecision().CachedTokens = 900
		r.GetDecision().SnapshotSeqlen = 800
		return r
	}
}

func post(t *testing.T, url, path, sid, body string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url+path, strings.NewReader(body))
	if sid != "" {
		req.Header.Set("X-Session-ID", sid)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// sse reads data payloads until [DONE] or EOF.
func sse(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "data: ") {
			p := strings.TrimPrefix(l, "data: ")
			out = append(out, p)
			if p == "[DONE]" {
				break
			}
		}
	}
	return out
}

func outcome(t *testing.T, cp *fakecp.Server) *kvcv1.RouteOutcome {
	t.Helper()
	select {
	case o := <-cp.Outcomes:
		return o
	case <-time.After(5 * time.Second):
		t.Fatal("no outcome reported")
	}
	return nil
}

const genBody = `{"text":"hi","stream":true,"sampling_params":{"max_new_tokens":3},"kvc":{"input_tokens":1000,"turn":2}}`

func TestModes(t *testing.T) {
	tests := []struct {
		name        string
		mode        kvcv1.RouteMode
		reason      kvcv1.RouteReason
		plan        fakecp.Canned
		wantPrefill bool
		wantOpen    bool
		check       func(t *testing.T, pr, dr workerReq)
	}{
		{"direct", kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct(), false, false, func(t *testing.T, _, dr workerReq) {
			if dr.KVC.Mode != "DIRECT_TO_D" || dr.KVC.CachedTokens != 900 || !dr.KVC.KeepSession || dr.BootstrapRoom != 0 || dr.KVC.Role != "decode" ||
				dr.KVC.Transfer != "" || dr.SessionParams == nil || dr.SessionParams.ID != "s1" {
				t.Fatalf("decode got %+v", dr)
			}
		}},
		{"seed", kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, fakecp.Seed(), true, true, func(t *testing.T, pr, dr workerReq) {
			for _, r := range []workerReq{pr, dr} {
				if r.BootstrapRoom != 4242 || r.BootstrapHost != "127.0.0.1" || r.BootstrapPort != 7001 || r.KVC.Room != 4242 ||
					(r.KVC.Role == "decode") != (r.KVC.PrefillPeerAddr == "127.0.0.1:7001") || r.KVC.Mode != "SEED" || r.KVC.Transfer != "SEED" || r.Text != "hi" ||
					r.KVC.SessionID != "s1" || !strings.HasPrefix(r.MessageID, "d-") {
					t.Fatalf("got %+v", r)
				}
			}
			// P: full context, no session_params, the low prefill priority as SGLang's -100 (its
			// prefix evicted first: the session goes direct-to-D next); D: the session's
			// streaming session, no priority.
			if pr.Priority == nil || *pr.Priority != -100 || dr.Priority != nil {
				t.Fatalf("priority: P %v D %v", pr.Priority, dr.Priority)
			}
			if pr.KVC.Role != "prefill" || pr.Stream || pr.SessionParams != nil || dr.KVC.Role != "decode" || !dr.KVC.KeepSession ||
				!dr.KVC.OpenSession || dr.SessionParams == nil || dr.SessionParams.ID != "s1" {
				t.Fatalf("roles: %+v / %+v", pr, dr)
			}
		}},
		{"reseed prefill", kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING, fakecp.Seed(), true, true, func(t *testing.T, pr, dr workerReq) {
			if dr.KVC.Mode != "RESEED_PREFILL" || pr.KVC.Mode != "RESEED_PREFILL" || pr.SessionParams != nil || pr.Priority == nil || *pr.Priority != -100 {
				t.Fatalf("got %+v", dr)
			}
		}},
		{"pd fallback", kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY, fakecp.Fallback(), true, false, func(t *testing.T, pr, dr workerReq) {
			if dr.KVC.KeepSession || dr.SessionParams != nil || dr.KVC.SessionID != "s1" || pr.Priority != nil {
				t.Fatalf("fallback keeps no session: %+v", dr)
			}
		}},
		{"pd fallback for a large append keeps the session", kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND, fakecp.LargeAppend(), true, false, func(t *testing.T, pr, dr workerReq) {
			if !dr.KVC.KeepSession || dr.KVC.OpenSession || dr.KVC.Mode != "PD_FALLBACK" || dr.BootstrapRoom != 4242 || dr.KVC.Room != 4242 ||
				dr.KVC.SessionID != "s1" || dr.SessionParams == nil || pr.KVC.Mode != "PD_FALLBACK" || pr.KVC.Role != "prefill" || pr.SessionParams != nil ||
				pr.Priority == nil || *pr.Priority != -100 {
				t.Fatalf("large append: prefill %+v decode %+v", pr, dr)
			}
		}},
		{"reseed snapshot", kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, fakecp.ReseedSnapshot(), false, true, func(t *testing.T, _, dr workerReq) {
			if dr.KVC.Mode != "RESEED_SNAPSHOT" || dr.KVC.SnapshotSeqlen != 800 || dr.KVC.Room != 4242 || dr.KVC.PrefillPeerAddr != "127.0.0.1:7001" ||
				dr.BootstrapRoom != 0 || dr.KVC.Transfer != "SNAPSHOT" || dr.SessionParams == nil {
				t.Fatalf("got %+v", dr)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := setup(t, decideMode(tt.mode, tt.reason, tt.plan), nil, nil, 0)
			prCh := make(chan workerReq, 1)
			if tt.wantPrefill {
				e.d.arrived = make(chan struct{})
				go func() {
					r := <-e.p.got
					prCh <- r
					close(e.d.arrived)
				}()
			}
			resp := post(t, e.gw.URL, "/generate", "s1", genBody)
			if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Mode") != modeName(tt.mode) || resp.Header.Get("X-KVC-Reason") != strings.TrimPrefix(tt.reason.String(), "ROUTE_REASON_") {
				t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
			}
			events := sse(t, resp.Body)
			if len(events) != 4 || events[3] != "[DONE]" || !strings.Contains(events[2], `"received_bytes":4096`) {
				t.Fatalf("events %v", events)
			}
			q := <-e.cp.Queries
			if q.GetSessionId() != "s1" || q.GetInputTokens() != 1000 || q.GetTurn() != 2 || !q.GetMultiturnHint() || q.GetMaxOutputTokens() != 3 ||
				len(q.GetExcludeWorkers()) != 0 {
				t.Fatalf("query %v", q)
			}
			o := outcome(t, e.cp)
			if !o.GetSuccess() || o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE || o.GetKvLenAfter() != 1003 || o.GetTtftUs() <= 0 ||
				o.GetLatencyUs() < o.GetTtftUs() || o.GetExecutedMode() != tt.mode || o.GetDecisionId() == "" {
				t.Fatalf("outcome %v", o)
			}
			dr := <-e.d.got
			var pr workerReq
			if tt.wantPrefill {
				pr = <-prCh
			} else if len(e.p.got) != 0 {
				t.Fatal("prefill called for a decode-only mode")
			}
			tt.check(t, pr, dr)
			// A decision that makes the session resident on D opens its streaming session there
			// first; no other call touches sessions; P never sees a session call.
			if tt.wantOpen {
				sc := <-e.d.sessions
				if sc.Path != "/open_session" || sc.SessionID != "s1" || !sc.Streaming || sc.Timeout != DefaultSessionTimeout.Seconds() {
					t.Fatalf("session call %+v", sc)
				}
			}
			if len(e.d.sessions) != 0 || len(e.p.sessions) != 0 {
				t.Fatalf("unexpected session calls: D %d, P %d", len(e.d.sessions), len(e.p.sessions))
			}
		})
	}
}

// The gateway keeps a session only when the decision says so and the request has one: it has
// no rule of its own (a REAL_LARGE_APPEND reason without keep_session keeps nothing).
func TestKeepSession(t *testing.T) {
	withSession, anon := &api.Request{SessionID: "s1"}, &api.Request{}
	keep := &kvcv1.RouteExecution{KeepSession: true}
	for _, tc := range []struct {
		name string
		p    plan
		req  *api.Request
		want bool
	}{
		{"decision keeps", plan{mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, exec: keep}, withSession, true},
		{"decision does not keep", plan{mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: "REAL_LARGE_APPEND", exec: &kvcv1.RouteExecution{}}, withSession, false},
		{"no session", plan{mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, exec: keep}, anon, false},
		{"fail-open", plan{mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, failOpen: true, exec: failOpenExec}, withSession, false},
	} {
		if got := tc.p.keepSession(tc.req); got != tc.want {
			t.Errorf("%s: keepSession %v, want %v", tc.name, got, tc.want)
		}
	}
}

// bodyPayload is the ExecutionPayload of a worker body's kv_hints (the test fails without one).
func bodyPayload(t *testing.T, raw []byte) *kvcv1.ExecutionPayload {
	t.Helper()
	var b struct {
		KVHints json.RawMessage `json:"kv_hints"`
	}
	if err := json.Unmarshal(raw, &b); err != nil {
		t.Fatalf("body %s: %v", raw, err)
	}
	pl, err := kvhints.Parse(b.KVHints)
	if err != nil || pl == nil {
		t.Fatalf("body %s: payload %v, %v", raw, pl, err)
	}
	return pl
}
