package worker

import (
	"bufio"
	"bytes"
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
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/launch"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type testWorker struct {
	w   *Worker
	sc  *fakeSidecar
	url string
}

func newTestWorker(t *testing.T, h *hub, role kvcv1.WorkerRole, id string, capacityTokens int64, tm Timing) *testWorker {
	t.Helper()
	return newTestWorkerCfg(t, h, role, id, capacityTokens, tm, 0)
}

func newTestWorkerCfg(t *testing.T, h *hub, role kvcv1.WorkerRole, id string, capacityTokens int64, tm Timing, preallocWait time.Duration) *testWorker {
	t.Helper()
	sc, bridge := startFakeSidecar(t, h, id)
	g := Geometry{PageSize: 4, Layers: 3, BytesPerToken: 8, PageCount: capacityTokens / 4}
	pool, err := CreatePool(t.TempDir(), id, g)
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(Config{Role: role, WorkerID: id, Geometry: g, Timing: tm, TransferTimeout: 5 * time.Second, PreallocWait: preallocWait},
		pool, bridge, prometheus.NewRegistry(), zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := w.RegisterPool(ctx); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	w.Register(mux)
	srv := httptest.NewServer(mux)
	t.Cleanup(func() {
		srv.Close()
		_ = w.Close()
	})
	return &testWorker{w: w, sc: sc, url: srv.URL}
}

func zeroTiming() Timing {
	tm := DefaultTiming()
	tm.Scale = 0
	return tm
}

type kvcReq struct {
	Mode         string `json:"mode"`
	Role         string `json:"role"`
	SessionID    string `json:"session_id,omitempty"`
	InputTokens  int64  `json:"input_tokens"`
	CachedTokens int64  `json:"cached_tokens"`
	Room         *int64 `json:"room,omitempty"`
	Seqlen       int64  `json:"snapshot_seqlen,omitempty"`
	Keep         *bool  `json:"keep_session,omitempty"`
	LocalPrefill *bool  `json:"local_prefill,omitempty"`
	LoadPrefix   int64  `json:"load_prefix_tokens,omitempty"`
	ReceiveFrom  int64  `json:"receive_from,omitempty"`
}

func body(rid string, maxNew int64, stream bool, k kvcReq) []byte {
	return genBody(k.payload(), map[string]any{"rid": rid, "text": "hello", "stream": stream,
		"sampling_params": map[string]any{"max_new_tokens": maxNew}})
}

type result struct {
	status int
	code   string
	ans    answer
	chunks []answer
}

func post(t *testing.T, ctx context.Context, url string, b []byte) result {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/generate", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return result{status: -1, code: err.Error()}
	}
	defer resp.Body.Close()
	r := result{status: resp.StatusCode}
	if resp.StatusCode != http.StatusOK {
		var e struct {
			Error struct{ Code, Message string }
		}
		raw, _ := io.ReadAll(resp.Body)
		if err := json.Unmarshal(raw, &e); err != nil {
			t.Fatalf("error body %q: %v", raw, err)
		}
		r.code = e.Error.Code
		if r.code == "" || e.Error.Message == "" {
			t.Fatalf("error without code or message: %s", raw)
		}
		return r
	}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		sc := bufio.NewScanner(resp.Body)
		sawDone := false
		for sc.Scan() {
			line := sc.Text()
			if line == "" {
				continue
			}
			data, ok := strings.CutPrefix(line, "data: ")
			if !ok {
				t.Fatalf("bad SSE line %q", line)
			}
			if data == "[DONE]" {
				sawDone = true
				continue
			}
			var a answer
			if err := json.Unmarshal([]byte(data), &a); err != nil {
				t.Fatalf("chunk %q: %v", data, err)
			}
			r.chunks = append(r.chunks, a)
		}
		if !sawDone || len(r.chunks) == 0 {
			t.Fatalf("stream without [DONE] or chunks: %d chunks", len(r.chunks))
		}
		r.ans = r.chunks[len(r.chunks)-1]
		return r
	}
	if err := json.NewDecoder(resp.Body).Decode(&r.ans); err != nil {
		t.Fatal(err)
	}
	return r
}

func i64(v int64) *int64 { return &v }
func bptr(v bool) *bool  { return &v }

// pd runs one request the way SGLang's P/D router does: the same body to P and D at once.
func pd(t *testing.T, p, d *testWorker, rid string, maxNew int64, k kvcReq) (pr, dr result) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	kp, kd := k, k
	kp.Role, kd.Role = "prefill", "decode"
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		pr = post(t, ctx, p.url, body(rid, maxNew, false, kp))
	}()
	dr = post(t, ctx, d.url, body(rid, maxNew, false, kd))
	if dr.status != http.StatusOK {
		cancel() // as a router would: the decode half failed, abandon the prefill half
	}
	wg.Wait()
	return pr, dr
}

