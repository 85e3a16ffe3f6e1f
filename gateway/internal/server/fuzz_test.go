package server

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// FuzzDecodeStream feeds arbitrary worker answers (an untrusted stream) through the decode path:
// nothing may panic, and every result is either a success or carries an error kind.
func FuzzDecodeStream(f *testing.F) {
	f.Add("data: {\"text\":\"a\",\"meta_info\":{\"completion_tokens\":1}}\n\ndata: [DONE]\n\n", true)
	f.Add("data: {\"error\":{\"code\":\"kv_verify_failed\",\"message\":\"x\"}}\n\n", true)
	f.Add("data: not json\n\n", true)
	f.Add("data: {\"text\":5}\n", true)
	f.Add("{\"text\":\"whole\",\"meta_info\":{\"kvc\":{\"kv_len_after\":9}}}", false)
	f.Add("", true)
	f.Add("data:\n\ndata: [DONE]", true)
	f.Fuzz(func(t *testing.T, body string, sse bool) {
		w := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			if sse {
				w.Header().Set("Content-Type", "text/event-stream")
			} else {
				w.Header().Set("Content-Type", "application/json")
			}
			_, _ = w.Write([]byte(body))
		}))
		defer w.Close()
		s := New(nil, nil, Options{RequestTimeout: 5 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20}, zerolog.Nop(), NewMetrics(prometheus.NewRegistry()))
		defer s.Close()
		req := &api.Request{Kind: api.Chat, RID: "r", SessionID: "s", InputTokens: 10, MaxTokens: 4, Stream: true}
		p := &plan{mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, decode: &kvcv1.WorkerRef{WorkerUrl: w.URL}}
		rec := httptest.NewRecorder()
		res := s.execute(context.Background(), context.Background(), time.Now(), p, req, newSink(rec, req))
		if !res.ok && res.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_UNSPECIFIED {
			t.Fatalf("failure without a kind: %+v", res)
		}
	})
}

// FuzzParsedAnswer feeds arbitrary worker answers through the reasoning and tool-call parsers
// (--reasoning-parser qwen3, --tool-call-parser qwen25), whole and streamed: nothing may panic,
// a whole answer is one JSON document, each streamed event one, and a streamed tool call's
// arguments a JSON string.
func FuzzParsedAnswer(f *testing.F) {
	f.Add("<think>a</think>b<tool_call>\n{\"name\":\"f\",\"arguments\":{\"x\":1}}\n</tool_call>", "</thi", false)
	f.Add("<tool_call>\n[{\"name\":[1]}]\n</tool_call>", "", false)
	f.Add("<th", "ink>x", true)
	f.Fuzz(func(t *testing.T, a, b string, stream bool) {
		w := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			for _, text := range []string{a, b} {
				c, _ := json.Marshal(map[string]any{"text": text, "meta_info": map[string]any{"completion_tokens": 1}})
				_, _ = w.Write([]byte("data: " + string(c) + "\n\n"))
			}
			_, _ = w.Write([]byte("data: [DONE]\n\n"))
		}))
		defer w.Close()
		s := New(nil, nil, Options{RequestTimeout: 5 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
			Parse: api.Options{ToolCallParser: "qwen25", ReasoningParser: "qwen3"}}, zerolog.Nop(), NewMetrics(prometheus.NewRegistry()))
		defer s.Close()
		tools := &api.ChatTools{Choice: api.ChoiceAuto, Tools: []api.ToolFunc{{Name: "f"}}, SeparateReasoning: true, StreamReasoning: true}
		req := &api.Request{Kind: api.Chat, RID: "r", SessionID: "s", InputTokens: 10, MaxTokens: 4, Stream: stream, Tools: tools}
		p := &plan{mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, decode: &kvcv1.WorkerRef{WorkerUrl: w.URL}}
		rec := httptest.NewRecorder()
		out := newSink(rec, req)
		if s.parsesAnswers(req) {
			out.answer = s.answer
		}
		s.streamsReasoning(req, out)
		res := s.execute(context.Background(), context.Background(), time.Now(), p, req, out)
		if !res.ok {
			return
		}
		out.finish(p, res)
		if !stream && !json.Valid(rec.Body.Bytes()) {
			t.Fatalf("answer %q", rec.Body.String())
		}
		if stream {
			// Every event is one JSON document; a tool call's arguments are a JSON string.
			for _, e := range sse(t, rec.Body) {
				var ch struct {
					Choices []struct {
						Delta struct {
							ToolCalls []struct {
								Function struct {
									Arguments string `json:"arguments"`
								} `json:"function"`
							} `json:"tool_calls"`
						} `json:"delta"`
					} `json:"choices"`
				}
				if e != "[DONE]" && json.Unmarshal([]byte(e), &ch) != nil {
					t.Fatalf("event %q", e)
				}
				for _, c := range ch.Choices {
					for _, tc := range c.Delta.ToolCalls {
						if !json.Valid([]byte(tc.Function.Arguments)) {
							t.Fatalf("arguments %q", tc.Function.Arguments)
						}
					}
				}
			}
		}
	})
}
