package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// modelWorker is a decode worker whose next token is a function of the whole context (the
// prompt's ids and the ids generated so far), as a greedy model's is: a continuation given the
// prompt extended by the generated ids generates what an uninterrupted run would have. It
// streams each token's text "w<id> " and id, cumulatively (SGLang's default) or one token per
// chunk, and when dieAfter > 0 drops the connection after that many tokens of its first call.
type modelWorker struct {
	*httptest.Server
	cumulative bool
	dieAfter   int
	calls      chan map[string]any // the /generate bodies
}

func modelNext(ctx []int64) int64 {
	h := uint64(1469598103934665603)
	for _, id := range ctx {
		h = (h ^ uint64(id)) * 1099511628211
	}
	return int64(h % 50000)
}

func newModelWorker(t *testing.T, cumulative bool, dieAfter int) *modelWorker {
	w := &modelWorker{cumulative: cumulative, dieAfter: dieAfter, calls: make(chan map[string]any, 8)}
	var called atomic.Bool
	w.Server = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/generate" {
			fmt.Fprint(rw, `"ok"`)
			return
		}
		var b struct {
			InputIDs []int64 `json:"input_ids"`
			Sampling struct {
				MaxNewTokens int64 `json:"max_new_tokens"`
			} `json:"sampling_params"`
		}
		raw, _ := io.ReadAll(r.Body)
		var all map[string]any
		_ = json.Unmarshal(raw, &all)
		w.calls <- all
		if json.Unmarshal(raw, &b) != nil || len(b.InputIDs) == 0 {
			writeWorkerErr(rw, 400, "bad_request")
			return
		}
		die := !called.Swap(true) && w.dieAfter > 0
		rw.Header().Set("Content-Type", "text/event-stream")
		ctx := slices.Clone(b.InputIDs)
		var text strings.Builder
		var out []int64
		for i := int64(0); i < b.Sampling.MaxNewTokens; i++ {
			id := modelNext(ctx)
			ctx = append(ctx, id)
			out = append(out, id)
			tok := fmt.Sprintf("w%d ", id)
			text.WriteString(tok)
			meta := map[string]any{"prompt_tokens": len(b.InputIDs), "completion_tokens": i + 1,
				"kvc": map[string]any{"kv_len_after": int64(len(b.InputIDs)) + i + 1}}
			if i == b.Sampling.MaxNewTokens-1 {
				meta["finish_reason"] = map[string]any{"type": "length", "length": b.Sampling.MaxNewTokens}
			}
			c := map[string]any{"text": tok, "output_ids": []int64{id}, "meta_info": meta}
			if w.cumulative {
				c["text"], c["output_ids"] = text.String(), out
			}
			j, _ := json.Marshal(c)
			fmt.Fprintf(rw, "data: %s\n\n", j)
			rw.(http.Flusher).Flush()
			if die && int(i+1) == w.dieAfter {
				if conn, _, err := rw.(http.Hijacker).Hijack(); err == nil {
					conn.Close()
				}
				return
			}
		}
		fmt.Fprint(rw, "data: [DONE]\n\n")
	}))
	t.Cleanup(w.Close)
	return w
}

// clientAnswer is what a client reads from an answer, whatever its API and form.
type clientAnswer struct {
	Text       string
	IDs        []int64 // /generate streams only
	Prompt     int64
	Completion int64
	Finish     string
	Error      string
	// KVC is the answer's kvc object (an OpenAI stream's last chunk that has one, a whole
	// answer's, a whole /generate answer's kvc_route); nil: none (a /generate stream).
	KVC *clientKVC
}

// clientKVC is the answer's kvc object as a client reads it, by its JSON names.
type clientKVC struct {
	Mode                string   `json:"mode"`
	DecisionID          string   `json:"decision_id"`
	FailOpen            bool     `json:"fail_open"`
	ResumedFrom         string   `json:"resumed_from"`
	ResumedDecodeWorker string   `json:"resumed_decode_worker"`
	ResumedAttempts     int      `json:"resumed_attempts"`
	ResumedRetriedFrom  []string `json:"resumed_retried_from"`
}

// noResume: the kvc object names no resume (an uninterrupted answer's).
func (k *clientKVC) noResume() bool {
	return k.ResumedFrom == "" && k.ResumedDecodeWorker == "" && k.ResumedAttempts == 0 && k.ResumedRetriedFrom == nil
}

