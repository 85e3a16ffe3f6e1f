package toolcall

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// golden is one case of testdata/tool_parse.json (gen_tool_parse.py: SGLang 0.5.23's
// ReasoningParser and FunctionCallParser on the same output).
type golden struct {
	Name         string         `json:"name"`
	ReasoningP   *string        `json:"reasoning_parser"`
	ToolCallP    *string        `json:"tool_call_parser"`
	Kwargs       map[string]any `json:"chat_template_kwargs"`
	Output       string         `json:"output"`
	Force        *bool          `json:"force_reasoning"`
	Content      string         `json:"content"`
	Reasoning    *string        `json:"reasoning_content"`
	ToolCalls    []Call         `json:"tool_calls"`
	FinishReason string         `json:"finish_reason"`
	FailureWant  string         `json:"failure"`
	// Streamed cases: the chunks, SGLang's (reasoning, normal) after each and at the end.
	Chunks          []string    `json:"chunks"`
	StreamReasoning bool        `json:"stream_reasoning"`
	Steps           [][2]string `json:"steps"`
	End             [2]string   `json:"end"`
}

func loadGolden(t *testing.T) []golden {
	t.Helper()
	raw, err := os.ReadFile("testdata/tool_parse.json")
	if err != nil {
		t.Fatal(err)
	}
	var cases []golden
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatal(err)
	}
	return cases
}

// TestStreamGolden: chunk by chunk and at the end, the streamed split is SGLang's.
func TestStreamGolden(t *testing.T) {
	n := 0
	for _, c := range loadGolden(t) {
		if c.Chunks == nil {
			continue
		}
		n++
		t.Run(c.Name, func(t *testing.T) {
			force := ForceReasoning(*c.ReasoningP, c.Kwargs)
			if c.Force == nil || force != *c.Force {
				t.Fatalf("force %v, SGLang %v", force, c.Force)
			}
			rs := NewReasoningStream(*c.ReasoningP, force, c.Kwargs["force_nonempty_content"] == true, c.StreamReasoning)
			for i, chunk := range c.Chunks {
				r, n := rs.Chunk(chunk)
				if [2]string{r, n} != c.Steps[i] {
					t.Fatalf("chunk %d %q: (%q, %q), want %q", i, chunk, r, n, c.Steps[i])
				}
			}
			if r, n := rs.End(); [2]string{r, n} != c.End {
				t.Fatalf("end (%q, %q), want %q", r, n, c.End)
			}
		})
	}
	if n < 10 {
		t.Fatalf("%d streamed cases", n)
	}
}

func (c *Call) UnmarshalJSON(b []byte) error {
	var v struct{ Name, Arguments string }
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	c.Name, c.Arguments = v.Name, v.Arguments
	return nil
}

// TestGolden: reasoning, content, tool calls (arguments byte for byte), finish reason and
// the failure kind are SGLang's.
func TestGolden(t *testing.T) {
	var cases []golden
	for _, c := range loadGolden(t) {
		if c.Chunks == nil {
			cases = append(cases, c)
		}
	}
	if len(cases) < 15 {
		t.Fatalf("%d cases", len(cases))
	}
	tools := []string{"get_weather", "get_time"}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			text := c.Output
			var reasoning string
			if c.ReasoningP != nil {
				force := ForceReasoning(*c.ReasoningP, c.Kwargs)
				if c.Force == nil || force != *c.Force {
					t.Fatalf("force %v, SGLang %v", force, c.Force)
				}
				reasoning, text = Reasoning(*c.ReasoningP, text, force, c.Kwargs["force_nonempty_content"] == true)
			}
			var calls []Call
			var fail Failure
			finish := "stop"
			if c.ToolCallP != nil {
				text, calls, fail = Parse(*c.ToolCallP, text, tools)
				if len(calls) > 0 {
					finish = "tool_calls"
				}
			}
			if text != c.Content {
				t.Errorf("content %q, want %q", text, c.Content)
			}
			if want := ""; c.Reasoning != nil {
				want = *c.Reasoning
				if reasoning != want {
					t.Errorf("reasoning %q, want %q", reasoning, want)
				}
			} else if reasoning != "" {
				t.Errorf("reasoning %q, want none", reasoning)
			}
			if len(calls) != len(c.ToolCalls) {
				t.Fatalf("calls %+v, want %+v", calls, c.ToolCalls)
			}
			for i := range calls {
				if calls[i] != c.ToolCalls[i] {
					t.Errorf("call %d %+v, want %+v", i, calls[i], c.ToolCalls[i])
				}
			}
			if finish != c.FinishReason || string(fail) != c.FailureWant {
				t.Errorf("finish %q failure %q, want %q %q", finish, fail, c.FinishReason, c.FailureWant)
			}
		})
	}
}

func TestCallID(t *testing.T) {
	re := regexp.MustCompile(`^call_[0-9a-f]{12}4[0-9a-f]{3}[89ab][0-9a-f]{7}$`)
	a, b := CallID(), CallID()
	if !re.MatchString(a) || a == b {
		t.Fatalf("ids %q %q", a, b)
	}
}

func TestCheckParsers(t *testing.T) {
	for _, c := range []struct {
		tool, reasoning string
		ok              bool
	}{{"", "", true}, {"qwen25", "qwen3", true}, {"qwen", "deepseek-r1", true}, {"hermes", "", true}, {"mistral", "", false}, {"", "kimi", false}} {
		if err := CheckParsers(c.tool, c.reasoning); (err == nil) != c.ok {
			t.Errorf("%q %q: %v", c.tool, c.reasoning, err)
		}
	}
}

