package tokenizer

import (
	"fmt"
	"strings"
)

// checkIncremental decides whether the chat template may be rendered incrementally: "" when
// it may, else why not. It plays every sample conversation below, under three option sets,
// as sessions: the request of turn m (rendered in full, its anchors found), then each later
// request n of the same conversation within a few messages (rendered from turn m's), and
// requires every incremental rendering, and every anchor's rendering kept for the next turn, to
// equal the full render of the same messages — including the turns where the template drops
// reasoning of earlier assistant turns, groups tool results, or ends with the generation
// prompt, and the requests the full render refuses (the incremental one must refuse them too).
func (t *Tokenizer) checkIncremental() string {
	if strings.Contains(t.chat.src, "strftime_now") {
		return "the template prints the current time (strftime_now): an earlier turn's rendering can go stale"
	}
	hits := 0
	for vi, opts := range incrementalOptions() {
		for si, conv := range incrementalSamples() {
			n, why := t.checkConversation(conv, opts)
			if why != "" {
				return fmt.Sprintf("sample conversation %d, options %d: %s", si, vi, why)
			}
			hits += n
		}
	}
	if hits == 0 {
		// Correct, but every request would render its tail only to take the full render.
		return "no sample turn renders incrementally (what follows a user message depends on the messages after it)"
	}
	return ""
}

// incrementalGap is how many messages past turn m the check renders turn n from turn m's.
const incrementalGap = 5

// checkConversation plays one sample conversation; it returns the number of turns rendered
// incrementally, and why the template fails the check ("" when it does not).
func (t *Tokenizer) checkConversation(conv []Message, opts ChatOptions) (int, string) {
	// full[n] and hist[n]: the full render of the first n messages, with opts and without the
	// generation prompt ("" and failed when the template refuses them).
	full, hist := make([]string, len(conv)+1), make([]string, len(conv)+1)
	failed, histFailed := make([]bool, len(conv)+1), make([]bool, len(conv)+1)
	for n := 1; n <= len(conv); n++ {
		s, err := t.ApplyChatTemplate(conv[:n], withoutGen(opts))
		hist[n], histFailed[n] = s, err != nil
		if opts.AddGenerationPrompt {
			s, err = t.ApplyChatTemplate(conv[:n], opts)
		}
		full[n], failed[n] = s, err != nil
	}
	// anchorOK: the rendering kept for the next turn is the full render of the anchor's messages.
	anchorOK := func(r *ChatRender) bool {
		for _, s := range r.seams {
			k := s.anchor + 1
			if histFailed[k] || hist[k] != r.Text[:s.end] || len(r.msgs) < k || !messagesEqual(r.msgs[:k], conv[:k]) {
				return false
			}
		}
		return true
	}
	hits := 0
	for m := 1; m <= len(conv); m++ {
		prev, err := t.renderChat(conv[:m], opts, nil, true)
		if err != nil {
			continue
		}
		if !anchorOK(prev) {
			return 0, fmt.Sprintf("turn of %d messages: the history's rendering is not a prefix", m)
		}
		for n := m; n <= min(len(conv), m+incrementalGap); n++ {
			got, err := t.renderChat(conv[:n], opts, prev, true)
			switch {
			case failed[n] && err == nil:
				return 0, fmt.Sprintf("turn of %d messages after %d: the full render fails, the incremental one does not", n, m)
			case failed[n]:
			case err != nil:
				return 0, fmt.Sprintf("turn of %d messages after %d: %v", n, m, err)
			case got.Text != full[n]:
				return 0, fmt.Sprintf("turn of %d messages after %d: the incremental rendering differs at byte %d", n, m, commonPrefix(got.Text, full[n]))
			case !anchorOK(got):
				return 0, fmt.Sprintf("turn of %d messages after %d: the history's rendering kept is not the full render's", n, m)
			case got.Reused > 0 && n > len(prev.msgs): // messages after the anchor rendered on their own
				hits++
			}
		}
	}
	return hits, ""
}

func withoutGen(o ChatOptions) ChatOptions {
	o.AddGenerationPrompt = false
	return o
}

// incrementalOptions are the option sets the check renders under: the gateway's (generation
// prompt, nothing else), tools with thinking off, and thinking on without the generation prompt.
func incrementalOptions() []ChatOptions {
	return []ChatOptions{
		{AddGenerationPrompt: true},
		{AddGenerationPrompt: true, Vars: map[string]any{"enable_thinking": false},
			ToolsJSON: []byte(`[{"type":"function","function":{"name":"read_file","description":"Read a file.","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}}]`)},
		{Vars: map[string]any{"enable_thinking": true}},
	}
}

// incrementalSamples are the conversations the check plays: plain turns, reasoning inline and in
// reasoning_content (that templates drop from answers before the last query), tool calls and
// tool results (single, parallel, consecutive), a "<tool_response>" user turn, consecutive
// user turns, an empty answer, a late system message and an answer before any question.
func incrementalSamples() [][]Message {
	rc := func(s string) *string { return &s }
	call := func(name, args string) ToolCall {
		c := ToolCall{ID: "call_" + name, Type: "function"}
		c.Function.Name, c.Function.Arguments = name, args
		return c
	}
	sys := Message{Role: "system", Content: "You are a careful assistant."}
	u := func(s string) Message { return Message{Role: "user", Content: s} }
	a := func(s string) Message { return Message{Role: "assistant", Content: s} }
	tool := func(s string) Message { return Message{Role: "tool", Content: s, ToolCallID: "call_read_file"} }
	return [][]Message{
		{sys, u("Hi."), a("Hello."), u("What is 2+2?"), a("4."), u("And 3+3?"), a("6."), u("Thanks.")},
		{u("Plan a trip."), a("<think>\nWhere to?\n</think>\n\nWhere would you like to go?"), u("Rome."),
			a("<think>Rome in spring.</think>Spring is best."), u("Hotels?"), a("<think>\nbudget\n</think>\n\nA few options."), u("Cheaper ones.")},
		{sys, u("Explain TCP."), {Role: "assistant", Content: "A reliable stream.", ReasoningContent: rc("basics first")}, u("And UDP?"),
			{Role: "assistant", Content: "Datagrams.", ReasoningContent: rc("")}, u("Which for games?"),
			{Role: "assistant", Content: "Usually UDP.", ReasoningContent: rc("latency")}, u("Why?")},
		{sys, u("Read main.go."), {Role: "assistant", ToolCalls: []ToolCall{call("read_file", `{"path": "main.go"}`)}}, tool("package main"),
			{Role: "assistant", Content: "Checking two more.", ToolCalls: []ToolCall{call("read_file", `{"path": "a.go"}`), call("read_file", `{"path": "b.go"}`)}},
			tool("package a"), tool("package b"), a("All three are small."), u("Now go.mod."),
			{Role: "assistant", Content: "<think>one file</think>", ToolCalls: []ToolCall{call("read_file", `{"path": "go.mod"}`)}}, tool("module x"),
			a("It names module x."), u("Done?"), a("Yes.")},
		{u("Run it."), a("<think>run</think>Running."), u("<tool_response>\nexit 0\n</tool_response>"), a("<think>ok</think>It passed."),
			u("Again with -race."), a("Sure."), u("<tool_response>\nexit 1\n</tool_response>"), a("<think>race</think>A race.")},
		{u("One."), u("Two."), a(""), u("Three."), a("Three it is."), u("Four."), u("Five.")},
		{u("Hi."), a("Hello."), {Role: "system", Content: "Be brief."}, u("Tell me more."), a("More."), u("Even more.")},
		{a("Welcome."), u("Hi."), a("How can I help?"), u("Nothing.")},
	}
}