func readAnswer(t *testing.T, kind api.Kind, stream, cumulative bool, resp *http.Response) clientAnswer {
	t.Helper()
	var a clientAnswer
	type usage struct {
		PromptTokens     int64 `json:"prompt_tokens"`
		CompletionTokens int64 `json:"completion_tokens"`
	}
	type oai struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
			Finish *string `json:"finish_reason"`
		} `json:"choices"`
		Usage *usage     `json:"usage"`
		KVC   *clientKVC `json:"kvc"`
	}
	type gen struct {
		Text      string  `json:"text"`
		OutputIDs []int64 `json:"output_ids"`
		MetaInfo  *struct {
			usage
			FinishReason *struct {
				Type string `json:"type"`
				N    int64  `json:"length"`
			} `json:"finish_reason"`
		} `json:"meta_info"`
		Error *struct {
			Code string `json:"code"`
		} `json:"error"`
		KVCRoute *clientKVC `json:"kvc_route"`
	}
	fromGen := func(g gen) {
		if g.Error != nil {
			a.Error = g.Error.Code
			return
		}
		if g.KVCRoute != nil {
			a.KVC = g.KVCRoute
		}
		if cumulative {
			a.Text, a.IDs = g.Text, g.OutputIDs
		} else {
			a.Text += g.Text
			a.IDs = append(a.IDs, g.OutputIDs...)
		}
		if m := g.MetaInfo; m != nil {
			a.Prompt, a.Completion = m.PromptTokens, m.CompletionTokens
			if m.FinishReason != nil {
				a.Finish = fmt.Sprintf("%s/%d", m.FinishReason.Type, m.FinishReason.N)
			}
		}
	}
	fromOAI := func(o oai) {
		for _, c := range o.Choices {
			a.Text += c.Text + c.Message.Content + c.Delta.Content
			if c.Finish != nil {
				a.Finish = *c.Finish
			}
		}
		if o.Usage != nil {
			a.Prompt, a.Completion = o.Usage.PromptTokens, o.Usage.CompletionTokens
		}
		if o.KVC != nil {
			a.KVC = o.KVC
		}
	}
	if resp.StatusCode != http.StatusOK {
		code, _ := errBody(t, resp.Body)
		a.Error = fmt.Sprintf("%d %s", resp.StatusCode, code)
		return a
	}
	if !stream {
		raw, _ := io.ReadAll(resp.Body)
		if kind == api.Generate {
			var g gen
			if err := json.Unmarshal(raw, &g); err != nil {
				t.Fatalf("%v: %s", err, raw)
			}
			g.OutputIDs = nil // not in a non-streaming answer
			fromGen(g)
			return a
		}
		var o oai
		if err := json.Unmarshal(raw, &o); err != nil {
			t.Fatalf("%v: %s", err, raw)
		}
		fromOAI(o)
		return a
	}
	ev := sse(t, resp.Body)
	for _, e := range ev {
		if e == "[DONE]" {
			break
		}
		if strings.Contains(e, `"error"`) {
			var g gen
			_ = json.Unmarshal([]byte(e), &g)
			if g.Error != nil {
				a.Error = g.Error.Code
				continue
			}
		}
		if kind == api.Generate {
			var g gen
			if err := json.Unmarshal([]byte(e), &g); err != nil {
				t.Fatalf("%v: %s", err, e)
			}
			fromGen(g)
			continue
		}
		var o oai
		if err := json.Unmarshal([]byte(e), &o); err != nil {
			t.Fatalf("%v: %s", err, e)
		}
		fromOAI(o)
	}
	if ev[len(ev)-1] != "[DONE]" {
		t.Fatalf("stream without [DONE]: %v", ev)
	}
	return a
}