// FuzzParse: any answer splits without a panic, and the parts come from the answer.
func FuzzParse(f *testing.F) {
	f.Add("<think>a</think>b<tool_call>\n{\"name\":\"f\",\"arguments\":{\"x\":[1,2.5]}}\n</tool_call>")
	f.Add("<tool_call>\n[{\"name\":[1]}]\n</tool_call>")
	f.Add("<tool_call>\n{\"name\":\"f\",\"parameters\":0,\"arguments\":\"\\u00e9\"}\n</tool_call>")
	f.Fuzz(func(t *testing.T, text string) {
		r, n := Reasoning("qwen3", text, false, false)
		if len(r)+len(n) > len(text) {
			t.Fatalf("parts longer than the answer")
		}
		if _, hc, hf := Parse("hermes", n, []string{"f"}); len(hc) > 0 && hf != "" {
			t.Fatalf("hermes calls and failure %q", hf)
		}
		content, calls, fail := Parse("qwen25", n, []string{"f"})
		if len(calls) > 0 && fail != "" {
			t.Fatalf("calls and failure %q", fail)
		}
		for _, c := range calls {
			if c.Name != "f" || !json.Valid([]byte(c.Arguments)) && !strings.Contains(c.Arguments, "Infinity") { // 1e400: Python writes Infinity too
				t.Fatalf("call %+v", c)
			}
		}
		_ = content
		// Streamed in three pieces: no panic, nothing invented.
		a, b := len(text)/3, 2*len(text)/3
		rs := NewReasoningStream("qwen3", true, false, true)
		out := 0
		for _, piece := range []string{text[:a], text[a:b], text[b:]} {
			r, n := rs.Chunk(piece)
			out += len(r) + len(n)
		}
		r, n = rs.End()
		if out+len(r)+len(n) > len(text) {
			t.Fatalf("streamed parts longer than the answer")
		}
	})
}

// BenchmarkParse: an answer with reasoning and two tool calls, split and parsed.
func BenchmarkParse(b *testing.B) {
	text := "<think>\n" + strings.Repeat("The user wants the weather; I should call the tool. ", 40) + "\n</think>\n\n" +
		"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2, 3]}}\n</tool_call>\n" +
		"<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"Europe/Paris\"}}\n</tool_call>"
	tools := []string{"get_weather", "get_time"}
	b.ReportAllocs()
	for b.Loop() {
		_, n := Reasoning("qwen3", text, true, false)
		if _, calls, _ := Parse("qwen25", n, tools); len(calls) != 2 {
			b.Fatal(calls)
		}
	}
}

// TestToolStreamGolden: a streamed answer's tool calls are SGLang's non-streaming parse of the
// whole answer (the golden's calls, arguments byte for byte, and failure), however the answer is
// cut into chunks (whole, byte by byte, every two-chunk cut); the content streamed is the text
// before the first call as generated (SGLang's whole answer strips it: equal after a strip) or,
// when the answer has no call markup or markup that fails it, the whole text.
func TestToolStreamGolden(t *testing.T) {
	tools := []string{"get_weather", "get_time"}
	n := 0
	for _, c := range loadGolden(t) {
		if c.Chunks != nil || c.ToolCallP == nil {
			continue
		}
		n++
		t.Run(c.Name, func(t *testing.T) {
			text := c.Output
			if c.ReasoningP != nil {
				_, text = Reasoning(*c.ReasoningP, text, ForceReasoning(*c.ReasoningP, c.Kwargs), c.Kwargs["force_nonempty_content"] == true)
			}
			var cuts [][]string
			cuts = append(cuts, []string{text})
			var bytes []string
			for i := range len(text) {
				bytes = append(bytes, text[i:i+1])
			}
			cuts = append(cuts, bytes)
			for i := 1; i < len(text); i++ {
				cuts = append(cuts, []string{text[:i], text[i:]})
			}
			for _, chunks := range cuts {
				ts := NewToolStream(*c.ToolCallP, tools)
				var streamed strings.Builder
				for _, ch := range chunks {
					streamed.WriteString(ts.Chunk(ch))
				}
				rest, calls, fail := ts.End()
				streamed.WriteString(rest)
				got := streamed.String()
				if string(fail) != c.FailureWant || len(calls) != len(c.ToolCalls) {
					t.Fatalf("chunks %q: calls %v, failure %q; want %v, %q", chunks, calls, fail, c.ToolCalls, c.FailureWant)
				}
				for i := range calls {
					if calls[i] != c.ToolCalls[i] {
						t.Fatalf("chunks %q: call %d %+v, want %+v", chunks, i, calls[i], c.ToolCalls[i])
					}
				}
				switch {
				case c.Content == text:
					if got != text {
						t.Fatalf("chunks %q: streamed %q, want the whole text", chunks, got)
					}
				default:
					bot := "<tool_call>\n"
					if *c.ToolCallP == "hermes" {
						bot = "<tool_call>"
					}
					if before, _, _ := strings.Cut(text, bot); got != before || strings.TrimSpace(got) != c.Content {
						t.Fatalf("chunks %q: streamed %q, want the text before the call %q (SGLang's content %q)", chunks, got, before, c.Content)
					}
				}
			}
		})
	}
	if n < 15 {
		t.Fatalf("%d cases", n)
	}
}
