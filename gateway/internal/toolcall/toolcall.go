package toolcall

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"

	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
)

// ToolCallParsers are the --tool-call-parser values served (SGLang's names).
var ToolCallParsers = []string{"qwen25", "qwen", "hermes"}

// ReasoningParsers are the --reasoning-parser values served (SGLang's names).
var ReasoningParsers = []string{"qwen3", "deepseek-r1"}

// CheckParsers says whether the flags name parsers this package implements.
func CheckParsers(toolCall, reasoning string) error {
	if toolCall != "" && !contains(ToolCallParsers, toolCall) {
		return fmt.Errorf("--tool-call-parser %q: served are %s", toolCall, strings.Join(ToolCallParsers, ", "))
	}
	if reasoning != "" && !contains(ReasoningParsers, reasoning) {
		return fmt.Errorf("--reasoning-parser %q: served are %s", reasoning, strings.Join(ReasoningParsers, ", "))
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// ForceReasoning is whether SGLang parses the answer as reasoning from its first byte (no
// <think> needed): deepseek-r1 always; qwen3 unless the template kwargs set enable_thinking
// false (the detector's reasoning_default "enable_thinking", which the shipped Qwen3 and QwQ
// templates leave in force: their toggle is not detected).
func ForceReasoning(parser string, vars map[string]any) bool {
	switch parser {
	case "deepseek-r1":
		return true
	case "qwen3":
		return len(vars) == 0 || vars["enable_thinking"] != false
	}
	return false
}

// Reasoning splits text at the reasoning block as SGLang's detector's detect_and_parse does:
// (reasoning, normal). force: the answer starts inside the block; forceNonempty: SGLang's
// force_nonempty_content (an answer with no text after the block is all content).
func Reasoning(parser, text string, force, forceNonempty bool) (reasoning, normal string) {
	const start, end = "<think>", "</think>"
	toolStart := ""
	if parser == "qwen3" {
		toolStart = "<tool_call>" // Qwen3.5 opens a call without closing </think>
	}
	reasoning, normal = reasoningSplit(text, start, end, toolStart, force)
	if forceNonempty && normal == "" {
		reasoning, normal = normal, reasoning
	}
	return reasoning, normal
}

func reasoningSplit(text, start, end, toolStart string, force bool) (string, string) {
	if !force && !strings.Contains(text, start) {
		return "", text
	}
	p := text
	for strings.HasPrefix(p, start) {
		p = p[len(start):]
	}
	if !strings.Contains(p, end) {
		if toolStart != "" {
			if i := strings.Index(p, toolStart); i >= 0 {
				return p[:i], p[i:]
			}
		}
		return p, "" // cut before the end tag
	}
	r, n, _ := strings.Cut(p, end)
	return r, n
}

// Call is one parsed tool call.
type Call struct {
	Name string
	// Arguments are the call's arguments as SGLang writes them: json.dumps(...,
	// ensure_ascii=False) of the JSON object the model wrote.
	Arguments string
}

// Failure is why an answer with tool-call markup gave no call ("" when it gave calls or had
// no markup).
type Failure string

// Failures.
const (
	// NoCall: markup, but no complete call to a declared tool (SGLang drops it: the content is
	// the text before the markup; hermes: the whole text when a block is not a call object).
	NoCall Failure = "no_call"
	// Error: qwen25, a call that is not an object, or a list or object as its name (SGLang
	// logs a parsing error and returns the whole text as content).
	Error Failure = "error"
)

var (
	qwen25Block = regexp.MustCompile(`(?s)<tool_call>\n(.*?)\n</tool_call>`)
	hermesBlock = regexp.MustCompile(`(?s)<tool_call>(.*?)</tool_call>|<tool_call>(.*)`)
)

// Parse reads the tool calls of text (the answer after any reasoning) as SGLang's
// _process_tool_calls does for tool_choice "auto" with parser: qwen25 (alias qwen) —
// "<tool_call>\n{json}\n</tool_call>" blocks, a block that is not JSON skipped — or hermes —
// "<tool_call>{json}</tool_call>", the last block possibly unclosed, any bad block failing the
// whole answer. tools are the request's function names; a call to another name is dropped. It
// returns the content, the calls and why markup gave none.
func Parse(parser, text string, tools []string) (content string, calls []Call, fail Failure) {
	bot := "<tool_call>\n"
	if parser == "hermes" {
		bot = "<tool_call>"
	}
	if len(tools) == 0 || !strings.Contains(text, bot) {
		return text, nil, ""
	}
	known := make(map[string]bool, len(tools))
	for _, t := range tools {
		known[t] = true
	}
	normal := pyjson.Strip(text[:strings.Index(text, bot)])
	if parser == "hermes" {
		for _, m := range hermesBlock.FindAllStringSubmatch(text, -1) {
			raw := m[1]
			if raw == "" {
				raw = m[2]
			}
			if raw == "" {
				continue
			}
			v, err := pyjson.Decode([]byte(pyjson.Strip(raw)))
			if err != nil {
				return text, nil, NoCall // the detector catches it: no call, the whole text
			}
			c, ok := baseJSON(v, known)
			if !ok {
				return text, nil, NoCall
			}
			calls = append(calls, c...)
		}
	} else {
		for _, m := range qwen25Block.FindAllStringSubmatch(text, -1) {
			v, err := pyjson.Decode([]byte(pyjson.Strip(m[1])))
			if err != nil {
				continue // SGLang logs the JSON error and skips the block
			}
			c, ok := baseJSON(v, known)
			if !ok {
				return text, nil, Error
			}
			calls = append(calls, c...)
		}
	}
	if len(calls) == 0 {
		return normal, nil, NoCall
	}
	return normal, calls, ""
}

// baseJSON is SGLang's parse_base_json: one call object or a list of them; calls to unknown
// names dropped; arguments json.dumps'd ("parameters" if truthy, else "arguments", else {}).
// false where SGLang raises (a call that is not an object, a list or object as the name).
func baseJSON(v any, known map[string]bool) ([]Call, bool) {
	list, ok := v.([]any)
	if !ok {
		list = []any{v}
	}
	var calls []Call
	for _, a := range list {
		o, ok := a.(*pyjson.Object)
		if !ok {
			return nil, false // act.get on a non-dict raises
		}
		name := o.Values["name"]
		if !pyjson.Truthy(name) {
			continue
		}
		s, ok := name.(string)
		if !ok {
			switch name.(type) {
			case []any, *pyjson.Object:
				return nil, false // unhashable: `name in tool_indices` raises
			}
			continue
		}
		if !known[s] {
			continue
		}
		args := o.Values["parameters"]
		if !pyjson.Truthy(args) {
			var ok bool
			if args, ok = o.Values["arguments"]; !ok {
				args = &pyjson.Object{}
			}
		}
		calls = append(calls, Call{Name: s, Arguments: pyjson.Dumps(args, pyjson.Options{})})
	}
	return calls, true
}

// CallID is a new tool call id as SGLang makes one: "call_" and 24 hex digits of a UUID4.
func CallID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40 // UUID version 4
	b[8] = b[8]&0x3f | 0x80 // RFC 4122 variant
	return "call_" + hex.EncodeToString(b[:])
}