// A request whose decode worker dies after some tokens, in every API, streaming or not, from a
// worker streaming cumulative text and ids (SGLang's default) or increments: the gateway
// resumes it through a new decision whose prompt is the original prompt's ids and the ids
// generated so far, for the tokens that remain, avoiding the dead worker; the client reads the
// answer an uninterrupted run gives (text, ids, usage, finish); the failed attempt and the
// continuation are reported as two outcomes. With --resume-mid-stream=false the old failure.
func TestResumeMidStream(t *testing.T) {
	tok, _ := qwen3(t)
	const maxTok, dieAfter = 9, 4
	bodies := map[api.Kind]func(stream bool) string{
		api.Generate: func(stream bool) string {
			return fmt.Sprintf(`{"input_ids":[11,22,33,44,55,66,77],"stream":%v,"sampling_params":{"max_new_tokens":%d,"min_new_tokens":6,"temperature":0},"kvc":{"turn":3}}`, stream, maxTok)
		},
		api.Chat: func(stream bool) string {
			return fmt.Sprintf(`{"model":"m","stream":%v,"max_tokens":%d,"messages":[{"role":"user","content":"write the test"}],"kvc":{"turn":3}}`, stream, maxTok)
		},
		api.Completion: func(stream bool) string {
			return fmt.Sprintf(`{"model":"m","stream":%v,"max_tokens":%d,"prompt":"func TestResume(t *testing.T) {","kvc":{"turn":3}}`, stream, maxTok)
		},
	}
	paths := map[api.Kind]string{api.Generate: "/generate", api.Chat: "/v1/chat/completions", api.Completion: "/v1/completions"}
	for _, kind := range []api.Kind{api.Generate, api.Chat, api.Completion} {
		for _, stream := range []bool{true, false} {
			for _, cumulative := range []bool{false, true} {
				for _, resume := range []bool{true, false} {
					name := fmt.Sprintf("%s/stream=%v/cumulative=%v/resume=%v", kind, stream, cumulative, resume)
					t.Run(name, func(t *testing.T) {
						dying, good := newModelWorker(t, cumulative, dieAfter), newModelWorker(t, cumulative, 0)
						rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
							d := &kvcv1.WorkerRef{WorkerId: "d-dying", WorkerUrl: dying.URL}
							if q.GetSessionId() == "ref" || slices.Contains(q.GetExcludeWorkers(), "d-dying") {
								d = &kvcv1.WorkerRef{WorkerId: "d-good", WorkerUrl: good.URL}
							}
							return &kvcv1.RouteDecision{DecisionId: fmt.Sprintf("dec-%s-%d", q.GetSessionId(), len(q.GetExcludeWorkers())),
								Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, Decode: d,
								Execution: &kvcv1.RouteExecution{CallDecode: true, KeepSession: true, RetryAllowed: true}}
						}}
						m := NewMetrics(prometheus.NewRegistry())
						s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
							Parse: api.Options{RequireSession: true, DefaultMaxTok: 16}, Content: &Content{Tok: tok, PageSize: 4}, ResumeMidStream: resume},
							zerolog.Nop(), m)
						mux := http.NewServeMux()
						s.Register(mux)
						gw := httptest.NewServer(mux)
						defer func() { gw.Close(); s.Close() }()
						ask := func(session string) (*http.Response, clientAnswer) {
							req, _ := http.NewRequest(http.MethodPost, gw.URL+paths[kind], strings.NewReader(bodies[kind](stream)))
							req.Header.Set("X-Session-ID", session)
							resp, err := http.DefaultClient.Do(req)
							if err != nil {
								t.Fatal(err)
							}
							defer resp.Body.Close()
							a := readAnswer(t, kind, stream, cumulative, resp)
							_, _ = io.Copy(io.Discard, resp.Body) // to the trailers
							return resp, a
						}
						_, want := ask("ref") // uninterrupted, on the good worker
						<-good.calls
						if want.Error != "" || want.Completion != maxTok {
							t.Fatalf("reference answer %+v", want)
						}
						resp, got := ask("s1")
						first := <-dying.calls
						if !resume {
							wantErr := "502 worker_unreachable"
							if stream {
								wantErr = "worker_unreachable"
							}
							if got.Error != wantErr || len(good.calls) != 0 {
								t.Fatalf("without resume: %+v, want the error %q and no second call", got, wantErr)
							}
							if n := testutil.ToFloat64(m.Resumes.WithLabelValues(resumeDisabled)); n != 1 {
								t.Fatalf("resumes{disabled} = %v", n)
							}
							return
						}
						if got.Error != "" || got.Text != want.Text || !slices.Equal(got.IDs, want.IDs) || got.Prompt != want.Prompt ||
							got.Completion != want.Completion || got.Finish != want.Finish {
							t.Fatalf("resumed answer\n %+v\nwant the uninterrupted one\n %+v", got, want)
						}
						// The continuation: the prompt and the streamed ids, the tokens left, min_new_tokens counted down.
						cont := <-good.calls
						ids := func(b map[string]any) []int64 {
							var out []int64
							for _, v := range b["input_ids"].([]any) {
								out = append(out, int64(v.(float64)))
							}
							return out
						}
						p0 := ids(first)
						// The streamed ids where the client sees them (a /generate stream); elsewhere the
						// prompt part is checked, the generated part by the answer's text.
						wantIDs := ids(cont)[:len(p0)+dieAfter]
						if kind == api.Generate && stream {
							wantIDs = append(slices.Clone(p0), got.IDs[:dieAfter]...)
						}
						sp := cont["sampling_params"].(map[string]any)
						if !slices.Equal(ids(cont), wantIDs) || !slices.Equal(ids(cont)[:len(p0)], p0) || sp["max_new_tokens"] != float64(maxTok-dieAfter) {
							t.Fatalf("continuation body: input_ids %v (prompt %v), sampling %v", ids(cont), p0, sp)
						}
						if mn, ok := sp["min_new_tokens"]; kind == api.Generate && (!ok || mn != float64(6-dieAfter)) {
							t.Fatalf("continuation's min_new_tokens %v, want %d", mn, 6-dieAfter)
						}
						// Named where the client can see it: in the answer's kvc object too (the
						// continuation's decision; none in a /generate stream, the worker's chunks).
						if kvc := !(kind == api.Generate && stream); (got.KVC != nil) != kvc || (want.KVC != nil) != kvc {
							t.Fatalf("kvc object %+v (the reference's %+v), want one: %v", got.KVC, want.KVC, kvc)
						}
						if k := got.KVC; k != nil && (k.ResumedFrom != "d-dying" || k.ResumedDecodeWorker != "d-good" || k.ResumedAttempts != 1 ||
							k.ResumedRetriedFrom != nil || k.Mode != "DIRECT_TO_D" || k.DecisionID != "dec-s1-1" || k.FailOpen) {
							t.Fatalf("resumed answer's kvc object %+v: want resumed from d-dying on d-good, 1 attempt, decision dec-s1-1", k)
						}
						if want.KVC != nil && !want.KVC.noResume() {
							t.Fatalf("the uninterrupted answer's kvc object names a resume: %+v", want.KVC)
						}
						if stream {
							if resp.Trailer.Get("X-KVC-Resumed-From") != "d-dying" || resp.Trailer.Get("X-KVC-Resumed-Decode-Worker") != "d-good" ||
								resp.Trailer.Get("X-KVC-Resumed-Mode") != "DIRECT_TO_D" || resp.Trailer.Get("X-KVC-Resumed-Fail-Open") != "false" {
								t.Fatalf("trailers %v", resp.Trailer)
							}
						} else if resp.Header.Get("X-KVC-Resumed-From") != "d-dying" || resp.Header.Get("X-KVC-Decode-Worker") != "d-good" {
							t.Fatalf("headers %v", resp.Header)
						}
						if n := testutil.ToFloat64(m.Resumes.WithLabelValues(resumeOK)); n != 1 {
							t.Fatalf("resumes{ok} = %v", n)
						}
						// The control plane: the same session and turn, the extended prompt, the dead
						// worker excluded; the failed attempt and the continuation as two outcomes.
						rr.mu.Lock()
						defer rr.mu.Unlock()
						qs, os := rr.queries[1:], rr.outcomes[1:] // after the reference's
						if len(qs) != 2 || qs[1].GetSessionId() != "s1" || qs[1].GetTurn() != qs[0].GetTurn() ||
							qs[1].GetInputTokens() != qs[0].GetInputTokens()+dieAfter || qs[1].GetMaxOutputTokens() != maxTok-dieAfter ||
							!slices.Equal(qs[1].GetExcludeWorkers(), []string{"d-dying"}) || len(qs[1].GetPromptPages()) != int(qs[1].GetInputTokens()/4) {
							t.Fatalf("queries %v", qs)
						}
						if len(os) != 2 || os[0].GetSuccess() || os[0].GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR ||
							!os[1].GetSuccess() || os[1].GetDecisionId() == os[0].GetDecisionId() || os[1].GetKvLenAfter() != qs[0].GetInputTokens()+maxTok {
							t.Fatalf("outcomes %v", os)
						}
					})
				}
			}
		}
	}
}