func sessionsOf(t *testing.T, tw *testWorker) map[string]SessionInfo {
	out := map[string]SessionInfo{}
	for _, s := range tw.w.Sessions() {
		out[s.SessionID] = s
	}
	return out
}

func TestSeedThenDirectToD(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())

	pr, dr := pd(t, p, d, "r1", 10, kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 101, Room: i64(1)})
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("seed: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	k := dr.ans.MetaInfo.KVC
	wantBytes := int64(101 * 6 * 8)
	if k.ReceivedBytes != wantBytes || k.VerifiedBytes != wantBytes || k.VerifyFailures != 0 || k.KVLenAfter != 111 {
		t.Fatalf("seed meta %+v, want %d bytes received and verified, kv 111", k, wantBytes)
	}
	if pr.ans.MetaInfo.KVC.SentBytes != wantBytes || pr.ans.MetaInfo.KVC.PrefillTokens != 101 {
		t.Fatalf("prefill meta %+v", pr.ans.MetaInfo.KVC)
	}
	if dr.ans.MetaInfo.CompletionTokens != 10 || strings.Count(dr.ans.Text, " t") != 10 {
		t.Fatalf("answer %+v", dr.ans)
	}
	if st := p.w.stats(); st.FreePages != st.PageCount {
		t.Fatalf("prefill worker holds pages after the transfer: %+v", st)
	}
	commits, _ := d.sc.snapshotOf()
	if len(commits) != 1 || commits[0].GetCommittedLen() != 111 || len(commits[0].GetPages()) != 28 {
		t.Fatalf("commits %v", commits)
	}

	// Turn 2: direct-to-D, streaming, appending 40 tokens.
	res := post(t, context.Background(), d.url, body("r2", 5, true,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "s1", InputTokens: 151, CachedTokens: 111}))
	if res.status != 200 {
		t.Fatalf("direct: %d %s", res.status, res.code)
	}
	if len(res.chunks) != 5 {
		t.Fatalf("%d chunks, want 5 (one per token)", len(res.chunks))
	}
	last := res.ans.MetaInfo
	if last.KVC.PrefillTokens != 40 || last.KVC.KVLenAfter != 156 || last.KVC.ReceivedBytes != 0 || last.FinishReason == nil {
		t.Fatalf("direct meta %+v kvc %+v", last, last.KVC)
	}
	commits, _ = d.sc.snapshotOf()
	if len(commits) != 2 || commits[1].GetCommittedLen() != 156 || len(commits[1].GetPages()) != 39 {
		t.Fatalf("commits after turn 2: %v", commits)
	}
	// The fake sidecar copied the committed KV out: every byte must be the known pattern, which
	// the receiving side of a reseed checks below.
	d2 := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d1", 4096, zeroTiming())
	res = post(t, context.Background(), d2.url, body("r3", 3, false,
		kvcReq{Mode: "RESEED_SNAPSHOT", Role: "decode", SessionID: "s1", InputTokens: 170, CachedTokens: 156, Room: i64(2), Seqlen: 156}))
	if res.status != 200 {
		t.Fatalf("reseed: %d %s", res.status, res.code)
	}
	k = res.ans.MetaInfo.KVC
	if k.VerifiedBytes != 156*48 || k.VerifyFailures != 0 || k.PrefillTokens != 14 || k.KVLenAfter != 173 {
		t.Fatalf("reseed meta %+v", k)
	}

	// The worker's own answer on a session it does not hold: 409.
	res = post(t, context.Background(), d2.url, body("r4", 3, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "nope", InputTokens: 10, CachedTokens: 5}))
	if res.status != http.StatusConflict || res.code != "session_not_resident" {
		t.Fatalf("direct to unknown session: %d %s", res.status, res.code)
	}
	// cached_tokens beyond what D holds: 409 too.
	res = post(t, context.Background(), d2.url, body("r5", 3, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "s1", InputTokens: 400, CachedTokens: 300}))
	if res.status != http.StatusConflict || res.code != "session_not_resident" {
		t.Fatalf("direct beyond kv_len: %d %s", res.status, res.code)
	}
	if s := sessionsOf(t, d2)["s1"]; s.KVLen != 173 {
		t.Fatalf("a rejected turn changed the session: %+v", s)
	}
}

func TestSingleShotFallbackFreesPages(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 1024, zeroTiming())
	pr, dr := pd(t, p, d, "single-1", 4, kvcReq{Mode: "PD_FALLBACK", InputTokens: 50, Room: i64(9)})
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	if dr.ans.MetaInfo.KVC.VerifiedBytes != 50*48 {
		t.Fatalf("meta %+v", dr.ans.MetaInfo.KVC)
	}
	if st := d.w.stats(); st.FreePages != st.PageCount || st.Sessions != 0 {
		t.Fatalf("single-shot request left state: %+v", st)
	}
	if commits, _ := d.sc.snapshotOf(); len(commits) != 0 {
		t.Fatalf("single-shot request committed: %v", commits)
	}
}

