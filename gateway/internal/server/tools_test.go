package server

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// sglangTemplateInputs is a case of api's SGLang goldens (testdata/chat_params.json): the
// request body and the tools JSON and template kwargs SGLang renders it with.
func sglangTemplateInputs(t *testing.T, name string) (body json.RawMessage, tools string, vars map[string]any) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "api", "testdata", "chat_params.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cases []struct {
		Name  string          `json:"name"`
		Body  json.RawMessage `json:"body"`
		Tools *string         `json:"tools"`
		Vars  string          `json:"vars"`
	}
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		if c.Name == name && c.Tools != nil {
			v, err := pyjson.Decode([]byte(c.Vars))
			if err != nil {
				t.Fatal(err)
			}
			vars, _ = pyjson.Plain(v).(map[string]any)
			return c.Body, *c.Tools, vars
		}
	}
	t.Fatalf("no golden %q with tools", name)
	return nil, "", nil
}

// TestChatToolsThroughTheGateway: with --tokenizer (Qwen3) and SGLang's parsers, a chat
// request with tools reaches the worker as the ids of the chat template rendered with SGLang's
// tools JSON and kwargs (the tools in the prompt), skip_special_tokens false; the answer comes
// back with reasoning_content, tool_calls and finish_reason "tool_calls", whole or streamed. A
// request with tools but no tokenizer is a 400 unsupported_parameter.
func TestChatToolsThroughTheGateway(t *testing.T) {
	tok, _ := qwen3(t)
	body, toolsJSON, vars := sglangTemplateInputs(t, "tools and effort")
	dw := startIDsWorker(t, &idsWorker{out: []int64{1, 2, 3}, texts: []string{
		"<think>\nThe user wants the weather.\n</think>\n\n",
		"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}",
		"\n</tool_call>",
	}})
	rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
		return &kvcv1.RouteDecision{DecisionId: "d-1", Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Decode:    &kvcv1.WorkerRef{WorkerId: "d0", WorkerUrl: dw.URL},
			Execution: &kvcv1.RouteExecution{CallDecode: true, KeepSession: true}}
	}}
	m := NewMetrics(prometheus.NewRegistry())
	content := &Content{Tok: tok, PageSize: 16}
	s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse:   api.Options{RequireSession: true, DefaultMaxTok: 16, ToolCallParser: "qwen25", ReasoningParser: "qwen3"},
		Content: content}, zerolog.Nop(), m)
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	defer gw.Close()

	post := func(b []byte) (*http.Response, []byte) {
		req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/chat/completions", bytes.NewReader(b))
		req.Header.Set("X-Session-ID", "agent-1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		return resp, out
	}
	resp, out := post(body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}

	// The worker got the ids of SGLang's rendering: the tools and kwargs in the template.
	var msgs []tokenizer.Message
	var b struct {
		Messages json.RawMessage `json:"messages"`
	}
	_ = json.Unmarshal(body, &b)
	_ = json.Unmarshal(b.Messages, &msgs)
	text, err := tok.ApplyChatTemplate(msgs, tokenizer.ChatOptions{AddGenerationPrompt: true, ToolsJSON: json.RawMessage(toolsJSON), Vars: vars})
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := tok.ApplyChatTemplate(msgs, tokenizer.ChatOptions{AddGenerationPrompt: true})
	if !strings.Contains(text, `"name": "get_weather"`) || text == plain {
		t.Fatalf("the rendering with tools has no tools:\n%s", text)
	}
	want := tok.Encode(text, false)
	dw.mu.Lock()
	wb := dw.body
	dw.mu.Unlock()
	ids, _ := wb["input_ids"].([]any)
	if len(ids) != len(want) {
		t.Fatalf("worker got %d ids, the rendering with tools has %d", len(ids), len(want))
	}
	for i := range want {
		if int64(ids[i].(float64)) != int64(want[i]) {
			t.Fatalf("input_ids[%d] = %v, want %d", i, ids[i], want[i])
		}
	}
	if sp, _ := wb["sampling_params"].(map[string]any); sp["skip_special_tokens"] != false {
		t.Fatalf("sampling_params %v: skip_special_tokens false wanted", sp)
	}

	// The answer, as SGLang's serving_chat returns it.
	var ans struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
			Message      struct {
				Role             string         `json:"role"`
				Content          *string        `json:"content"`
				ReasoningContent *string        `json:"reasoning_content"`
				ToolCalls        []api.ToolCall `json:"tool_calls"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(out, &ans); err != nil || len(ans.Choices) != 1 {
		t.Fatalf("answer %s: %v", out, err)
	}
	c := ans.Choices[0]
	if c.FinishReason != "tool_calls" || c.Message.Content == nil || *c.Message.Content != "" ||
		c.Message.ReasoningContent == nil || *c.Message.ReasoningContent != "\nThe user wants the weather.\n" {
		t.Fatalf("answer %s", out)
	}
	if len(c.Message.ToolCalls) != 1 || c.Message.ToolCalls[0].Type != "function" || !strings.HasPrefix(c.Message.ToolCalls[0].ID, "call_") ||
		c.Message.ToolCalls[0].Function.Name != "get_weather" || c.Message.ToolCalls[0].Function.Arguments != `{"city": "Paris", "unit": "c"}` {
		t.Fatalf("tool calls %+v", c.Message.ToolCalls)
	}
	if testutil.ToFloat64(m.ToolCalls) != 1 || testutil.ToFloat64(m.ReasoningAnswers) != 1 || testutil.ToFloat64(m.ToolRequests.WithLabelValues("auto")) != 1 {
		t.Fatalf("metrics: tool calls %v, reasoning answers %v, tool requests %v", testutil.ToFloat64(m.ToolCalls),
			testutil.ToFloat64(m.ReasoningAnswers), testutil.ToFloat64(m.ToolRequests.WithLabelValues("auto")))
	}

	// Streamed: the reasoning as reasoning_content deltas, then the call whole in one tool_calls
	// delta (its arguments one JSON string), finish_reason "tool_calls"; no markup as content.
	var streamed map[string]any
	_ = json.Unmarshal(body, &streamed)
	streamed["stream"] = true
	sb, _ := json.Marshal(streamed)
	resp, out = post(sb)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("streamed: status %d: %s", resp.StatusCode, out)
	}
	var reasoning, contentText, finish string
	var streamedCalls []map[string]any
	for _, e := range sse(t, bytes.NewReader(out)) {
		if e == "[DONE]" {
			break
		}
		var ch struct {
			Choices []struct {
				Delta struct {
					Content          string           `json:"content"`
					ReasoningContent string           `json:"reasoning_content"`
					ToolCalls        []map[string]any `json:"tool_calls"`
				} `json:"delta"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(e), &ch); err != nil || len(ch.Choices) != 1 {
			t.Fatalf("event %s: %v", e, err)
		}
		d := ch.Choices[0].Delta
		reasoning, contentText = reasoning+d.ReasoningContent, contentText+d.Content
		streamedCalls = append(streamedCalls, d.ToolCalls...)
		if f := ch.Choices[0].FinishReason; f != nil {
			finish = *f
		}
	}
	if reasoning != "\nThe user wants the weather.\n" || strings.TrimSpace(contentText) != "" || finish != "tool_calls" || len(streamedCalls) != 1 {
		t.Fatalf("streamed answer: reasoning %q, content %q, finish %q, calls %v", reasoning, contentText, finish, streamedCalls)
	}
	if fn, _ := streamedCalls[0]["function"].(map[string]any); fn["name"] != "get_weather" || fn["arguments"] != `{"city": "Paris", "unit": "c"}` ||
		streamedCalls[0]["type"] != "function" || streamedCalls[0]["index"] != float64(0) || !strings.HasPrefix(fmt.Sprint(streamedCalls[0]["id"]), "call_") {
		t.Fatalf("streamed call %v", streamedCalls[0])
	}
	if testutil.ToFloat64(m.ToolCalls) != 2 {
		t.Fatalf("tool calls counted %v, want 2", testutil.ToFloat64(m.ToolCalls))
	}

	// Refused rather than served differently.
	for _, c := range []struct {
		name string
		run  func() (*http.Response, []byte)
	}{
		{"no tokenizer", func() (*http.Response, []byte) { s.opt.Content = &Content{PageSize: 16}; return post(body) }},
	} {
		name := c.name
		resp, out := c.run()
		var e struct {
			Error struct{ Code string } `json:"error"`
		}
		_ = json.Unmarshal(out, &e)
		if resp.StatusCode != http.StatusBadRequest || e.Error.Code != api.CodeUnsupportedParameter {
			t.Fatalf("%s: status %d %s", name, resp.StatusCode, out)
		}
	}
}

