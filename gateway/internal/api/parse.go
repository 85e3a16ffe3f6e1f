package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"
	"unsafe"

	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Kind is the client API a request came in on.
type Kind int

// The accepted APIs.
const (
	Chat Kind = iota + 1
	Completion
	Generate
)

func (k Kind) String() string {
	switch k {
	case Chat:
		return "chat"
	case Completion:
		return "completions"
	case Generate:
		return "generate"
	}
	return "unknown"
}

// Limits on what a client may ask for.
const (
	MaxInputTokens  = 10_000_000
	MaxOutputTokens = 1_000_000
	// CharsPerToken estimates tokens from text when the client gives no count.
	CharsPerToken = 4
)

// Request is a parsed client request.
type Request struct {
	Kind        Kind
	SessionID   string
	Turn        int32
	Multiturn   bool
	InputTokens int64
	// Estimated is true when InputTokens was estimated from text length.
	Estimated bool
	MaxTokens int64
	Stream    bool
	// Text is the prompt (chat messages rendered as "role: content" lines until the gateway's
	// tokenizer renders the chat template: see server.Content).
	Text string
	// Messages are a chat request's messages, for the model's chat template.
	Messages []tokenizer.Message
	InputIDs []int64
	Model    string
	RID      string
	// Content address (server.Content): the prompt's ids as uint32, the page size and the
	// chain of the prompt's full pages; empty without ids or page size.
	ContentIDs  []uint32
	PageSize    int
	PromptPages []uint64
	// Hints are the agent hints (hints.go): pin, release, priority.
	Hints Hints
	// Tools are a chat request's tools and chat-template inputs (chattools.go); nil otherwise.
	Tools *ChatTools
	// Sampling is the worker's sampling_params object, JSON as Python's json.dumps writes
	// SGLang's dict (compact): built as SGLang 0.5.23 builds it for the request's API
	// (sampling.go).
	Sampling []byte
}

// Error is a client-facing error: an HTTP status and an OpenAI-style error object.
type Error struct {
	Status  int    `json:"-"`
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

// Body is the JSON error document.
func (e *Error) Body() []byte {
	b, _ := json.Marshal(map[string]any{"error": map[string]string{"code": e.Code, "message": e.Message, "type": e.Code}})
	return b
}

// Stable codes of the 400s for inputs the gateway does not serve (rather than serve them
// differently from what was asked: issue 23 item 6).
const (
	// CodeUnsupportedParameter: n (or sampling_params.n) other than 1: one completion per request;
	// logprobs, echo, watermark, a structural-tag response format, beam search (sampling.go);
	// tool_choice "required" or a named function, strict tools under --tool-call-parser, tools
	// in a message, template inputs without the gateway's tokenizer.
	CodeUnsupportedParameter = "unsupported_parameter"
	// CodeInvalidParameter: a sampling parameter SGLang's request model or SamplingParams
	// refuses (sampling.go, SGLang's messages from verify); tools, tool_choice,
	// chat_template_kwargs, reasoning_effort or reasoning that SGLang refuses (SGLang's message
	// where it has one: chattools.go).
	CodeInvalidParameter = "invalid_parameter"
	// CodeInvalidRole: a chat message's role is none of system, developer, user, assistant, tool
	// and function.
	CodeInvalidRole = "invalid_role"
	// CodeUnsupportedContent: a chat content part other than text (image_url, input_audio,
	// file, …): the prompt would be served without it.
	CodeUnsupportedContent = "unsupported_content"
	// CodeAmbiguousSession: the X-Session-ID header given more than once.
	CodeAmbiguousSession = "ambiguous_session_id"
)

func badRequestCode(code, format string, a ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Code: code, Message: fmt.Sprintf(format, a...)}
}

// chatRoles are the message roles a chat request may carry.
var chatRoles = map[string]bool{"system": true, "developer": true, "user": true, "assistant": true, "tool": true, "function": true}

// BadRequest builds a 400 bad_request error.
func BadRequest(format string, a ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Code: "bad_request", Message: fmt.Sprintf(format, a...)}
}