func TestLRUEvictionAndCapacityRejection(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 256, zeroTiming()) // 64 pages
	seed := func(sess string, room, input int64) (result, result) {
		return pd(t, p, d, "r-"+sess, 0, kvcReq{Mode: "SEED", SessionID: sess, InputTokens: input, Room: i64(room)})
	}
	for i, s := range []string{"a", "b", "c"} { // 3 × 80 tokens = 60 pages
		if _, dr := seed(s, int64(i+1), 80); dr.status != 200 {
			t.Fatalf("seed %s: %d %s", s, dr.status, dr.code)
		}
	}
	// Touch a, so b is the least recently used.
	if r := post(t, context.Background(), d.url, body("ra", 0, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "a", InputTokens: 80, CachedTokens: 80})); r.status != 200 {
		t.Fatalf("direct a: %d %s", r.status, r.code)
	}
	_, dr := seed("e", 10, 60) // needs 15 pages, 4 free: evict b (20 pages)
	if dr.status != 200 || dr.ans.MetaInfo.KVC.EvictedSessions != 1 {
		t.Fatalf("seed e: %d %s %+v", dr.status, dr.code, dr.ans.MetaInfo.KVC)
	}
	ss := sessionsOf(t, d)
	if _, ok := ss["b"]; ok || len(ss) != 3 {
		t.Fatalf("after eviction: %v", ss)
	}
	_, rel := d.sc.snapshotOf()
	if len(rel) != 1 || rel[0].GetSessionId() != "b" || rel[0].GetReason() != kvcv1.ReleaseReason_RELEASE_REASON_EVICTED {
		t.Fatalf("releases %v", rel)
	}
	if r := post(t, context.Background(), d.url, body("rb", 1, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "b", InputTokens: 90, CachedTokens: 80})); r.status != http.StatusConflict {
		t.Fatalf("direct to evicted b: %d %s", r.status, r.code)
	}

	// Pin pages: a seed whose sender never comes holds its pages (the request is running), and
	// evicts everything else to get them. Another request then cannot get room: 503 no_capacity.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan result, 1)
	go func() {
		done <- post(t, ctx, d.url, body("big", 8, false,
			kvcReq{Mode: "SEED", Role: "decode", SessionID: "big", InputTokens: 200, Room: i64(50)}))
	}()
	waitFor(t, func() bool { return sessionsOf(t, d)["big"].Pinned == 1 })
	if ss := sessionsOf(t, d); len(ss) != 1 || ss["big"].Pages != 52 {
		t.Fatalf("sessions while big runs: %v", ss)
	}
	_, dr = seed("f", 20, 60)
	if dr.status != http.StatusServiceUnavailable || dr.code != "no_capacity" {
		t.Fatalf("want no_capacity, got %d %s", dr.status, dr.code)
	}
	cancel()
	<-done
	waitFor(t, func() bool { st := d.w.stats(); return st.FreePages == st.PageCount && st.Sessions == 0 })
}

// waitFor polls cond until it holds, failing the test after 10 s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	launch.WaitForT(t, "the condition", 10*time.Second, time.Millisecond, cond)
}

func TestVerifyFailureAndTransferFailure(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 1024, zeroTiming())
	h.corrupt = true
	_, dr := pd(t, p, d, "r1", 2, kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 33, Room: i64(1)})
	if dr.status != http.StatusInternalServerError || dr.code != "kv_verify_failed" {
		t.Fatalf("corrupted transfer: %d %s", dr.status, dr.code)
	}
	if st := d.w.stats(); st.FreePages != st.PageCount || st.Sessions != 0 {
		t.Fatalf("failed seed left state: %+v", st)
	}
	h.corrupt = false
	// No sender ever comes: the sidecar's wait fails, the worker answers 502.
	h.wait = 100 * time.Millisecond
	res := post(t, context.Background(), d.url, body("r2", 2, false, kvcReq{Mode: "SEED", Role: "decode", SessionID: "s2", InputTokens: 10, Room: i64(2)}))
	if res.status != http.StatusBadGateway || res.code != "transfer_failed" {
		t.Fatalf("missing sender: %d %s", res.status, res.code)
	}
	// Snapshot missing: 502 as well.
	res = post(t, context.Background(), d.url, body("r3", 2, false,
		kvcReq{Mode: "RESEED_SNAPSHOT", Role: "decode", SessionID: "zz", InputTokens: 10, Seqlen: 8, Room: i64(3)}))
	if res.status != http.StatusBadGateway || res.code != "transfer_failed" {
		t.Fatalf("missing snapshot: %d %s", res.status, res.code)
	}
}

