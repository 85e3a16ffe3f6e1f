package tokenizer

import (
	"bytes"
	"fmt"
	"reflect"
	"slices"
	"strings"

	"github.com/ardanlabs/jinja"
)

// Incremental chat rendering (docs/tokenization.md, "Incremental rendering").
//
// An agent's turn N+1 re-sends turn N's messages plus a few new ones. Rendering the whole
// conversation again costs time proportional to its length (the Jinja interpreter walks every
// message), although the rendering of the history up to the last user message does not change.
// RenderChat renders only the tail: with R(L, agp) the template's rendering of the message list
// L, an anchor a (a user message) and the history's rendering kept from the previous turn,
//
//	R(M, agp) == R(M[:a+1], false) ++ (R(M[a:], agp) minus its prefix R(M[a:a+1], false))
//
// — the template renders what follows the anchor the same whether the list starts at the
// anchor or at the conversation's beginning. That holds for the chat templates of the Qwen and
// DeepSeek families (their per-message state — Qwen3's last user query, which decides which
// assistant turns keep their reasoning, DeepSeek's is_last_user/is_tool — is reset by a user
// message), but it is a property of a template, not of Jinja: it is checked per template
// (chatIncremental: every pair of turns of sample conversations, rendered both ways, must be
// identical, or incremental rendering is off for the template) and per request (the same options,
// the anchor and every message before it equal to the previous turn's, only user, assistant and
// tool messages after it, the anchor's own rendering a prefix of the tail's; anything else, or any
// template error, takes the full render).

// ChatRender is a chat prompt rendered by RenderChat with what the next turn of the same
// conversation needs to render only its new messages. It is immutable once returned.
type ChatRender struct {
	// Text is the rendering, byte for byte ApplyChatTemplate(msgs, opts).
	Text string
	// Reused is the number of leading bytes of Text taken from the previous turn's
	// rendering without rendering them again (0: rendered in full).
	Reused int

	opts   ChatOptions
	anchor []Message // the messages up to and including the anchor (the last user message); nil: none
	seam   int       // Text[:seam] == R(anchor, no generation prompt)
}

// Size is the memory a ChatRender holds besides Text (which the caller's Encoded of the same
// text already counts): the messages up to the anchor, kept to compare the next turn's with.
func (r *ChatRender) Size() int64 {
	if r == nil {
		return 0
	}
	n := int64(96)
	for _, m := range r.anchor {
		n += 160 + int64(len(m.Role)+len(m.Content)+len(m.Name)+len(m.ToolCallID))
		if m.ReasoningContent != nil {
			n += int64(len(*m.ReasoningContent))
		}
		for _, c := range m.ToolCalls {
			n += 96 + int64(len(c.ID)+len(c.Type)+len(c.Function.Name)+len(c.Function.Arguments))
		}
	}
	n += int64(len(r.opts.ToolsJSON))
	return n
}

// ChatIncremental reports whether RenderChat may render this tokenizer's chat template
// incrementally, and why not when it may not. The check runs once, on first use.
func (t *Tokenizer) ChatIncremental() (bool, string) {
	if t.chat == nil {
		return false, "no chat template"
	}
	t.chat.incOnce.Do(func() { t.chat.incWhy = t.checkIncremental() })
	return t.chat.incWhy == "", t.chat.incWhy
}

// RenderChat renders msgs as ApplyChatTemplate(msgs, opts) does, reusing prev — the previous
// turn of the same conversation, or nil — when the template and the request allow it
// (ChatIncremental, and prev's messages up to its last user message and options equal to this
// request's); otherwise it renders in full. The text is identical either way; prev is not
// modified. Errors are ApplyChatTemplate's.
func (t *Tokenizer) RenderChat(msgs []Message, opts ChatOptions, prev *ChatRender) (*ChatRender, error) {
	if t.chat == nil {
		return nil, ErrNoChatTemplate
	}
	inc, _ := t.ChatIncremental()
	return t.renderChat(msgs, opts, prev, inc)
}

func (t *Tokenizer) renderChat(msgs []Message, opts ChatOptions, prev *ChatRender, inc bool) (*ChatRender, error) {
	if inc && prev != nil {
		if r, ok := t.renderTail(msgs, opts, prev); ok {
			return r, nil
		}
	}
	text, err := t.ApplyChatTemplate(msgs, opts)
	if err != nil {
		return nil, err
	}
	r := &ChatRender{Text: text, opts: opts}
	if !inc {
		return r, nil
	}
	// Find where the rendering of the history up to the last user message ends: the text must
	// end with what the template renders after that message when the list starts there.
	if a := lastAnchor(msgs); a >= 0 {
		data, err := t.chatData(opts)
		if err != nil {
			return r, nil
		}
		if x, ok := t.continuation(data, msgs, a, opts.AddGenerationPrompt); ok && strings.HasSuffix(text, x) {
			r.anchor, r.seam = slices.Clone(msgs[:a+1]), len(text)-len(x)
		}
	}
	return r, nil
}

