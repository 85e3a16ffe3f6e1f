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
// message), although the rendering of the history does not change. RenderChat renders only the
// tail: with R(L, agp) the template's rendering of the message list L, an anchor a and the
// history's rendering R(M[:a+1], false) kept from the previous turn,
//
//	R(M, agp) == R(M[:a+1], false) ++ (R(C ++ M[a:], agp) minus its prefix R(C ++ M[a:a+1], false))
//
// — the template renders what follows the anchor the same whether the list starts there or at
// the conversation's beginning. The anchor is the last user message (C empty), or, while no user
// message follows it, the tool result that ended the previous request, with that user message as
// the context C (Qwen3 decides from the last user query which assistant turns keep their
// reasoning). That holds for the chat templates of the Qwen and DeepSeek families (their
// per-message state is reset by a user message), but it is a property of a template, not of
// Jinja: it is checked per template (checkIncremental: sample conversations played as sessions,
// every incremental rendering equal to the full one, or incremental rendering is off for the
// template) and per request (the same options, every message up to the anchor equal to the
// previous turn's, only user, assistant and tool messages after it, the anchor's own rendering a
// prefix of the tail's; anything else, or any template error, takes the full render).

// ChatRender is a chat prompt rendered by RenderChat with what the next turn of the same
// conversation needs to render only its new messages. It is immutable once returned.
type ChatRender struct {
	// Text is the rendering, byte for byte ApplyChatTemplate(msgs, opts).
	Text string
	// Reused is the number of leading bytes of Text taken from the previous turn's
	// rendering without rendering them again (0: rendered in full).
	Reused int

	opts  ChatOptions
	msgs  []Message // the messages up to the last seam's anchor
	seams []seam    // ascending by anchor: the last user message's, then the last tool result's
}

// seam is where the rendering of the messages up to an anchor ends:
// Text[:end] == R(msgs[:anchor+1], no generation prompt).
type seam struct {
	anchor int
	ctx    int // the user message rendered before the anchor as context; -1: none (the anchor is one)
	end    int
}

