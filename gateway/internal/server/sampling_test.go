package server

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// samplingGoldens are api's SGLang goldens (testdata/sampling.json) by name.
func samplingGoldens(t *testing.T) map[string]struct{ API, Body, SamplingParams, Error string } {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "api", "testdata", "sampling.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cases []struct {
		Name           string `json:"name"`
		API            string `json:"api"`
		Body           string `json:"body"`
		SamplingParams string `json:"sampling_params"`
		Error          string `json:"error"`
	}
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatal(err)
	}
	out := map[string]struct{ API, Body, SamplingParams, Error string }{}
	for _, c := range cases {
		out[c.Name] = struct{ API, Body, SamplingParams, Error string }{c.API, c.Body, c.SamplingParams, c.Error}
	}
	return out
}

// TestSamplingThroughTheGateway: on each API the decode worker's /generate body carries the
// sampling_params SGLang builds for the request, byte for byte (api's goldens); a request SGLang
// refuses is the gateway's 400 invalid_parameter with SGLang's message, and no worker is called.
func TestSamplingThroughTheGateway(t *testing.T) {
	goldens := samplingGoldens(t)
	dw := newIDsWorker(t, []int64{5, 6})
	rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
		return &kvcv1.RouteDecision{DecisionId: "d-1", Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Decode:    &kvcv1.WorkerRef{WorkerId: "d0", WorkerUrl: dw.URL},
			Execution: &kvcv1.RouteExecution{CallDecode: true}}
	}}
	s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{DefaultMaxTok: 256}}, zerolog.Nop(), NewMetrics(prometheus.NewRegistry()))
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	defer gw.Close()
	paths := map[string]string{"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}

	for _, name := range []string{"chat greedy", "chat stop list", "chat logit_bias", "chat response_format json_schema",
		"chat custom_params", "chat no max tokens", "completions sampling", "completions response_format json_schema",
		"generate sampling", "generate no max", "generate nulls",
		"chat temperature negative", "chat top_k zero", "completions top_p above one", "generate min above max"} {
		t.Run(name, func(t *testing.T) {
			c, ok := goldens[name]
			if !ok {
				t.Fatalf("no golden %q", name)
			}
			dw.mu.Lock()
			dw.sampling = nil
			dw.mu.Unlock()
			req, _ := http.NewRequest(http.MethodPost, gw.URL+paths[c.API], bytes.NewReader([]byte(c.Body)))
			req.Header.Set("X-Session-ID", "s-1")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			out, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			dw.mu.Lock()
			got := dw.sampling
			dw.mu.Unlock()
			if c.Error != "" {
				var e struct {
					Error struct{ Code, Message string }
				}
				_ = json.Unmarshal(out, &e)
				if resp.StatusCode != http.StatusBadRequest || e.Error.Code != api.CodeInvalidParameter || e.Error.Message != c.Error {
					t.Fatalf("%d %s, want 400 invalid_parameter: %s", resp.StatusCode, out, c.Error)
				}
				if got != nil {
					t.Fatalf("the worker was called: %s", got)
				}
				return
			}
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, out)
			}
			if string(got) != c.SamplingParams {
				t.Fatalf("worker's sampling_params\n got %s\nwant %s", got, c.SamplingParams)
			}
		})
	}
}

// A logit_bias the gateway refuses (api.TestLogitBias) is a 400 invalid_parameter naming the key
// before any routing: no query reaches the control plane, no worker is called.
func TestLogitBiasRefusedBeforeRouting(t *testing.T) {
	dw := newIDsWorker(t, []int64{5})
	rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
		return &kvcv1.RouteDecision{DecisionId: "d-1", Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Decode: &kvcv1.WorkerRef{WorkerId: "d0", WorkerUrl: dw.URL}, Execution: &kvcv1.RouteExecution{CallDecode: true}}
	}}
	m := NewMetrics(prometheus.NewRegistry())
	s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{DefaultMaxTok: 8}}, zerolog.Nop(), m)
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	defer func() { gw.Close(); s.Close() }()
	for _, tc := range []struct{ name, path, body, want string }{
		{"chat above 100", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"logit_bias":{"7":1,"50256":150}}`,
			`logit_bias["50256"] is 150, outside [-100, 100]`},
		{"completions key not an id", "/v1/completions", `{"prompt":"x","logit_bias":{"<eos>":-100}}`,
			`logit_bias key "<eos>" is not a token id (an integer)`},
		{"generate value not a number", "/generate", `{"text":"x","sampling_params":{"logit_bias":{"7":"-100"}}}`,
			`logit_bias["7"] must be a number, got a string`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, gw.URL, tc.path, "s-1", tc.body)
			code, msg := errBody(t, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusBadRequest || code != api.CodeInvalidParameter || msg != tc.want {
				t.Fatalf("%d %s %q, want 400 invalid_parameter %q", resp.StatusCode, code, msg, tc.want)
			}
		})
	}
	rr.mu.Lock()
	defer rr.mu.Unlock()
	dw.mu.Lock()
	defer dw.mu.Unlock()
	if len(rr.queries) != 0 || dw.body != nil {
		t.Fatalf("%d queries reached the control plane, worker body %v: want none", len(rr.queries), dw.body)
	}
	if got := testutil.ToFloat64(m.BadRequests.WithLabelValues(api.CodeInvalidParameter)); got != 3 {
		t.Fatalf("bad_requests{invalid_parameter} = %v, want 3", got)
	}
}
