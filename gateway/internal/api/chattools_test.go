package api

import (
	"encoding/json"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
	"github.com/kvcentric/kvcentric/pkg/tokenizer/tokenizertest"
)

// chatParamsGolden is one case of testdata/chat_params.json (gen_chat_params.py: SGLang
// 0.5.23's ChatCompletionRequest, _validate_request and its tool and template-kwargs rule).
type chatParamsGolden struct {
	Name       string          `json:"name"`
	Body       json.RawMessage `json:"body"`
	Defaults   json.RawMessage `json:"defaults"` // the server's --default-chat-template-kwargs
	Invalid    string          `json:"invalid"`  // pydantic refused the body (any message)
	Error      string          `json:"error"`    // _validate_request's message
	ToolChoice json.RawMessage `json:"tool_choice"`
	Tools      *string         `json:"tools"`
	Vars       string          `json:"vars"`
	// PromptQwen3 is transformers' apply_chat_template of the body's messages with those tools
	// and kwargs, as SGLang renders it, with the committed Qwen3 tokenizer.
	PromptQwen3 *string `json:"prompt_qwen3"`
}

// qwen3Tokenizer loads the committed Qwen3 tokenizer (pkg/tokenizer/testdata).
func qwen3Tokenizer(t *testing.T) *tokenizer.Tokenizer {
	t.Helper()
	dir, err := tokenizertest.Qwen3Dir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func parseGoldenBody(t *testing.T, raw, defaults []byte) (*ChatTools, *Error) {
	t.Helper()
	var b body
	if err := json.Unmarshal(raw, &b); err != nil {
		t.Fatal(err)
	}
	var d *pyjson.Object
	if len(defaults) > 0 && string(defaults) != "null" {
		var err error
		if d, err = ParseDefaultKwargs(string(defaults)); err != nil || d == nil {
			t.Fatalf("defaults %s: %v", defaults, err)
		}
	}
	return parseChatTools(chatToolFields{Tools: b.Tools, ToolChoice: b.ToolChoice, ChatTemplateKwargs: b.ChatTemplateKwargs,
		ReasoningEffort: b.ReasoningEffort, Reasoning: b.Reasoning, SeparateReasoning: b.SeparateReasoning, Defaults: d}, false)
}

func TestParseDefaultKwargs(t *testing.T) {
	for _, c := range []struct {
		in   string
		keys int
		ok   bool
	}{{"", 0, true}, {"{}", 0, true}, {`{"enable_thinking":false,"a":1}`, 2, true}, {"[1]", 0, false}, {"{", 0, false}, {`{"chat_template":"x"}`, 0, false}} {
		o, err := ParseDefaultKwargs(c.in)
		if (err == nil) != c.ok || (o != nil && len(o.Keys) != c.keys) || (o == nil && c.keys > 0) {
			t.Errorf("%q: %v %v", c.in, o, err)
		}
	}
}

// TestChatParamsGolden: the tools JSON the template gets, its extra variables, the tool choice
// and the errors are SGLang's, byte for byte; and the Qwen3 prompt rendered with them (full and
// through RenderChat, the gateway's cached path) is the one SGLang renders.
func TestChatParamsGolden(t *testing.T) {
	tok := qwen3Tokenizer(t)
	prompts := 0
	raw, err := os.ReadFile("testdata/chat_params.json")
	if err != nil {
		t.Fatal(err)
	}
	var cases []chatParamsGolden
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatal(err)
	}
	if len(cases) < 20 {
		t.Fatalf("%d cases", len(cases))
	}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			ct, e := parseGoldenBody(t, c.Body, c.Defaults)
			var b struct{ Messages []tokenizer.Message }
			if err := json.Unmarshal(c.Body, &b); err != nil {
				t.Fatal(err)
			}
			for i, m := range b.Messages { // as Parse does: the history's tool-call arguments
				if e != nil {
					break
				}
				b.Messages[i].ToolCalls, e = toolCallArguments(m.Role, m.ToolCalls)
			}
			switch {
			case c.Invalid != "":
				if e == nil || e.Code != CodeInvalidParameter || e.Status != http.StatusBadRequest {
					t.Fatalf("SGLang refuses the body (%s); got %+v, %v", c.Invalid, ct, e)
				}
				return
			case c.Error != "":
				if e == nil || e.Message != c.Error || e.Code != CodeInvalidParameter {
					t.Fatalf("error %v, want %q", e, c.Error)
				}
				return
			}
			if e != nil {
				t.Fatalf("unexpected error %v", e)
			}
			var choice any
			if err := json.Unmarshal(c.ToolChoice, &choice); err != nil {
				t.Fatal(err)
			}
			if m, ok := choice.(map[string]any); ok {
				name, _ := m["function"].(string)
				if ct.Choice != ChoiceFunction || ct.Named == nil || *ct.Named != name {
					t.Fatalf("choice %q %v, want function %q", ct.Choice, ct.Named, name)
				}
			} else if ct.Choice != choice {
				t.Fatalf("choice %q, want %v", ct.Choice, choice)
			}
			got := string(ct.ToolsJSON)
			switch {
			case c.Tools == nil && ct.ToolsJSON != nil:
				t.Fatalf("tools %s, want none", got)
			case c.Tools != nil && got != *c.Tools:
				t.Fatalf("tools\n got %s\nwant %s", got, *c.Tools)
			}
			vars := map[string]any{}
			for k, v := range ct.Vars {
				vars[k] = v
			}
			if g := pyjson.Dumps(vars, pyjson.Options{Compact: true, SortKeys: true}); g != c.Vars {
				t.Fatalf("vars\n got %s\nwant %s", g, c.Vars)
			}
			if c.PromptQwen3 == nil {
				t.Fatal("no SGLang prompt in the golden")
			}
			prompts++
			opts := tokenizer.ChatOptions{AddGenerationPrompt: true, ToolsJSON: ct.ToolsJSON, Vars: ct.Vars}
			got, err = tok.ApplyChatTemplate(b.Messages, opts)
			if err != nil {
				t.Fatal(err)
			}
			if got != *c.PromptQwen3 {
				t.Fatalf("prompt\n got %q\nwant %q", got, *c.PromptQwen3)
			}
			r, err := tok.RenderChat(b.Messages, opts, nil)
			if err != nil || r.Text != *c.PromptQwen3 {
				t.Fatalf("RenderChat %v: %q", err, r.Text)
			}
		})
	}
	if prompts < 20 {
		t.Fatalf("%d prompts compared", prompts)
	}
}

