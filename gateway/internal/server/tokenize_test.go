package server

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// tokGateway is a gateway with the qwen3 tokenizer under lim in front of one decode worker.
func tokGateway(t *testing.T, lim TokenizeLimits) (*Server, *httptest.Server, *idsWorker) {
	t.Helper()
	tok, _ := qwen3(t)
	dw := newIDsWorker(t, []int64{1, 2})
	rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
		return &kvcv1.RouteDecision{DecisionId: "d-1", Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Decode:    &kvcv1.WorkerRef{WorkerId: "d0", WorkerUrl: dw.URL},
			Execution: &kvcv1.RouteExecution{CallDecode: true, KeepSession: true}}
	}}
	s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 60 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 32 << 20,
		Parse:   api.Options{RequireSession: true, DefaultMaxTok: 4},
		Content: &Content{Tok: tok, PageSize: 16, TokenizeCacheBytes: 1 << 20, Limits: &lim}}, zerolog.Nop(), NewMetrics(prometheus.NewRegistry()))
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	t.Cleanup(gw.Close)
	return s, gw, dw
}

func chatOf(content string) []byte {
	b, _ := json.Marshal(map[string]any{"model": "qwen3", "max_tokens": 2,
		"messages": []map[string]any{{"role": "user", "content": content}}})
	return b
}

func textOf(text string) []byte {
	b, _ := json.Marshal(map[string]any{"text": text, "sampling_params": map[string]any{"max_new_tokens": 2}})
	return b
}

// TestTokenizeLimits (issue 23 item 3): the tokenizer's work is bounded per request (bytes: 413
// tokenize_too_large before the chat template is rendered; tokens: 413 too_many_tokens) and in
// all (503 tokenizer_saturated with Retry-After while another request's tokenization holds the
// bytes); every reservation comes back when the request ends.
func TestTokenizeLimits(t *testing.T) {
	lim := TokenizeLimits{MaxBytes: 64 << 10, MaxTokens: 2000, MaxInflightBytes: 64 << 10, MaxInflightTokens: 1 << 20, RetryAfter: 2 * time.Second}
	s, gw, _ := tokGateway(t, lim)
	for _, tc := range []struct {
		name, path string
		body       []byte
		status     int
		code       string
	}{
		{"chat within the limits", "/v1/chat/completions", chatOf("hello there"), 200, ""},
		{"text within the limits", "/generate", textOf("hello there"), 200, ""},
		{"chat messages over the byte limit", "/v1/chat/completions", chatOf(strings.Repeat("x", 65<<10)), 413, CodeTokenizeTooLarge},
		{"text over the byte limit", "/generate", textOf(strings.Repeat("word ", 14000)), 413, CodeTokenizeTooLarge},
		{"chat over the token limit", "/v1/chat/completions", chatOf(strings.Repeat("7", 3000)), 413, CodeTooManyTokens},
		{"text over the token limit", "/generate", textOf(strings.Repeat("7 ", 3000)), 413, CodeTooManyTokens},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, code, _ := postGW(t, context.Background(), gw.URL+tc.path, tc.body)
			if status != tc.status || code != tc.code {
				t.Fatalf("got %d %q, want %d %q", status, code, tc.status, tc.code)
			}
		})
	}
	g := s.tokGate()
	if b, tk := testutil.ToFloat64(g.gBytes), testutil.ToFloat64(g.gTokens); b != 0 || tk != 0 {
		t.Fatalf("after the requests: %v bytes, %v tokens still reserved", b, tk)
	}
	// Another request holds the bytes: saturated, with Retry-After.
	held, e := g.acquire(60 << 10)
	if e != nil {
		t.Fatal(e)
	}
	req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/chat/completions", bytes.NewReader(chatOf(strings.Repeat("hello ", 1000))))
	req.Header.Set("X-Session-ID", "sat")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(raw), CodeTokenizerSaturated) || resp.Header.Get("Retry-After") != "2" {
		t.Fatalf("saturated: %d %s (Retry-After %q)", resp.StatusCode, raw, resp.Header.Get("Retry-After"))
	}
	g.done(60<<10, held, 0)()
	if n := testutil.ToFloat64(g.rejected.WithLabelValues(CodeTokenizerSaturated)); n != 1 {
		t.Fatalf("tokenizer_saturated counted %v times", n)
	}
}

// TestTokenizeStopsWhenClientLeaves (issue 23 item 3): a client that goes away while its prompt
// is tokenized stops the tokenization (the context reaches the encode loop): the handler ends,
// the stop is counted and every reservation comes back. The prompt is one 2 MiB run of
// letters, seconds of BPE merges.
func TestTokenizeStopsWhenClientLeaves(t *testing.T) {
	lim := DefaultTokenizeLimits()
	s, gw, _ := tokGateway(t, lim)
	g := s.tokGate()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, _, err := postGW(t, ctx, gw.URL+"/generate", textOf(strings.Repeat("a", 2<<20)))
		done <- err
	}()
	// Wait until the tokenization runs (its bytes are reserved), then leave.
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for testutil.ToFloat64(g.gBytes) == 0 {
		<-tick.C
	}
	t0 := time.Now()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("client: %v", err)
	}
	for testutil.ToFloat64(g.cancelled) == 0 || testutil.ToFloat64(g.gBytes) != 0 || testutil.ToFloat64(g.gTokens) != 0 {
		if time.Since(t0) > time.Minute { // encoding it whole takes seconds: it did not stop
			t.Fatalf("tokenization not stopped a minute after the client left")
		}
		<-tick.C
	}
	t.Logf("tokenization stopped %s after the client left", time.Since(t0).Round(time.Millisecond))
}

// postGW posts a body and returns the status and error code (a session header set).
func postGW(t *testing.T, ctx context.Context, url string, body []byte) (int, string, error) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("X-Session-ID", "tok-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	_ = json.Unmarshal(raw, &e)
	return resp.StatusCode, e.Error.Code, nil
}

// TestWorkerRefusalsNotClientErrors (issue 23 item 3): a body the gateway accepted but a worker
// refuses is the worker's limit (413 worker_body_too_large, its message) or a disagreement
// (502 worker_refused), not the client's 400.
func TestWorkerRefusalsNotClientErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		we     workerError
		status int
		code   string
	}{
		{"worker body limit", workerError{role: rolePrefill, status: 413, code: "body_too_large", message: "body larger than 8388608 bytes, kvc-sim's limit"}, 413, codeWorkerBodyTooLarge},
		{"worker refuses what the gateway took", workerError{role: roleDecode, status: 400, code: "bad_request", message: "input_ids: too long"}, 502, codeWorkerRefused},
		{"other worker errors unchanged", workerError{role: roleDecode, status: 500, code: "internal", message: "boom"}, 500, "internal"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := classify(&tc.we, &plan{}, context.Background(), context.Background())
			if r.status != tc.status || r.code != tc.code || !strings.Contains(r.message, tc.we.message) {
				t.Fatalf("got %d %s %q", r.status, r.code, r.message)
			}
		})
	}
}