// A continuation whose own worker dies too, after its own first token, ends the answer with its
// error (one resume per request): an error event after the tokens both streamed, resumes{failed}.
func TestResumeBounded(t *testing.T) {
	first, second := newModelWorker(t, false, 3), newModelWorker(t, false, 2)
	rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
		d := &kvcv1.WorkerRef{WorkerId: "d-1", WorkerUrl: first.URL}
		if len(q.GetExcludeWorkers()) > 0 {
			d = &kvcv1.WorkerRef{WorkerId: "d-2", WorkerUrl: second.URL}
		}
		return &kvcv1.RouteDecision{DecisionId: fmt.Sprint("dec-", len(q.GetExcludeWorkers())), Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, Decode: d,
			Execution: &kvcv1.RouteExecution{CallDecode: true, KeepSession: true, RetryAllowed: true}}
	}}
	m := NewMetrics(prometheus.NewRegistry())
	s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{RequireSession: true, DefaultMaxTok: 16}, ResumeMidStream: true}, zerolog.Nop(), m)
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	defer func() { gw.Close(); s.Close() }()
	resp := post(t, gw.URL, "/generate", "s1", `{"input_ids":[1,2,3],"stream":true,"sampling_params":{"max_new_tokens":8}}`)
	a := readAnswer(t, api.Generate, true, false, resp)
	if a.Error != "worker_unreachable" || len(a.IDs) != 5 {
		t.Fatalf("answer %+v: want the second death's error after 3+2 tokens", a)
	}
	if got := testutil.ToFloat64(m.Resumes.WithLabelValues(resumeFailed)); got != 1 {
		t.Fatalf("resumes{failed} = %v", got)
	}
	rr.mu.Lock()
	defer rr.mu.Unlock()
	if len(rr.queries) != 2 || len(rr.outcomes) != 2 || rr.outcomes[0].GetSuccess() || rr.outcomes[1].GetSuccess() {
		t.Fatalf("%d queries, outcomes %v: want two failed attempts, no third", len(rr.queries), rr.outcomes)
	}
}