func TestBadInput(t *testing.T) {
	h := newHub()
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 1024, zeroTiming())
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	tests := []struct {
		name string
		url  string
		body string
	}{
		{"malformed json", d.url, `{"kv_hints": `},
		{"not an object", d.url, `[1,2]`},
		{"trailing data", d.url, `{"text":"x"} {}`},
		{"no decision", d.url, `{"text":"x","bootstrap_room":1}`},
		{"mode-name payload (action version 1)", d.url, `{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":1,"payload":{"mode":"SEED","session_id":"s","input_tokens":10,"room":1}}]}}`},
		{"unknown field", d.url, `{` + envelope(`{"session_id":"s","input_tokens":5,"transfer":"SEED"}`) + `}`},
		{"no input", d.url, `{` + envelope(`{"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`},
		{"missing session id", d.url, `{` + envelope(`{"input_tokens":10,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`},
		{"nothing to serve from", d.url, `{` + envelope(`{"session_id":"s","input_tokens":10}`) + `}`},
		{"open without keep", d.url, `{` + envelope(`{"session_id":"s","input_tokens":10,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`},
		{"absurd input", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":999999999999,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`},
		{"negative input", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":-5,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`},
		{"absurd output", d.url, `{"sampling_params":{"max_new_tokens":99999999},"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`},
		{"cached > input", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"cached_tokens":6,"keep_session":true}`) + `}`},
		{"unknown mode", d.url, `{` + envelope(`{"mode":"ROUTE_MODE_TELEPORT","session_id":"s","input_tokens":5}`) + `}`},
		{"receive without a kind", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"receive":{"room":"1"}}`) + `}`},
		{"wrong role", d.url, `{` + envelope(`{"role":"WORKER_ROLE_PREFILL","session_id":"s","input_tokens":5,"send":{"room":"1"}}`) + `}`},
		{"send on decode", d.url, `{` + envelope(`{"session_id":"s","input_tokens":5,"local_prefill":true,"send":{"room":"1"}}`) + `}`},
		{"negative room", d.url, `{"bootstrap_room":-1,"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED"}}`) + `}`},
		{"rooms differ", d.url, `{"bootstrap_room":2,"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3"}}`) + `}`},
		{"sessions differ", d.url, `{"session_params":{"id":"a"},` + envelope(`{"session_id":"b","input_tokens":5,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3"}}`) + `}`},
		{"bad session id", d.url, `{"session_params":{"id":"a/b"},` + envelope(`{"session_id":"a/b","input_tokens":5,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3"}}`) + `}`},
		{"snapshot longer than the prompt", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SNAPSHOT","room":"3","tokens":"9"}}`) + `}`},
		{"empty snapshot", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SNAPSHOT","room":"3"}}`) + `}`},
		{"seed of part of the prompt", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3","tokens":"4"}}`) + `}`},
		{"truncate with a receive", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"cached_tokens":4,"truncate_to":4,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3"}}`) + `}`},
		{"suffix receive into a new session", d.url, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":50,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3","from_token":"16"}}`) + `}`},
		{"batch text", d.url, `{"text":["a","b"],"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":5,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3"}}`) + `}`},
		{"prefill without a send", p.url, `{` + envelope(`{"session_id":"s","input_tokens":5}`) + `}`},
		{"receive on prefill", p.url, `{` + envelope(`{"session_id":"s","input_tokens":5,"send":{"room":"1"},"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := post(t, context.Background(), tt.url, []byte(tt.body))
			if res.status != http.StatusBadRequest || res.code != "bad_request" {
				t.Fatalf("got %d %s, want 400 bad_request", res.status, res.code)
			}
		})
	}
	// The other endpoints.
	for _, path := range []string{"/health", "/get_model_info", "/kvc/sessions"} {
		resp, err := http.Get(d.url + path)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: %v %v", path, err, resp)
		}
		resp.Body.Close()
	}
}

func TestTimingModelApplied(t *testing.T) {
	h := newHub()
	tm := DefaultTiming()
	tm.Scale = 0.05 // 2000 tokens: 115 ms × 0.05 ≈ 5.75 ms prefill
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, tm)
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, tm)
	pr, dr := pd(t, p, d, "r1", 3, kvcReq{Mode: "SEED", SessionID: "s", InputTokens: 2000, Room: i64(1)})
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("P %d %s D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	if got, want := pr.ans.MetaInfo.KVC.PrefillMS, ms(tm.Prefill(2000)); got < want {
		t.Fatalf("prefill took %v ms, less than the model's %v ms", got, want)
	}
	if got, want := dr.ans.MetaInfo.KVC.TransferModelMS, ms(tm.Transfer(2000)); got < want {
		t.Fatalf("modeled transfer %v ms, less than the model's %v ms", got, want)
	}
	if dr.ans.MetaInfo.E2ELatency < (3 * tm.Decode()).Seconds() {
		t.Fatalf("latency %v below 3 decode steps", dr.ans.MetaInfo.E2ELatency)
	}
}

// noRoom: D answered 503 no_capacity, which is right when every other session's pages are
// pinned by a running request (8 sessions of up to 45 pages share 256; with no prealloc wait D
// rejects at once). How often that happens depends on how the requests overlap, i.e. on the
// machine's load: the test accepts it and checks what must hold whatever the interleaving.
func noRoom(r result) bool {
	return r.status == http.StatusServiceUnavailable && r.code == "no_capacity"
}

func TestConcurrentSessions(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 2048, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 1024, zeroTiming())
	var wg sync.WaitGroup
	errs := make(chan string, 64)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sess := fmt.Sprintf("s%d", i)
			_, dr := pd(t, p, d, sess+"-0", 4, kvcReq{Mode: "SEED", SessionID: sess, InputTokens: 100, Room: i64(int64(100 + i))})
			switch {
			case dr.status == 200:
			case noRoom(dr):
				return
			default:
				errs <- fmt.Sprintf("%s seed: %d %s", sess, dr.status, dr.code)
				return
			}
			kv := int64(104)
			for turn := 1; turn < 4; turn++ {
				r := post(t, context.Background(), d.url, body(fmt.Sprintf("%s-%d", sess, turn), 4, turn%2 == 0,
					kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: sess, InputTokens: kv + 20, CachedTokens: kv}))
				switch {
				case r.status == 200:
					kv += 24
				case r.status == http.StatusConflict: // evicted by another session: fine
					return
				case noRoom(r):
					return
				default:
					errs <- fmt.Sprintf("%s turn %d: %d %s", sess, turn, r.status, r.code)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	st := d.w.stats()
	used := int64(0)
	for _, s := range d.w.Sessions() {
		used += int64(s.Pages)
		if s.Pinned != 0 {
			t.Errorf("session %s still pinned", s.SessionID)
		}
	}
	if used+st.FreePages != st.PageCount {
		t.Fatalf("pages leaked: %d used + %d free != %d", used, st.FreePages, st.PageCount)
	}
}

// An evicted session's pages are freed only after ReleaseSession returned (the sidecar may be
// reading them for a snapshot push until then).
func TestEvictionFreesPagesOnlyAfterRelease(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 256, zeroTiming()) // 64 pages
	if _, dr := pd(t, p, d, "ra", 0, kvcReq{Mode: "SEED", SessionID: "a", InputTokens: 160, Room: i64(1)}); dr.status != 200 {
		t.Fatalf("seed a: %d %s", dr.status, dr.code)
	}
	gate := make(chan struct{})
	d.sc.mu.Lock()
	d.sc.releaseGate, d.sc.releasing = gate, make(chan string, 1)
	d.sc.mu.Unlock()
	done := make(chan result, 1)
	go func() {
		_, dr := pd(t, p, d, "rb", 0, kvcReq{Mode: "SEED", SessionID: "b", InputTokens: 160, Room: i64(2)})
		done <- dr
	}()
	if got := <-d.sc.releasing; got != "a" {
		t.Fatalf("released %q, want a", got)
	}
	// Release is in progress: a is no longer resident, but its 40 pages are not free yet.
	if _, ok := sessionsOf(t, d)["a"]; ok {
		t.Fatal("a still resident while being evicted")
	}
	if st := d.w.stats(); st.FreePages != 24 {
		t.Fatalf("%d pages free during the release, want 24 (a's 40 still held)", st.FreePages)
	}
	select {
	case r := <-done:
		t.Fatalf("b finished before a's release returned: %+v", r)
	default:
	}
	close(gate)
	if r := <-done; r.status != 200 || r.ans.MetaInfo.KVC.EvictedSessions != 1 {
		t.Fatalf("seed b: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	_, rel := d.sc.snapshotOf()
	if len(rel) != 1 || rel[0].GetReason() != kvcv1.ReleaseReason_RELEASE_REASON_EVICTED {
		t.Fatalf("releases %v", rel)
	}
}

// The sidecar dies mid-run: transfers fail with a clear 502, a resident session still serves
// direct-to-D (its KV is local), nothing hangs or panics.
func TestSidecarDies(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 1024, zeroTiming())
	if _, dr := pd(t, p, d, "r1", 2, kvcReq{Mode: "SEED", SessionID: "s", InputTokens: 50, Room: i64(1)}); dr.status != 200 {
		t.Fatalf("seed: %d %s", dr.status, dr.code)
	}
	d.sc.stop()
	p.sc.stop()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res := post(t, ctx, d.url, body("r2", 2, false, kvcReq{Mode: "SEED", Role: "decode", SessionID: "s2", InputTokens: 10, Room: i64(2)}))
	if res.status != http.StatusBadGateway || res.code != "transfer_failed" {
		t.Fatalf("seed with a dead sidecar: %d %s", res.status, res.code)
	}
	res = post(t, ctx, p.url, body("r3", 2, false, kvcReq{Mode: "SEED", Role: "prefill", SessionID: "s3", InputTokens: 10, Room: i64(3)}))
	if res.status != http.StatusBadGateway || res.code != "transfer_failed" {
		t.Fatalf("prefill with a dead sidecar: %d %s", res.status, res.code)
	}
	res = post(t, ctx, d.url, body("r4", 2, false, kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "s", InputTokens: 60, CachedTokens: 52}))
	if res.status != http.StatusOK || res.ans.MetaInfo.KVC.KVLenAfter != 62 {
		t.Fatalf("direct with a dead sidecar: %d %s", res.status, res.code)
	}
	if st := d.w.stats(); st.FreePages+int64(sessionsOf(t, d)["s"].Pages) != st.PageCount {
		t.Fatalf("pages leaked: %+v", st)
	}
}

// With a prealloc wait, a request that cannot get pages (all pinned by a running request) waits
// for them instead of failing, like SGLang's decode prealloc queue.
func TestPreallocWait(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 256, zeroTiming(), 20*time.Second) // 64 pages
	ctx, cancel := context.WithCancel(context.Background())
	bigDone := make(chan result, 1)
	go func() { // holds 52 pages until cancelled: its sender never comes
		bigDone <- post(t, ctx, d.url, body("big", 8, false,
			kvcReq{Mode: "SEED", Role: "decode", SessionID: "big", InputTokens: 200, Room: i64(50)}))
	}()
	waitFor(t, func() bool { return sessionsOf(t, d)["big"].Pinned == 1 })
	fDone := make(chan result, 1)
	go func() {
		_, dr := pd(t, p, d, "rf", 2, kvcReq{Mode: "SEED", SessionID: "f", InputTokens: 60, Room: i64(20)})
		fDone <- dr
	}()
	waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.preallocWaits) >= 1 })
	waiting := time.Now() // f's allocation started before this and ends after the cancel
	select {
	case r := <-fDone:
		t.Fatalf("f finished while the pages were pinned: %+v", r)
	default:
	}
	waited := ms(time.Since(waiting)) // the pages free only after the cancel below
	cancel()
	<-bigDone
	r := <-fDone
	if r.status != 200 || r.ans.MetaInfo.KVC.VerifyFailures != 0 {
		t.Fatalf("f after the wait: %d %s", r.status, r.code)
	}
	// The answer says how long the turn waited for its pages (alloc_ms): at least from when it
	// was seen waiting to when the pages came.
	if k := r.ans.MetaInfo.KVC; k.AllocMS < waited || k.TurnWaitMS < 0 {
		t.Fatalf("alloc_ms %.3f, turn_wait_ms %.3f; the wait was at least %.3f ms", k.AllocMS, k.TurnWaitMS, waited)
	}
	if testutil.ToFloat64(d.w.m.capacityRejects) != 0 {
		t.Fatal("a waited request was counted as rejected")
	}
}

// A request waiting in the prealloc queue is woken when a running request ends and leaves its
// session resident but unpinned (no page freed, but now evictable): it evicts that session at
// once instead of waiting out --prealloc-wait and failing with no_capacity.
func TestPreallocWaitWokenByUnpin(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 256, zeroTiming(), 10*time.Second) // 64 pages
	// big: 200 + 8 tokens, 52 of the 64 pages, all used
	big := kvcReq{Mode: "SEED", SessionID: "big", InputTokens: 200, Room: i64(50)}
	bigD, bigP := big, big
	bigD.Role, bigP.Role = "decode", "prefill"
	bigDone := make(chan result, 1)
	go func() { // D's half pins "big" and waits for its transfer, which comes when P is asked
		bigDone <- post(t, context.Background(), d.url, body("big", 8, false, bigD))
	}()
	waitFor(t, func() bool { return sessionsOf(t, d)["big"].Pinned == 1 })
	fDone := make(chan result, 1)
	go func() {
		_, dr := pd(t, p, d, "rf", 2, kvcReq{Mode: "SEED", SessionID: "f", InputTokens: 60, Room: i64(20)})
		fDone <- dr
	}()
	waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.preallocWaits) >= 1 })
	// big's prefill comes: big completes and stays resident (unpinned, evictable); no page is freed.
	if r := post(t, context.Background(), p.url, body("big", 8, false, bigP)); r.status != 200 {
		t.Fatalf("big prefill: %d %s", r.status, r.code)
	}
	if r := <-bigDone; r.status != 200 {
		t.Fatalf("big: %d %s", r.status, r.code)
	}
	r := <-fDone
	if r.status != 200 || r.ans.MetaInfo.KVC.VerifyFailures != 0 || r.ans.MetaInfo.KVC.EvictedSessions != 1 {
		t.Fatalf("f after big finished: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	if testutil.ToFloat64(d.w.m.capacityRejects) != 0 {
		t.Fatal("a request that could evict was rejected")
	}
}

// A session stays pinned until its commit to the sidecar returned: a request needing its pages
// meanwhile waits (prealloc queue) instead of evicting it mid-commit — which freed its pages
// while the sidecar was being handed them for snapshot pushes, and let the turn's trim free
// them a second time.
func TestNoEvictionDuringCommit(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 256, zeroTiming(), 10*time.Second) // 64 pages
	gate := make(chan struct{})
	var openGate sync.Once
	t.Cleanup(func() { openGate.Do(func() { close(gate) }) }) // never leave a's commit hanging
	d.sc.mu.Lock()
	d.sc.commitGate, d.sc.committing = gate, make(chan string, 1)
	d.sc.mu.Unlock()
	aDone := make(chan result, 1)
	go func() { // a: 200 + 8 tokens in 52 pages; its commit hangs at the gate
		_, dr := pd(t, p, d, "ra", 8, kvcReq{Mode: "SEED", SessionID: "a", InputTokens: 200, Room: i64(1)})
		aDone <- dr
	}()
	if got := <-d.sc.committing; got != "a" {
		t.Fatalf("committing %q", got)
	}
	bDone := make(chan result, 1)
	go func() { // b needs 16 pages: only by evicting a
		_, dr := pd(t, p, d, "rb", 2, kvcReq{Mode: "SEED", SessionID: "b", InputTokens: 60, Room: i64(2)})
		bDone <- dr
	}()
	waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.preallocWaits) >= 1 })
	select {
	case r := <-bDone:
		t.Fatalf("b finished while a was being committed: %+v", r)
	default:
	}
	d.sc.mu.Lock()
	d.sc.commitGate = nil
	d.sc.mu.Unlock()
	openGate.Do(func() { close(gate) })
	if r := <-aDone; r.status != 200 {
		t.Fatalf("a: %d %s", r.status, r.code)
	}
	r := <-bDone
	if r.status != 200 || r.ans.MetaInfo.KVC.EvictedSessions != 1 || r.ans.MetaInfo.KVC.VerifyFailures != 0 {
		t.Fatalf("b: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	// a was committed, so its eviction told the sidecar before its pages were reused.
	if _, releases := d.sc.snapshotOf(); len(releases) != 1 || releases[0].GetSessionId() != "a" {
		t.Fatalf("releases %v", releases)
	}
	st := d.w.stats()
	used := int64(0)
	for _, s := range d.w.Sessions() {
		used += int64(s.Pages)
	}
	if used+st.FreePages != st.PageCount {
		t.Fatalf("page accounting: %d used + %d free != %d", used, st.FreePages, st.PageCount)
	}
}

// A large append of a session D holds (PD_FALLBACK with keep_session): D receives the whole
// context into the session's own pages of the prefix plus new pages for the rest, verifies
// every token, and commits the longer session without releasing it — so the next turn is
// direct-to-D against the new length. A failed transfer keeps the session as it was when its
// prefix still verifies and drops it when not; without a held session it is plain P/D.
func TestLargeAppendExtendsHeldSession(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	pageCount := d.w.stats().PageCount

	// Seed: 101 tokens + 10 decoded = 111 (28 pages of 4; the last one holds 3 tokens).
	if pr, dr := pd(t, p, d, "r1", 10, kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 101, Room: i64(1)}); pr.status != 200 || dr.status != 200 {
		t.Fatalf("seed: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	commits, _ := d.sc.snapshotOf()
	seedPages := commits[0].GetPages()

	// Large append: 300 tokens of context (the 111 D holds are a prefix), 5 new.
	pr, dr := pd(t, p, d, "r2", 5, kvcReq{Mode: "PD_FALLBACK", SessionID: "s1", InputTokens: 300, Room: i64(2), Keep: bptr(true)})
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("large append: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	k := dr.ans.MetaInfo.KVC
	if k.ReceivedBytes != 300*48 || k.VerifiedBytes != 300*48 || k.VerifyFailures != 0 || k.KVLenAfter != 305 {
		t.Fatalf("large append meta %+v", k)
	}
	commits, releases := d.sc.snapshotOf()
	if len(releases) != 0 {
		t.Fatalf("the held session was released: %v", releases)
	}
	if len(commits) != 2 || commits[1].GetCommittedLen() != 305 || len(commits[1].GetPages()) != 77 {
		t.Fatalf("commits %v", commits)
	}
	pages := commits[1].GetPages()
	for i, pg := range seedPages {
		if pages[i] != pg {
			t.Fatalf("page %d of the prefix moved from %d to %d", i, pg, pages[i])
		}
	}
	if bad, err := kvpool.CheckContent(d.w.mem, contentKey, (&plan{seedKey: "s1"}).tokenIDs(305), pages, 0, 305); err != nil || bad != 0 {
		t.Fatalf("session KV after the large append: %d bad slots, %v", bad, err)
	}
	if st := d.w.stats(); st.FreePages != pageCount-77 || st.Sessions != 1 {
		t.Fatalf("pages leaked or lost: %+v (want %d free)", st, pageCount-77)
	}
	if s := sessionsOf(t, d)["s1"]; s.KVLen != 305 || s.Pages != 77 || !s.Committed {
		t.Fatalf("session %+v", s)
	}
	// The next turn is direct against the new length.
	res := post(t, context.Background(), d.url, body("r3", 2, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "s1", InputTokens: 320, CachedTokens: 305}))
	if res.status != 200 || res.ans.MetaInfo.KVC.PrefillTokens != 15 || res.ans.MetaInfo.KVC.KVLenAfter != 322 {
		t.Fatalf("direct after the large append: %d %s %+v", res.status, res.code, res.ans.MetaInfo.KVC)
	}

	// A large append corrupted beyond the prefix fails and leaves the session as it was.
	h.corrupt = true
	_, dr = pd(t, p, d, "r4", 5, kvcReq{Mode: "PD_FALLBACK", SessionID: "s1", InputTokens: 500, Room: i64(4), Keep: bptr(true)})
	h.corrupt = false
	if dr.status != http.StatusInternalServerError || dr.code != "kv_verify_failed" {
		t.Fatalf("corrupted large append: %d %s", dr.status, dr.code)
	}
	if s := sessionsOf(t, d)["s1"]; s.KVLen != 322 || s.Pages != 81 {
		t.Fatalf("a failed large append changed the session: %+v", s)
	}
	if st := d.w.stats(); st.FreePages != pageCount-81 {
		t.Fatalf("a failed large append leaked pages: %+v", st)
	}

	// keep_session for a session D does not hold: plain P/D, nothing kept.
	pr, dr = pd(t, p, d, "r5", 5, kvcReq{Mode: "PD_FALLBACK", SessionID: "s9", InputTokens: 200, Room: i64(5), Keep: bptr(true)})
	if pr.status != 200 || dr.status != 200 || dr.ans.MetaInfo.KVC.VerifiedBytes != 200*48 {
		t.Fatalf("large append of an unheld session: P %d, D %d %s", pr.status, dr.status, dr.code)
	}
	if _, ok := sessionsOf(t, d)["s9"]; ok {
		t.Fatal("an unheld session became resident through a fallback")
	}
	if st := d.w.stats(); st.FreePages != pageCount-81 || st.Sessions != 1 {
		t.Fatalf("state after an unheld large append: %+v", st)
	}
	if commits, _ := d.sc.snapshotOf(); len(commits) != 3 {
		t.Fatalf("commits %d, want 3 (seed, large append, direct)", len(commits))
	}

	// A large append corrupted inside the prefix damaged the session's own pages: it is dropped
	// (released to the sidecar, then its pages freed).
	h.corrupt, h.corruptFirst = true, true
	_, dr = pd(t, p, d, "r6", 5, kvcReq{Mode: "PD_FALLBACK", SessionID: "s1", InputTokens: 500, Room: i64(6), Keep: bptr(true)})
	h.corrupt, h.corruptFirst = false, false
	if dr.status != http.StatusInternalServerError || dr.code != "kv_verify_failed" {
		t.Fatalf("large append corrupted in the prefix: %d %s", dr.status, dr.code)
	}
	if _, rel := d.sc.snapshotOf(); len(rel) != 1 || rel[0].GetSessionId() != "s1" || rel[0].GetReason() != kvcv1.ReleaseReason_RELEASE_REASON_RELEASED {
		t.Fatalf("releases %v, want s1 released", rel)
	}
	if st := d.w.stats(); st.FreePages != pageCount || st.Sessions != 0 {
		t.Fatalf("state after a damaged large append: %+v", st)
	}
}

// A large append needs room only for what it adds: a session of 200 tokens on a 400-token
// decode worker takes a 350-token context (+10 new) although the session and a second copy of
// the whole context would not fit together.
func TestLargeAppendNeedsOnlyTheGrowth(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 1024, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 400, zeroTiming())
	if _, dr := pd(t, p, d, "r1", 0, kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 200, Room: i64(1)}); dr.status != 200 {
		t.Fatalf("seed: %d %s", dr.status, dr.code)
	}
	_, dr := pd(t, p, d, "r2", 10, kvcReq{Mode: "PD_FALLBACK", SessionID: "s1", InputTokens: 350, Room: i64(2), Keep: bptr(true)})
	if dr.status != 200 || dr.ans.MetaInfo.KVC.VerifiedBytes != 350*48 || dr.ans.MetaInfo.KVC.EvictedSessions != 0 {
		t.Fatalf("large append in a small pool: %d %s %+v", dr.status, dr.code, dr.ans.MetaInfo.KVC)
	}
	if s := sessionsOf(t, d)["s1"]; s.KVLen != 360 || s.Pages != 90 {
		t.Fatalf("session %+v", s)
	}
	if st := d.w.stats(); st.FreePages != 10 {
		t.Fatalf("free pages %d, want 10", st.FreePages)
	}
}