// renderTail is the incremental render; false when the request does not allow it (then the
// caller renders in full).
func (t *Tokenizer) renderTail(msgs []Message, opts ChatOptions, prev *ChatRender) (*ChatRender, bool) {
	a := len(prev.anchor) - 1
	if a < 0 || len(msgs) <= a || !optsEqual(opts, prev.opts) || !messagesEqual(msgs[:a+1], prev.anchor) {
		return nil, false
	}
	for _, m := range msgs[a+1:] {
		if m.Role != "user" && m.Role != "assistant" && m.Role != "tool" {
			return nil, false // a system message after the anchor may change the head (DeepSeek gathers them)
		}
	}
	data, err := t.chatData(opts)
	if err != nil {
		return nil, false
	}
	x, ok := t.continuation(data, msgs, a, opts.AddGenerationPrompt)
	if !ok {
		return nil, false
	}
	head := prev.Text[:prev.seam]
	r := &ChatRender{Text: head + x, Reused: len(head), opts: opts}
	// The next turn's anchor: this request's last user message.
	switch u := lastAnchor(msgs); {
	case u == a:
		r.anchor, r.seam = prev.anchor, prev.seam
	case u > a:
		y := x
		if u < len(msgs)-1 || opts.AddGenerationPrompt {
			y, ok = t.continuation(data, msgs[:u+1], a, false)
		}
		if ok && strings.HasPrefix(r.Text[len(head):], y) {
			r.anchor, r.seam = slices.Clone(msgs[:u+1]), len(head)+len(y)
		}
	}
	return r, true
}

// continuation is what the template renders after msgs[a] when the list starts at msgs[a]:
// R(msgs[a:], agp) less its prefix R(msgs[a:a+1], no generation prompt), with the variables
// data (chatData). false when that is not a prefix or the template fails.
func (t *Tokenizer) continuation(data map[string]jinja.Value, msgs []Message, a int, agp bool) (string, bool) {
	tail, err := t.renderData(data, msgs[a:], agp)
	if err != nil {
		return "", false
	}
	head, err := t.renderData(data, msgs[a:a+1], false)
	if err != nil || !strings.HasPrefix(tail, head) {
		return "", false
	}
	return tail[len(head):], true
}

// renderData renders msgs with the template variables data (chatData), which it modifies.
func (t *Tokenizer) renderData(data map[string]jinja.Value, msgs []Message, agp bool) (string, error) {
	list := make([]any, len(msgs))
	for i, m := range msgs {
		list[i] = messageMap(m)
	}
	data["messages"] = jinja.FromGoValue(list)
	data["add_generation_prompt"] = jinja.NewBool(agp)
	out, err := t.chat.tmpl.RenderValues(data)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrTemplate, err)
	}
	return out, nil
}

// lastAnchor is the index of the last user message that can anchor an incremental render, or
// -1. A user message whose content starts with markup is not one: Qwen's templates take a user
// turn of "<tool_response>…" for tool output, not a query, and render the turns after it as
// depending on the query before it.
func lastAnchor(msgs []Message) int {
	for i := len(msgs) - 1; i >= 0; i-- {
		if msgs[i].Role == "user" && !strings.HasPrefix(msgs[i].Content, "<") {
			return i
		}
	}
	return -1
}

func optsEqual(a, b ChatOptions) bool {
	return a.AddGenerationPrompt == b.AddGenerationPrompt && bytes.Equal(a.ToolsJSON, b.ToolsJSON) &&
		len(a.Vars) == len(b.Vars) && (len(a.Vars) == 0 || reflect.DeepEqual(a.Vars, b.Vars))
}

func messagesEqual(a, b []Message) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		x, y := &a[i], &b[i]
		if x.Role != y.Role || x.Content != y.Content || x.Name != y.Name || x.ToolCallID != y.ToolCallID ||
			(x.ReasoningContent == nil) != (y.ReasoningContent == nil) ||
			(x.ReasoningContent != nil && *x.ReasoningContent != *y.ReasoningContent) ||
			!slices.Equal(x.ToolCalls, y.ToolCalls) {
			return false
		}
	}
	return true
}