// kvcExt is the optional "kvc" extension object clients may send.
type kvcExt struct {
	InputTokens *int64 `json:"input_tokens"`
	Turn        *int32 `json:"turn"`
	Multiturn   *bool  `json:"multiturn"`
	// Agent hints (hints.go), after the headers and the metadata object.
	PinMs    json.RawMessage `json:"pin_ms"`
	Release  json.RawMessage `json:"release"`
	Priority json.RawMessage `json:"priority"`
}

type sessionParams struct {
	ID json.RawMessage `json:"id"`
}

type chatMessage struct {
	Role             string               `json:"role"`
	Content          json.RawMessage      `json:"content"`
	ReasoningContent *string              `json:"reasoning_content"`
	Name             string               `json:"name"`
	ToolCallID       string               `json:"tool_call_id"`
	ToolCalls        []tokenizer.ToolCall `json:"tool_calls"`
	Tools            json.RawMessage      `json:"tools"`
}

type body struct {
	Model string `json:"model"`
	// OpenAI
	Messages            []chatMessage   `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Stream              bool            `json:"stream"`
	N                   *int64          `json:"n"`
	Temperature         rawField        `json:"temperature"`
	// The other sampling fields (sampling.go).
	samplingFields
	// SGLang (slices of the body: the large fields are not copied before they are decoded)
	Text     rawField `json:"text"`
	InputIDs rawField `json:"input_ids"`
	// SamplingParams is /generate's sampling_params object (sampling.go).
	SamplingParams rawField        `json:"sampling_params"`
	RID            json.RawMessage `json:"rid"`
	// Chat tools and template inputs (chattools.go).
	Tools              rawField `json:"tools"`
	ToolChoice         rawField `json:"tool_choice"`
	ChatTemplateKwargs rawField `json:"chat_template_kwargs"`
	ReasoningEffort    rawField `json:"reasoning_effort"`
	Reasoning          rawField `json:"reasoning"`
	SeparateReasoning  *bool    `json:"separate_reasoning"`
	StreamReasoning    *bool    `json:"stream_reasoning"`
	// SGLang fields that change the answer and that the gateway does not carry to the worker:
	// refused (unsupportedFields), never dropped.
	LoraPath             rawField `json:"lora_path"`
	CustomLogitProcessor rawField `json:"custom_logit_processor"`
	ContinueFinalMessage rawField `json:"continue_final_message"`
	// Both
	SessionParams *sessionParams `json:"session_params"`
	KVC           *kvcExt        `json:"kvc"`
	// OpenAI request metadata (string values): the agent hints kvc_pin_ms, kvc_release and
	// kvc_priority.
	Metadata map[string]json.RawMessage `json:"metadata"`
}

// unsupportedFields refuses the SGLang request fields that would change the answer but that
// the gateway does not pass to the worker (a LoRA adapter, a custom logit processor, an
// assistant message continued instead of answered): 400 unsupported_parameter rather than a
// different answer. null (and continue_final_message false) is their default and passes.
func unsupportedFields(b *body) *Error {
	for _, f := range []struct {
		name string
		raw  rawField
	}{{"lora_path", b.LoraPath}, {"custom_logit_processor", b.CustomLogitProcessor}} {
		if !isNullRaw(f.raw) {
			return badRequestCode(CodeUnsupportedParameter, "%s: not passed to the worker (send the request to the SGLang server directly)", f.name)
		}
	}
	if !isNullRaw(b.ContinueFinalMessage) && string(bytes.TrimSpace(b.ContinueFinalMessage)) != "false" {
		return badRequestCode(CodeUnsupportedParameter, "continue_final_message: the gateway's chat template always opens a new assistant turn")
	}
	return nil
}

// Options are the gateway's defaults for parsing.
type Options struct {
	RequireSession bool
	DefaultMaxTok  int64
	// ToolCallParser and ReasoningParser are the gateway's --tool-call-parser and
	// --reasoning-parser (SGLang's server arguments): "" = the answer is returned as generated.
	ToolCallParser  string
	ReasoningParser string
	// DefaultChatTemplateKwargs is --default-chat-template-kwargs (ParseDefaultKwargs); nil: none.
	DefaultChatTemplateKwargs *pyjson.Object
	// GenerationDefaults are --generation-config's sampling defaults of a chat request
	// (ParseGenerationConfig: SGLang's --sampling-defaults model); nil: OpenAI's defaults.
	GenerationDefaults *pyjson.Object
}

// rawField is a field's JSON text as a slice of the request body itself: unlike
// json.RawMessage it is not copied (Parse decodes raw with json.Unmarshal, which hands an
// Unmarshaler a slice of its input, and raw is not modified afterwards).
type rawField []byte

// UnmarshalJSON keeps b (a slice of Parse's raw body).
func (f *rawField) UnmarshalJSON(b []byte) error {
	*f = b
	return nil
}

// aliasString decodes a JSON string. One without escapes that is valid UTF-8 (what json would
// decode to the same bytes) is returned as a string over the body's own bytes, without a copy:
// a large prompt is held once (the body), not twice (issue 16 finding 6: gateway memory under a
// body flood); any other string is decoded (copied) by encoding/json.
func (f rawField) aliasString() (string, error) {
	b := []byte(f)
	if len(b) >= 2 && b[0] == '"' && b[len(b)-1] == '"' {
		in := b[1 : len(b)-1]
		if bytes.IndexByte(in, '\\') < 0 && utf8.Valid(in) {
			if len(in) == 0 {
				return "", nil
			}
			return unsafe.String(&in[0], len(in)), nil
		}
	}
	var s string
	err := json.Unmarshal(b, &s)
	return s, err
}

// decodeError explains why raw is not one JSON object (a Decoder tells trailing data apart).
func decodeError(raw []byte) *Error {
	var b body
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&b); err != nil {
		return BadRequest("malformed JSON body: %v", err)
	}
	if dec.More() {
		return BadRequest("trailing data after the JSON body")
	}
	return BadRequest("malformed JSON body")
}

// Parse decodes body for kind, reading the session id from X-Session-ID (or session_params.id)
// and the optional X-KVC-Input-Tokens / X-KVC-Turn / X-KVC-Multiturn headers. The Request may
// hold strings over raw's bytes (its text): raw must not be modified afterwards.
func Parse(kind Kind, h http.Header, raw []byte, opt Options) (*Request, *Error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil, BadRequest("empty request body")
	}
	var b body
	// json.Unmarshal reads raw in place (a Decoder would copy the whole body into its buffer);
	// only a body it refuses goes through a Decoder, to tell trailing data from bad JSON.
	if err := json.Unmarshal(raw, &b); err != nil {
		return nil, decodeError(raw)
	}
	if e := unsupportedFields(&b); e != nil {
		return nil, e
	}
	r := &Request{Kind: kind, Stream: b.Stream, Model: b.Model}
	if len(b.RID) > 0 {
		var rid string
		if err := json.Unmarshal(b.RID, &rid); err != nil {
			return nil, BadRequest("rid must be a string (batch requests are not supported)")
		}
		r.RID = rid
	}

	// Prompt.
	switch kind {
	case Chat:
		if len(b.Messages) == 0 {
			return nil, BadRequest("messages must be a non-empty array")
		}
		var sb strings.Builder
		for i, m := range b.Messages {
			if m.Role == "" {
				return nil, BadRequest("messages[%d].role is required", i)
			}
			if !chatRoles[m.Role] {
				return nil, badRequestCode(CodeInvalidRole, "messages[%d].role %q is not one of system, developer, user, assistant, tool, function", i, m.Role)
			}
			text, err := contentText(m.Content)
			var pe *partError
			if errors.As(err, &pe) {
				return nil, badRequestCode(CodeUnsupportedContent, "messages[%d].content[%d]: content part type %q is not supported (text only)", i, pe.index, pe.typ)
			}
			if err != nil {
				return nil, BadRequest("messages[%d].content: %v", i, err)
			}
			sb.WriteString(m.Role)
			sb.WriteString(": ")
			sb.WriteString(text)
			sb.WriteByte('\n')
			calls, e := toolCallArguments(m.Role, m.ToolCalls)
			if e != nil {
				return nil, e
			}
			r.Messages = append(r.Messages, tokenizer.Message{Role: m.Role, Content: text, ReasoningContent: m.ReasoningContent,
				Name: m.Name, ToolCallID: m.ToolCallID, ToolCalls: calls})
		}
		r.Text = sb.String()
		ct, e := chatTools(&b, opt)
		if e != nil {
			return nil, e
		}
		r.Tools = ct
	case Completion:
		if len(b.Prompt) == 0 {
			return nil, BadRequest("prompt is required")
		}
		if err := promptInto(b.Prompt, r); err != nil {
			return nil, BadRequest("prompt: %v", err)
		}
	case Generate:
		if len(b.Text) == 0 && len(b.InputIDs) == 0 && (b.KVC == nil || b.KVC.InputTokens == nil) && h.Get("X-KVC-Input-Tokens") == "" {
			return nil, BadRequest("one of text, input_ids or kvc.input_tokens is required")
		}
		if len(b.Text) > 0 {
			text, err := b.Text.aliasString()
			if err != nil {
				return nil, BadRequest("text must be a string (batch requests are not supported)")
			}
			r.Text = text
		}
		if len(b.InputIDs) > 0 {
			if err := json.Unmarshal(b.InputIDs, &r.InputIDs); err != nil {
				return nil, BadRequest("input_ids must be an array of integers (batch requests are not supported)")
			}
		}
	default:
		return nil, BadRequest("unknown API")
	}

	// Sampling: what the gateway would otherwise pass on and serve differently from what was asked.
	var spCounts struct {
		MaxNewTokens *int64 `json:"max_new_tokens"`
		N            *int64 `json:"n"`
	}
	if !isNullRaw(b.SamplingParams) {
		if err := json.Unmarshal(b.SamplingParams, &spCounts); err != nil {
			return nil, BadRequest("sampling_params: %v", err)
		}
	}
	for _, n := range []*int64{b.N, spCounts.N} {
		if n != nil && *n != 1 {
			return nil, badRequestCode(CodeUnsupportedParameter, "n = %d: one completion per request (send n requests)", *n)
		}
	}

	// Session.
	if vs := h.Values("X-Session-ID"); len(vs) > 1 {
		return nil, badRequestCode(CodeAmbiguousSession, "X-Session-ID given %d times: one session per request", len(vs))
	}
	r.SessionID = strings.TrimSpace(h.Get("X-Session-ID"))
	if r.SessionID == "" && b.SessionParams != nil && len(b.SessionParams.ID) > 0 {
		var sid string
		if err := json.Unmarshal(b.SessionParams.ID, &sid); err != nil {
			return nil, BadRequest("session_params.id must be a string")
		}
		r.SessionID = sid
	}
	if r.SessionID == "" {
		if opt.RequireSession {
			return nil, &Error{Status: http.StatusBadRequest, Code: "missing_session_id", Message: "no session id: set the X-Session-ID header or session_params.id"}
		}
	} else if err := kvcv1.ValidateID("session id", r.SessionID); err != nil {
		return nil, BadRequest("%v", err)
	}

	// Output length.
	r.MaxTokens = opt.DefaultMaxTok
	for _, v := range []*int64{b.MaxTokens, b.MaxCompletionTokens, spCounts.MaxNewTokens} {
		if v != nil {
			r.MaxTokens = *v
		}
	}
	if r.MaxTokens < 1 || r.MaxTokens > MaxOutputTokens {
		return nil, BadRequest("max tokens %d out of range [1, %d]", r.MaxTokens, MaxOutputTokens)
	}

	// Input length: client count (header, then kvc.input_tokens), then input_ids, then estimate.
	switch {
	case h.Get("X-KVC-Input-Tokens") != "":
		n, err := strconv.ParseInt(strings.TrimSpace(h.Get("X-KVC-Input-Tokens")), 10, 64)
		if err != nil {
			return nil, BadRequest("X-KVC-Input-Tokens: %v", err)
		}
		r.InputTokens = n
	case b.KVC != nil && b.KVC.InputTokens != nil:
		r.InputTokens = *b.KVC.InputTokens
	case len(r.InputIDs) > 0:
		r.InputTokens = int64(len(r.InputIDs))
	default:
		r.InputTokens = (int64(len(r.Text)) + CharsPerToken - 1) / CharsPerToken
		r.Estimated = true
	}
	if r.InputTokens < 1 || r.InputTokens > MaxInputTokens {
		return nil, BadRequest("input tokens %d out of range [1, %d]", r.InputTokens, MaxInputTokens)
	}

	// Turn and multi-turn hint.
	if v := h.Get("X-KVC-Turn"); v != "" {
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 32)
		if err != nil {
			return nil, BadRequest("X-KVC-Turn: %v", err)
		}
		r.Turn = int32(n)
	} else if b.KVC != nil && b.KVC.Turn != nil {
		r.Turn = *b.KVC.Turn
	}
	if r.Turn < 0 {
		return nil, BadRequest("turn %d is negative", r.Turn)
	}
	if v := h.Get("X-KVC-Multiturn"); v != "" {
		m, err := strconv.ParseBool(v)
		if err != nil {
			return nil, BadRequest("X-KVC-Multiturn: %v", err)
		}
		r.Multiturn = m
	} else if b.KVC != nil && b.KVC.Multiturn != nil {
		r.Multiturn = *b.KVC.Multiturn
	}
	if r.Turn > 0 {
		r.Multiturn = true
	}
	// The worker's sampling_params, as SGLang builds them for this API (sampling.go).
	var serr *Error
	if kind == Generate {
		r.Sampling, serr = generateSampling(b.SamplingParams, r)
	} else {
		r.Sampling, serr = openAISampling(kind, &b, r, opt.GenerationDefaults)
	}
	if serr != nil {
		return nil, serr
	}
	hs, herr := parseHints(h, &b, r.SessionID)
	if herr != nil {
		return nil, herr
	}
	r.Hints = hs
	return r, nil
}

// chatTools parses a chat request's tools and template inputs (chattools.go) and refuses
// what the gateway cannot serve as SGLang would: tools in a system message and a tool choice
// that needs SGLang's output grammar.
func chatTools(b *body, opt Options) (*ChatTools, *Error) {
	for i, m := range b.Messages {
		if len(m.Tools) > 0 && string(m.Tools) != "null" && string(m.Tools) != "[]" && (m.Role == "system" || m.Role == "developer") {
			return nil, badRequestCode(CodeUnsupportedParameter, "messages[%d].tools: tools in a message are not supported (send them as the request's tools)", i)
		}
	}
	ct, e := parseChatTools(chatToolFields{Tools: b.Tools, ToolChoice: b.ToolChoice, ChatTemplateKwargs: b.ChatTemplateKwargs,
		ReasoningEffort: b.ReasoningEffort, Reasoning: b.Reasoning, SeparateReasoning: b.SeparateReasoning,
		Defaults: opt.DefaultChatTemplateKwargs}, false)
	if e != nil {
		return nil, e
	}
	ct.StreamReasoning = b.StreamReasoning == nil || *b.StreamReasoning
	if len(ct.Tools) > 0 && (ct.Choice == ChoiceRequired || ct.Choice == ChoiceFunction) {
		return nil, badRequestCode(CodeUnsupportedParameter, "tool_choice %q: SGLang constrains the output to a tool call with a grammar the gateway does not build (send tool_choice \"auto\")", ct.Choice)
	}
	if opt.ToolCallParser != "" && ct.HasTools() {
		for _, f := range ct.Tools {
			if f.Strict {
				return nil, badRequestCode(CodeUnsupportedParameter, "tools: function %q is strict: SGLang constrains strict calls with a grammar the gateway does not build", f.Name)
			}
		}
	}
	return ct, nil
}

// partError is a content part of a type other than text.
type partError struct {
	index int
	typ   string
}

func (e *partError) Error() string { return fmt.Sprintf("content part %d of type %q", e.index, e.typ) }

// contentText accepts a string or an array of {"type":"text","text":...} parts; a part of
// another type is a *partError (it would be dropped).
func contentText(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", fmt.Errorf("want a string or an array of content parts")
	}
	var sb strings.Builder
	for i, p := range parts {
		if p.Type != "text" {
			return "", &partError{index: i, typ: p.Type}
		}
		sb.WriteString(p.Text)
	}
	return sb.String(), nil
}

// promptInto accepts a string, a one-element string array, or an array of token ids.
func promptInto(raw json.RawMessage, r *Request) error {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		r.Text = s
		return nil
	}
	var ss []string
	if err := json.Unmarshal(raw, &ss); err == nil {
		if len(ss) != 1 {
			return fmt.Errorf("exactly one prompt per request (got %d)", len(ss))
		}
		r.Text = ss[0]
		return nil
	}
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err == nil {
		r.InputIDs = ids
		return nil
	}
	return fmt.Errorf("want a string or an array of token ids")
}