// What cannot be resumed exactly enough is not: a prompt without known ids, streamed ids that
// do not add up to the tokens generated, nothing left, a grammar-constrained answer.
func TestResumeRequestRefuses(t *testing.T) {
	base := api.Request{Kind: api.Generate, SessionID: "s", InputIDs: []int64{1, 2, 3}, InputTokens: 3, MaxTokens: 5,
		Sampling: []byte(`{"max_new_tokens":5,"min_new_tokens":1}`)}
	tests := []struct {
		name      string
		mod       func(r *api.Request, res *result)
		segChunks int
		want      string
	}{
		{"resumable", func(*api.Request, *result) {}, 2, ""},
		{"no ids", func(r *api.Request, _ *result) { r.InputIDs = nil }, 2, resumeNoIDs},
		{"ids not the prompt's", func(r *api.Request, _ *result) { r.InputTokens = 4 }, 2, resumeNoIDs},
		{"an id missing", func(_ *api.Request, res *result) { res.outputIDs = res.outputIDs[:1] }, 2, resumeIDsMismatch},
		{"no meta: one id per chunk", func(_ *api.Request, res *result) { res.outputTok = 0 }, 3, resumeIDsMismatch},
		{"no meta, ids per chunk", func(_ *api.Request, res *result) { res.outputTok = 0 }, 2, ""},
		{"nothing streamed", func(_ *api.Request, res *result) { res.outputIDs, res.outputTok = nil, 0 }, 0, resumeIDsMismatch},
		{"nothing left", func(r *api.Request, _ *result) { r.MaxTokens = 2 }, 2, resumeNoneLeft},
		{"regex", func(r *api.Request, _ *result) { r.Sampling = []byte(`{"max_new_tokens":5,"regex":"a+"}`) }, 2, resumeConstrained},
		{"json schema", func(r *api.Request, _ *result) { r.Sampling = []byte(`{"max_new_tokens":5,"json_schema":"{}"}`) }, 2, resumeConstrained},
		{"null regex", func(r *api.Request, _ *result) { r.Sampling = []byte(`{"max_new_tokens":5,"regex":null}`) }, 2, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := base
			res := result{outputIDs: []int64{7, 8}, outputTok: 2}
			tt.mod(&r, &res)
			c, why := resumeRequest(&r, res, tt.segChunks)
			if why != tt.want || (c == nil) != (tt.want != "") {
				t.Fatalf("why %q (%v), want %q", why, c, tt.want)
			}
			if c == nil {
				return
			}
			if !slices.Equal(c.InputIDs, append(slices.Clone(r.InputIDs), res.outputIDs...)) || c.InputTokens != 5 || c.MaxTokens != r.MaxTokens-2 ||
				!slices.Equal(r.InputIDs, base.InputIDs) {
				t.Fatalf("continuation %+v (original %v)", c, r.InputIDs)
			}
			if tt.name == "resumable" && !bytes.Equal(c.Sampling, []byte(`{"max_new_tokens":3,"min_new_tokens":0}`)) {
				t.Fatalf("sampling %s", c.Sampling)
			}
		})
	}
}