// TestParseChatToolsGateway: what the gateway refuses rather than serve differently.
func TestParseChatToolsGateway(t *testing.T) {
	const tool = `{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}`
	const strict = `{"type":"function","function":{"name":"f","strict":true}}`
	msgs := `"messages":[{"role":"user","content":"x"}]`
	parsers := Options{DefaultMaxTok: 8, ToolCallParser: "qwen25", ReasoningParser: "qwen3"}
	plain := Options{DefaultMaxTok: 8}
	cases := []struct {
		name, body string
		opt        Options
		wantCode   string
		check      func(*testing.T, *Request)
	}{
		{"required", `{` + msgs + `,"tools":[` + tool + `],"tool_choice":"required"}`, plain, CodeUnsupportedParameter, nil},
		{"named", `{` + msgs + `,"tools":[` + tool + `],"tool_choice":{"type":"function","function":{"name":"f"}}}`, plain, CodeUnsupportedParameter, nil},
		{"named unknown is SGLang's error first", `{` + msgs + `,"tools":[` + tool + `],"tool_choice":{"type":"function","function":{"name":"g"}}}`, plain, CodeInvalidParameter, nil},
		{"strict with a parser", `{` + msgs + `,"tools":[` + strict + `]}`, parsers, CodeUnsupportedParameter, nil},
		{"strict without a parser", `{` + msgs + `,"tools":[` + strict + `]}`, plain, "", nil},
		{"strict with choice none", `{` + msgs + `,"tools":[` + strict + `],"tool_choice":"none"}`, parsers, "", nil},
		{"stream with tools and a parser", `{` + msgs + `,"stream":true,"tools":[` + tool + `]}`, Options{DefaultMaxTok: 8, ToolCallParser: "qwen25"}, "", nil},
		{"stream with tools, no parser", `{` + msgs + `,"stream":true,"tools":[` + tool + `]}`, plain, "", nil},
		{"stream with a reasoning parser", `{` + msgs + `,"stream":true,"stream_reasoning":false}`, Options{DefaultMaxTok: 8, ReasoningParser: "qwen3"}, "", func(t *testing.T, r *Request) {
			if !r.Tools.SeparateReasoning || r.Tools.StreamReasoning {
				t.Fatalf("tools %+v", r.Tools)
			}
		}},
		{"stream, reasoning not separated", `{` + msgs + `,"stream":true,"separate_reasoning":false}`, Options{DefaultMaxTok: 8, ReasoningParser: "qwen3"}, "", func(t *testing.T, r *Request) {
			if r.Tools.SeparateReasoning || !r.Tools.StreamReasoning {
				t.Fatalf("tools %+v", r.Tools)
			}
		}},
		{"message tools", `{"messages":[{"role":"system","content":"s","tools":[` + tool + `]},{"role":"user","content":"x"}]}`, plain, CodeUnsupportedParameter, nil},
		{"tools reach the request", `{` + msgs + `,"tools":[` + tool + `],"chat_template_kwargs":{"enable_thinking":false}}`, parsers, "", func(t *testing.T, r *Request) {
			if !r.Tools.HasTools() || !r.Tools.Template() || r.Tools.Vars["enable_thinking"] != false || !strings.Contains(string(r.Tools.ToolsJSON), `"name":"f"`) {
				t.Fatalf("tools %+v", r.Tools)
			}
		}},
		{"no tools", `{` + msgs + `}`, parsers, "", func(t *testing.T, r *Request) {
			if r.Tools == nil || r.Tools.HasTools() || r.Tools.Template() || r.Tools.Choice != ChoiceNone {
				t.Fatalf("tools %+v", r.Tools)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, e := Parse(Chat, http.Header{}, []byte(c.body), c.opt)
			if c.wantCode != "" {
				if e == nil || e.Code != c.wantCode || e.Status != http.StatusBadRequest {
					t.Fatalf("got %v, want %s", e, c.wantCode)
				}
				return
			}
			if e != nil {
				t.Fatal(e)
			}
			if c.check != nil {
				c.check(t, r)
			}
		})
	}
}

// FuzzChatTools: any tools / tool_choice / template inputs decode to a result or a 400, and
// the tools the template gets are valid JSON.
func FuzzChatTools(f *testing.F) {
	f.Add(`[{"type":"function","function":{"name":"f","parameters":{"a":1}}}]`, `"auto"`, `{"enable_thinking":false}`, `"low"`)
	f.Add(`[{"function":{"name":"f","strict":true},"defer_loading":true}]`, `{"type":"function","function":{"name":"f"}}`, `null`, `0.5`)
	f.Add(`{}`, `3`, `[1]`, `true`)
	f.Add(`[[[[`, `"none"`, `{"a":[1,{"b":2}]}`, `"0.1"`)
	f.Fuzz(func(t *testing.T, tools, choice, ctk, effort string) {
		ct, e := parseChatTools(chatToolFields{Tools: rawField(tools), ToolChoice: rawField(choice), ChatTemplateKwargs: rawField(ctk),
			ReasoningEffort: rawField(effort), Reasoning: rawField(`{"enabled":true}`)}, false)
		if e != nil {
			if e.Status != http.StatusBadRequest || e.Code == "" {
				t.Fatalf("error %+v", e)
			}
			return
		}
		if len(ct.ToolsJSON) > 0 && !json.Valid(ct.ToolsJSON) {
			t.Fatalf("tools JSON %q", ct.ToolsJSON)
		}
	})
}

// BenchmarkParseChatTools: a coding agent's request with 8 tools (the gateway's added work per
// chat request with tools).
func BenchmarkParseChatTools(b *testing.B) {
	var tools []string
	for i := range 8 {
		tools = append(tools, `{"type":"function","function":{"name":"tool`+string(rune('a'+i))+`","description":"Runs a shell command in the workspace and returns its output.",`+
			`"parameters":{"type":"object","properties":{"cmd":{"type":"string","description":"the command"},"timeout":{"type":"integer"},"env":{"type":"object","additionalProperties":{"type":"string"}}},"required":["cmd"]}}}`)
	}
	f := chatToolFields{Tools: rawField("[" + strings.Join(tools, ",") + "]"), ChatTemplateKwargs: rawField(`{"enable_thinking":false}`)}
	b.ReportAllocs()
	for b.Loop() {
		if _, e := parseChatTools(f, false); e != nil {
			b.Fatal(e)
		}
	}
}