// TestChatReasoningStreamed: with --reasoning-parser a streamed chat answer comes as
// reasoning_content deltas then content deltas, split chunk by chunk as SGLang splits them
// (the toolcall package's golden "stream split tags", from SGLang's ReasoningParser).
func TestChatReasoningStreamed(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "toolcall", "testdata", "tool_parse.json"))
	if err != nil {
		t.Fatal(err)
	}
	var cases []struct {
		Name   string      `json:"name"`
		Chunks []string    `json:"chunks"`
		Steps  [][2]string `json:"steps"`
		End    [2]string   `json:"end"`
	}
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatal(err)
	}
	var chunks []string
	var wantR, wantC string
	for _, c := range cases {
		if c.Name == "stream split tags" {
			chunks = c.Chunks
			for _, st := range append(c.Steps, c.End) {
				wantR, wantC = wantR+st[0], wantC+st[1]
			}
		}
	}
	if len(chunks) == 0 || wantR == "" || wantC == "" {
		t.Fatal("no golden")
	}
	ids := make([]int64, len(chunks))
	dw := startIDsWorker(t, &idsWorker{out: ids, texts: chunks})
	rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
		return &kvcv1.RouteDecision{DecisionId: "d-1", Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Decode:    &kvcv1.WorkerRef{WorkerId: "d0", WorkerUrl: dw.URL},
			Execution: &kvcv1.RouteExecution{CallDecode: true, KeepSession: true}}
	}}
	m := NewMetrics(prometheus.NewRegistry())
	s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{RequireSession: true, DefaultMaxTok: 16, ReasoningParser: "qwen3"}}, zerolog.Nop(), m)
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	defer gw.Close()

	req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/chat/completions",
		strings.NewReader(`{"stream":true,"messages":[{"role":"user","content":"weather?"}]}`))
	req.Header.Set("X-Session-ID", "agent-2")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	var gotR, gotC string
	events := 0
	for _, line := range strings.Split(string(body), "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct {
					Role             string  `json:"role"`
					Content          *string `json:"content"`
					ReasoningContent *string `json:"reasoning_content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil || len(ev.Choices) != 1 {
			t.Fatalf("event %s: %v", data, err)
		}
		d := ev.Choices[0].Delta
		if (events == 0) != (d.Role == "assistant") {
			t.Fatalf("event %d role %q", events, d.Role)
		}
		if d.ReasoningContent != nil {
			if gotC != "" {
				t.Fatalf("reasoning after content: %s", body)
			}
			gotR += *d.ReasoningContent
		}
		if d.Content != nil {
			gotC += *d.Content
		}
		events++
	}
	if gotR != wantR || gotC != wantC {
		t.Fatalf("reasoning %q content %q, want %q %q\n%s", gotR, gotC, wantR, wantC, body)
	}
	if v := testutil.ToFloat64(m.ReasoningAnswers); v != 1 {
		t.Fatalf("reasoning answers %v", v)
	}
}

// TestToolCallArgumentsAreStrings: a tool call's function.arguments reaches the client as a JSON
// string (OpenAI's type, as SGLang writes it: json.dumps of what the model wrote), in the whole
// answer's message.tool_calls and in a streamed answer's delta.tool_calls (the answer cut into
// ~5-byte chunks), whatever form the model gave its arguments in — an object (the usual case),
// "parameters" instead of "arguments", none, a list of calls, or a string it had encoded itself
// (SGLang encodes it again: a JSON string whose text is a JSON string) — for both parsers.
// Qwen3-Coder's XML call format (<function=…><parameter=…>) is not a JSON call: no tool_calls
// (its SGLang parser, qwen3_coder, is not one the gateway serves).
func TestToolCallArgumentsAreStrings(t *testing.T) {
	tok, _ := qwen3(t)
	tests := []struct {
		name, parser, text string
		wantArgs           []string // each call's arguments, the exact JSON string; nil: no call
	}{
		{"object", "qwen25", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": [1, 2.5], \"opts\": {\"u\": null}}}\n</tool_call>",
			[]string{`{"city": "Zürich", "days": [1, 2.5], "opts": {"u": null}}`}},
		{"compact object", "qwen25", "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>",
			[]string{`{"city": "Paris"}`}},
		{"parameters", "qwen25", "<tool_call>\n{\"name\": \"get_time\", \"parameters\": {\"tz\": \"UTC\"}}\n</tool_call>", []string{`{"tz": "UTC"}`}},
		{"no arguments", "qwen25", "<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>", []string{`{}`}},
		{"a list of calls", "qwen25", "<tool_call>\n[{\"name\": \"get_time\"}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}]\n</tool_call>",
			[]string{`{}`, `{"city": "Oslo"}`}},
		{"arguments already a string", "qwen25", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"UTC\\\"}\"}\n</tool_call>",
			[]string{`"{\"tz\": \"UTC\"}"`}},
		{"hermes object", "hermes", "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>", []string{`{"city": "Paris"}`}},
		{"qwen3-coder xml", "qwen25", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", nil},
	}
	body := []byte(`{"model":"m","max_tokens":256,"messages":[{"role":"user","content":"weather?"}],"tools":[` +
		`{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}},` +
		`{"type":"function","function":{"name":"get_time","parameters":{"type":"object","properties":{"tz":{"type":"string"}}}}}]}`)
	for _, tc := range tests {
		for _, stream := range []bool{false, true} {
			tt := tc
			t.Run(fmt.Sprintf("%s/stream=%v", tt.name, stream), func(t *testing.T) {
				testToolCallArguments(t, tok, body, tt.parser, tt.text, tt.wantArgs, stream)
			})
		}
	}
}

// chunksOf cuts s into pieces of about n bytes on rune boundaries (the worker's chunks).
func chunksOf(s string, n int) []string {
	var out []string
	for len(s) > 0 {
		i := min(n, len(s))
		for i < len(s) && !utf8.RuneStart(s[i]) {
			i++
		}
		out = append(out, s[:i])
		s = s[i:]
	}
	return out
}

// testToolCallArguments serves one answer text (streamed: in chunks of about 5 bytes) under
// parser and checks its calls' arguments are the JSON strings wantArgs.
func testToolCallArguments(t *testing.T, tok *tokenizer.Tokenizer, body []byte, parser, text string, wantArgs []string, stream bool) {
	texts := []string{text}
	if stream {
		texts = chunksOf(text, 5)
	}
	out := make([]int64, len(texts))
	dw := startIDsWorker(t, &idsWorker{out: out, texts: texts})
	rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
		return &kvcv1.RouteDecision{DecisionId: "d-1", Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Decode: &kvcv1.WorkerRef{WorkerId: "d0", WorkerUrl: dw.URL}, Execution: &kvcv1.RouteExecution{CallDecode: true}}
	}}
	s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
		Parse: api.Options{DefaultMaxTok: 16, ToolCallParser: parser}, Content: &Content{Tok: tok, PageSize: 16}},
		zerolog.Nop(), NewMetrics(prometheus.NewRegistry()))
	mux := http.NewServeMux()
	s.Register(mux)
	gw := httptest.NewServer(mux)
	defer func() { gw.Close(); s.Close() }()
	b := body
	if stream {
		b = append([]byte(`{"stream":true,`), body[1:]...)
	}
	resp := post(t, gw.URL, "/v1/chat/completions", "s-1", string(b))
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	type choice struct {
		FinishReason *string `json:"finish_reason"`
		Message      struct {
			ToolCalls []map[string]any `json:"tool_calls"`
		} `json:"message"`
		Delta struct {
			ToolCalls []map[string]any `json:"tool_calls"`
		} `json:"delta"`
	}
	var ans struct{ Choices []choice }
	if !stream && (resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &ans) != nil || len(ans.Choices) != 1) {
		t.Fatalf("%d %s", resp.StatusCode, raw)
	}
	calls := []map[string]any(nil)
	finish := ""
	if stream {
		for _, e := range sse(t, bytes.NewReader(raw)) {
			var ch struct{ Choices []choice }
			if e == "[DONE]" || json.Unmarshal([]byte(e), &ch) != nil || len(ch.Choices) != 1 {
				continue
			}
			calls = append(calls, ch.Choices[0].Delta.ToolCalls...)
			if f := ch.Choices[0].FinishReason; f != nil {
				finish = *f
			}
		}
	} else {
		calls = ans.Choices[0].Message.ToolCalls
		finish = *ans.Choices[0].FinishReason
	}
	if len(calls) != len(wantArgs) {
		t.Fatalf("%d tool calls, want %d: %s", len(calls), len(wantArgs), raw)
	}
	for i, c := range calls {
		fn, _ := c["function"].(map[string]any)
		args, isString := fn["arguments"].(string)
		if !isString || args != wantArgs[i] {
			t.Fatalf("call %d's arguments %#v (a %T), want the JSON string %q", i, fn["arguments"], fn["arguments"], wantArgs[i])
		}
		if !json.Valid([]byte(args)) || c["type"] != "function" {
			t.Fatalf("call %d: %v", i, c)
		}
	}
	if wantArgs != nil && finish != "tool_calls" {
		t.Fatalf("finish_reason %q", finish)
	}
}