// The continuation's counts are the whole answer's; what is not a count passes as it is.
func TestResumeBaseMeta(t *testing.T) {
	b := &resumeBase{prompt: 100, ids: []int64{1, 2, 3}}
	got := string(b.meta(json.RawMessage(`{"id":"x","prompt_tokens":103,"completion_tokens":2,"finish_reason":{"type":"length","length":5},"kvc":{"kv_len_after":105}}`)))
	want := `{"completion_tokens":5,"finish_reason":{"length":8,"type":"length"},"id":"x","kvc":{"kv_len_after":105},"prompt_tokens":100}`
	if got != want {
		t.Fatalf("meta %s\nwant %s", got, want)
	}
	if got := string(b.meta(json.RawMessage(`{"finish_reason":{"type":"stop","matched":"x"}}`))); got != `{"finish_reason":{"type":"stop","matched":"x"}}` {
		t.Fatalf("stop finish rewritten: %s", got)
	}
	if got := string(b.meta(json.RawMessage(`not json`))); got != `not json` {
		t.Fatalf("unreadable meta: %s", got)
	}
}

// contWorker is a decode worker that fails a continuation before its first token, as how says:
// "dead" (a closed listener: the connection refused), "close" (the connection dropped before any
// answer), "503gone" (a worker on its way down), "ends" (a stream that ends before its first
// chunk), "409" (session_not_resident), "transfer" (a transfer_failed error event before any
// token), "503full" (no_capacity: alive and full).
func contWorker(t *testing.T, how string, calls *atomic.Int32) string {
	if how == "dead" {
		return deadURL(t)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/generate" {
			fmt.Fprint(rw, `"ok"`)
			return
		}
		calls.Add(1)
		switch how {
		case "close":
			if conn, _, err := rw.(http.Hijacker).Hijack(); err == nil {
				conn.Close()
			}
		case "503gone":
			writeWorkerErr(rw, 503, "unavailable")
		case "503full":
			writeWorkerErr(rw, 503, "no_capacity")
		case "409":
			writeWorkerErr(rw, 409, "session_not_resident")
		case "ends":
			rw.Header().Set("Content-Type", "text/event-stream")
			rw.WriteHeader(http.StatusOK)
			rw.(http.Flusher).Flush()
		case "transfer": // the KV the continuation was to receive never landed
			rw.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(rw, "data: {\"error\":{\"code\":\"transfer_failed\",\"message\":\"fake\"}}\n\n")
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// A continuation that fails before its first token — its worker died too, refused the
// connection, answered a 503 going away, or ended its stream at once — is retried through a new
// decision that avoids every worker found gone, at most maxResumeRetries times: the client reads
// the uninterrupted answer (nothing twice) when one succeeds, else the last continuation's error
// (an error event after the first attempt's tokens, or the non-streaming error) with its stable
// code. Each continuation attempt is counted (resumes{retried}, then ok or failed), reported as
// its own outcome, and named in X-KVC-Resumed-Attempts / -Retried-From and in the answer's kvc
// object (resumed_attempts, resumed_retried_from: /generate's kvc_route, /v1/completions'
// kvc, a stream's in its last chunk; a /generate stream has none). A full worker
// (no_capacity) is not retried, and a retry that finds no decision ends the answer with the
// failed continuation's error.
func TestResumeRetriesContinuation(t *testing.T) {
	const maxTok, dieAfter = 9, 4
	tests := []struct {
		name string
		bad  []string // how each continuation attempt before a good worker's fails
		// noDecision: after the bad ones, the control plane gives no usable decision (and no
		// fail-open worker is known), instead of the good worker
		noDecision  bool
		wantErr     string // "": the whole answer
		wantStatus  int    // non-streaming, with wantErr
		wantRetried float64
		wantKinds   []kvcv1.RouteErrorKind // the continuations' outcomes (UNSPECIFIED: success)
	}{
		{name: "refused", bad: []string{"dead"}, wantRetried: 1,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0}},
		{name: "connection dropped before answering", bad: []string{"close"}, wantRetried: 1,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0}},
		{name: "503 going away", bad: []string{"503gone"}, wantRetried: 1,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0}},
		{name: "stream ends before its first token", bad: []string{"ends"}, wantRetried: 1,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0}},
		{name: "transfer failed", bad: []string{"transfer"}, wantRetried: 1,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED, 0}},
		{name: "session not resident", bad: []string{"409"}, wantRetried: 1,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT, 0}},
		{name: "two gone, the third serves", bad: []string{"dead", "close"}, wantRetried: 2,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0}},
		{name: "all gone: bounded", bad: []string{"dead", "close", "dead", "dead"}, wantErr: "worker_unreachable", wantStatus: 502, wantRetried: 2,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D,
				kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D}},
		{name: "full is not retried", bad: []string{"503full"}, wantErr: "no_capacity", wantStatus: 503,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D}},
		{name: "no decision for the retry", bad: []string{"dead"}, noDecision: true, wantErr: "worker_unreachable", wantStatus: 502, wantRetried: 1,
			wantKinds: []kvcv1.RouteErrorKind{kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED}},
	}
	paths := map[api.Kind]string{api.Generate: "/generate", api.Completion: "/v1/completions"}
	type form struct {
		kind   api.Kind
		stream bool
	}
	forms := []form{{api.Generate, true}, {api.Generate, false}, {api.Completion, true}, {api.Completion, false}}
	for _, tt := range tests {
		for _, form := range forms {
			kind, stream := form.kind, form.stream
			t.Run(fmt.Sprintf("%s/%s/stream=%v", tt.name, kind, stream), func(t *testing.T) {
				dying, good := newModelWorker(t, false, dieAfter), newModelWorker(t, false, 0)
				var badCalls atomic.Int32
				badURLs := make([]string, len(tt.bad))
				for i, how := range tt.bad {
					badURLs[i] = contWorker(t, how, &badCalls)
				}
				n := 0 // the session's queries, one at a time
				rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
					d := &kvcv1.WorkerRef{WorkerId: "d-good", WorkerUrl: good.URL}
					if q.GetSessionId() != "ref" {
						n++
						switch {
						case n == 1:
							d = &kvcv1.WorkerRef{WorkerId: "d-dying", WorkerUrl: dying.URL}
						case n-2 < len(badURLs):
							d = &kvcv1.WorkerRef{WorkerId: fmt.Sprint("d-bad-", n-1), WorkerUrl: badURLs[n-2]}
						case tt.noDecision:
							d = nil
						}
					}
					return &kvcv1.RouteDecision{DecisionId: fmt.Sprintf("dec-%s-%d", q.GetSessionId(), n), Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
						Decode: d, Execution: &kvcv1.RouteExecution{CallDecode: true, KeepSession: true, RetryAllowed: true,
							OnDecodeRefused: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D}}
				}}
				m := NewMetrics(prometheus.NewRegistry())
				s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
					Parse: api.Options{RequireSession: true, DefaultMaxTok: 16}, ResumeMidStream: true}, zerolog.Nop(), m)
				mux := http.NewServeMux()
				s.Register(mux)
				gw := httptest.NewServer(mux)
				defer func() { gw.Close(); s.Close() }()
				body := fmt.Sprintf(`{"input_ids":[11,22,33,44,55],"stream":%v,"sampling_params":{"max_new_tokens":%d,"temperature":0}}`, stream, maxTok)
				if kind == api.Completion {
					body = fmt.Sprintf(`{"model":"m","prompt":[11,22,33,44,55],"stream":%v,"max_tokens":%d,"temperature":0}`, stream, maxTok)
				}
				ask := func(session string) (*http.Response, clientAnswer) {
					resp := post(t, gw.URL, paths[kind], session, body)
					defer resp.Body.Close()
					a := readAnswer(t, kind, stream, false, resp)
					_, _ = io.Copy(io.Discard, resp.Body) // to the trailers
					return resp, a
				}
				_, want := ask("ref")
				<-good.calls
				if want.Error != "" || want.Completion != maxTok || (want.KVC != nil && !want.KVC.noResume()) {
					t.Fatalf("reference answer %+v (kvc %+v)", want, want.KVC)
				}
				ref := append([]int64{11, 22, 33, 44, 55}, func() []int64 { // the reference's ids, from its model
					ctx := []int64{11, 22, 33, 44, 55}
					var out []int64
					for range maxTok {
						id := modelNext(ctx)
						ctx, out = append(ctx, id), append(out, id)
					}
					return out
				}()...)[5:]

				resp, got := ask("s1")
				<-dying.calls
				h := resp.Header
				if stream {
					h = resp.Trailer
				}
				attempts := len(tt.wantKinds)
				if tt.noDecision {
					attempts-- // the last query's decision could not run
				}
				var retriedFrom []string
				for i := 1; i < attempts; i++ {
					retriedFrom = append(retriedFrom, fmt.Sprint("d-bad-", i))
				}
				if h.Get("X-KVC-Resumed-From") != "d-dying" || h.Get("X-KVC-Resumed-Attempts") != fmt.Sprint(attempts) ||
					h.Get("X-KVC-Resumed-Retried-From") != strings.Join(retriedFrom, ",") {
					t.Fatalf("resume headers %v: want %d attempts, retried from %v", h, attempts, retriedFrom)
				}
				if tt.wantErr == "" {
					if got.Error != "" || got.Text != want.Text || got.Completion != want.Completion || got.Finish != want.Finish ||
						(kind == api.Generate && stream && !slices.Equal(got.IDs, ref)) {
						t.Fatalf("answer\n %+v\nwant the uninterrupted one\n %+v", got, want)
					}
					// The body names the resume as the headers do: the last continuation's decision
					// (the dying worker's, each bad one's, then the good one's).
					if kind == api.Generate && stream {
						if got.KVC != nil {
							t.Fatalf("a /generate stream with a kvc object %+v", got.KVC)
						}
					} else if k := got.KVC; k == nil || k.ResumedFrom != "d-dying" || k.ResumedDecodeWorker != "d-good" || k.ResumedAttempts != attempts ||
						!slices.Equal(k.ResumedRetriedFrom, retriedFrom) || k.DecisionID != fmt.Sprint("dec-s1-", len(tt.bad)+2) {
						t.Fatalf("kvc object %+v: want resumed from d-dying on d-good, %d attempts, retried from %v, decision dec-s1-%d",
							k, attempts, retriedFrom, len(tt.bad)+2)
					}
					worker := resp.Header.Get("X-KVC-Decode-Worker")
					if stream {
						worker = h.Get("X-KVC-Resumed-Decode-Worker")
					}
					if worker != "d-good" {
						t.Fatalf("finished on %q, want d-good", worker)
					}
					if cont := <-good.calls; len(cont["input_ids"].([]any)) != 5+dieAfter {
						t.Fatalf("the good worker's continuation: %v", cont["input_ids"])
					}
				} else {
					wantErr := tt.wantErr
					if !stream {
						wantErr = fmt.Sprint(tt.wantStatus, " ", tt.wantErr)
					}
					// Mid-stream: the first attempt's tokens once, then the error; nothing from the
					// continuations (none sent a token).
					var firstText strings.Builder
					for _, id := range ref[:dieAfter] {
						fmt.Fprintf(&firstText, "w%d ", id)
					}
					if got.Error != wantErr || (kind == api.Generate && stream && !slices.Equal(got.IDs, ref[:dieAfter])) ||
						(stream && got.Text != firstText.String()) || (!stream && got.Text != "") {
						t.Fatalf("answer %+v: want the error %q after the first %d tokens %v", got, wantErr, dieAfter, ref[:dieAfter])
					}
					if len(good.calls) != 0 {
						t.Fatal("the good worker was called")
					}
				}
				if want := len(tt.bad); int(badCalls.Load()) > want {
					t.Fatalf("%d calls to the failing workers, want at most %d (one each)", badCalls.Load(), want)
				}
				ok := 0.0
				if tt.wantErr == "" {
					ok = 1
				}
				if r, o, f := testutil.ToFloat64(m.Resumes.WithLabelValues(resumeRetried)), testutil.ToFloat64(m.Resumes.WithLabelValues(resumeOK)),
					testutil.ToFloat64(m.Resumes.WithLabelValues(resumeFailed)); r != tt.wantRetried || o != ok || f != 1-ok {
					t.Fatalf("resumes retried/ok/failed = %v/%v/%v, want %v/%v/%v", r, o, f, tt.wantRetried, ok, 1-ok)
				}
				// The control plane: the first attempt's failure, then one outcome per continuation
				// attempt; each continuation's query the same extended prompt, excluding every worker
				// found gone so far.
				rr.mu.Lock()
				defer rr.mu.Unlock()
				qs, os := rr.queries[1:], rr.outcomes[1:] // after the reference's
				if len(qs) != 1+len(tt.wantKinds) || len(os) != 1+len(tt.wantKinds) {
					t.Fatalf("%d queries, %d outcomes, want %d", len(qs), len(os), 1+len(tt.wantKinds))
				}
				if os[0].GetSuccess() || os[0].GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR {
					t.Fatalf("first outcome %v", os[0])
				}
				wantExcl := []string{"d-dying"}
				for i, k := range tt.wantKinds {
					q, o := qs[i+1], os[i+1]
					if q.GetInputTokens() != 5+dieAfter || q.GetMaxOutputTokens() != maxTok-dieAfter || !slices.Equal(q.GetExcludeWorkers(), wantExcl) {
						t.Fatalf("continuation query %d: %v, want excluded %v", i+1, q, wantExcl)
					}
					if o.GetSuccess() != (k == 0) || (k != 0 && o.GetErrorKind() != k) {
						t.Fatalf("continuation outcome %d: %v, want kind %v", i+1, o, k)
					}
					if k == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D || k == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED {
						wantExcl = append(wantExcl, fmt.Sprint("d-bad-", i+1))
					}
				}
			})
		}
	}
}