// Size is the memory a ChatRender holds besides Text (which the caller's Encoded of the same
// text already counts): the messages up to the last anchor, kept to compare the next turn's with.
func (r *ChatRender) Size() int64 {
	if r == nil {
		return 0
	}
	n := int64(96 + 24*len(r.seams))
	for _, m := range r.msgs {
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
// (ChatIncremental, and prev's options and messages up to one of its anchors — its last user
// message, or its last tool result while no user message follows — equal to this request's);
// otherwise it renders in full. The text is identical either way; prev is not
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
	data, err := t.chatData(opts)
	if err != nil {
		return r, nil
	}
	// Find where the rendering of the history up to each anchor ends: the text must end with
	// what the template renders after the anchor when the list starts there.
	u := lastAnchor(msgs)
	if u < 0 {
		return r, nil
	}
	var toolSeam []seam
	if j := len(msgs) - 1; j > u && msgs[j].Role == "tool" {
		if x, ok := t.continuation(data, msgs, j, u, opts.AddGenerationPrompt); ok && strings.HasSuffix(text, x) {
			toolSeam = []seam{{anchor: j, ctx: u, end: len(text) - len(x)}}
		}
	}
	// The user message's seam costs a render of everything after it; far back in an agent loop
	// that is about a full render again, and a turn starting from it would cost as much as one.
	if toolSeam == nil || len(msgs)-u <= maxUserTail {
		if x, ok := t.continuation(data, msgs, u, -1, opts.AddGenerationPrompt); ok && strings.HasSuffix(text, x) {
			r.seams = append(r.seams, seam{anchor: u, ctx: -1, end: len(text) - len(x)})
		}
	}
	r.seams = append(r.seams, toolSeam...)
	if len(r.seams) > 0 {
		r.msgs = slices.Clone(msgs[:r.seams[len(r.seams)-1].anchor+1])
	}
	return r, nil
}

// maxUserTail bounds the messages from the last user message to the end for which a full render
// also finds the user message's seam when the request ends with a tool result (which has its own).
const maxUserTail = 8

// renderTail is the incremental render; false when the request does not allow it (then the
// caller renders in full).
func (t *Tokenizer) renderTail(msgs []Message, opts ChatOptions, prev *ChatRender) (*ChatRender, bool) {
	if len(prev.seams) == 0 || !optsEqual(opts, prev.opts) {
		return nil, false
	}
	// The latest seam whose messages are unchanged; a tool result's only while no user message
	// follows it (a new query changes how the template renders the turns before it).
	same := equalPrefix(msgs, prev.msgs)
	u := lastAnchor(msgs)
	var s seam
	found := false
	for i := len(prev.seams) - 1; i >= 0 && !found; i-- {
		s = prev.seams[i]
		found = s.anchor < same && (s.ctx < 0 || u == s.ctx)
	}
	if !found {
		return nil, false
	}
	for _, m := range msgs[s.anchor+1:] {
		if m.Role != "user" && m.Role != "assistant" && m.Role != "tool" {
			return nil, false // a system message after the anchor may change the head (DeepSeek gathers them)
		}
	}
	data, err := t.chatData(opts)
	if err != nil {
		return nil, false
	}
	x, ok := t.continuation(data, msgs, s.anchor, s.ctx, opts.AddGenerationPrompt)
	if !ok {
		return nil, false
	}
	head := prev.Text[:s.end]
	r := &ChatRender{Text: head + x, Reused: len(head), opts: opts}
	// The next turn's seams: this request's last user message's, and its last message's when
	// that is a tool result after it. A seam at or before the anchor used is prev's (the text
	// agrees with prev's up to the anchor); a later one is what the tail renders up to it.
	tail := r.Text[len(head):]
	seamAt := func(anchor, ctx int) {
		switch {
		case anchor <= s.anchor:
			for _, p := range prev.seams {
				if p.anchor == anchor && p.ctx == ctx {
					r.seams = append(r.seams, p)
				}
			}
		case anchor == len(msgs)-1 && !opts.AddGenerationPrompt:
			r.seams = append(r.seams, seam{anchor: anchor, ctx: ctx, end: len(r.Text)})
		default:
			y, ok := t.continuation(data, msgs[:anchor+1], s.anchor, s.ctx, false)
			if ok && strings.HasPrefix(tail, y) {
				r.seams = append(r.seams, seam{anchor: anchor, ctx: ctx, end: len(head) + len(y)})
			}
		}
	}
	if u >= 0 {
		seamAt(u, -1)
		if j := len(msgs) - 1; j > u && msgs[j].Role == "tool" {
			seamAt(j, u)
		}
	}
	if len(r.seams) > 0 {
		last := r.seams[len(r.seams)-1].anchor
		if last < same {
			r.msgs = prev.msgs[:last+1] // equal to this request's
		} else {
			r.msgs = slices.Clone(msgs[:last+1])
		}
	}
	return r, true
}

// continuation is what the template renders after msgs[a] when the list starts at msgs[a]
// (after the context message msgs[ctx] when ctx >= 0): R(C ++ msgs[a:], agp) less its prefix
// R(C ++ msgs[a:a+1], no generation prompt), with the variables data (chatData). false when that
// is not a prefix or the template fails.
func (t *Tokenizer) continuation(data map[string]jinja.Value, msgs []Message, a, ctx int, agp bool) (string, bool) {
	list, n := msgs[a:], 1 // n: the messages up to the anchor in list
	if ctx >= 0 {
		list, n = append([]Message{msgs[ctx]}, msgs[a:]...), 2
	}
	tail, err := t.renderData(data, list, agp)
	if err != nil {
		return "", false
	}
	head, err := t.renderData(data, list[:n], false)
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

// equalPrefix is the number of leading messages a and b have equal, field by field.
func equalPrefix(a, b []Message) int {
	n := min(len(a), len(b))
	for i := 0; i < n; i++ {
		if !messageEqual(&a[i], &b[i]) {
			return i
		}
	}
	return n
}

func messagesEqual(a, b []Message) bool { return len(a) == len(b) && equalPrefix(a, b) == len(a) }

func messageEqual(x, y *Message) bool {
	return x.Role == y.Role && x.Content == y.Content && x.Name == y.Name && x.ToolCallID == y.ToolCallID &&
		(x.ReasoningContent == nil) == (y.ReasoningContent == nil) &&
		(x.ReasoningContent == nil || *x.ReasoningContent == *y.ReasoningContent) &&
		slices.Equal(x.ToolCalls, y.ToolCalls)
}
