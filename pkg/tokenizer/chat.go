package tokenizer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/ardanlabs/jinja"
)

// Message is one OpenAI-style chat message.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
	// ReasoningContent, when set, is passed as message.reasoning_content (Qwen3's template
	// renders it inside <think>); unset, the variable is undefined as in transformers.
	ReasoningContent *string    `json:"reasoning_content,omitempty"`
	Name             string     `json:"name,omitempty"`
	ToolCallID       string     `json:"tool_call_id,omitempty"`
	ToolCalls        []ToolCall `json:"tool_calls,omitempty"`
}

// ToolCall is an assistant message's function call; Arguments is the JSON text the client sent.
type ToolCall struct {
	ID       string `json:"id,omitempty"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// ChatOptions are the template variables besides the messages.
type ChatOptions struct {
	// AddGenerationPrompt ends the rendering with the assistant turn's opening.
	AddGenerationPrompt bool
	// Vars are extra template variables (enable_thinking, ...). Values are plain Go values
	// (string, bool, float64, []any, map[string]any). Go maps have no key order: a map that a
	// template prints with `tojson` comes out with sorted keys. Pass JSON objects the client
	// sent (tools, tool-call arguments) through ToolsJSON / ApplyChatTemplateJSON instead.
	Vars map[string]any
	// ToolsJSON, when set, is the request's "tools" array as JSON; key order is kept, so
	// `tojson` prints it exactly as transformers does from the parsed JSON.
	ToolsJSON json.RawMessage
}

// chatTemplate is a compiled chat template.
type chatTemplate struct {
	tmpl *jinja.Template
	src  string

	incOnce sync.Once // checkIncremental, on first use
	incWhy  string    // why incremental rendering is off; "" when it is on
}

func compileTemplate(src string) (*chatTemplate, error) {
	t, err := jinja.Compile(src)
	if err != nil {
		return nil, err
	}
	return &chatTemplate{tmpl: t, src: src}, nil
}

// HasChatTemplate reports whether tokenizer_config.json carried a chat template.
func (t *Tokenizer) HasChatTemplate() bool { return t.chat != nil }

// ApplyChatTemplate renders messages with the model's chat template, as transformers'
// apply_chat_template(messages, tokenize=False, add_generation_prompt=...) does.
func (t *Tokenizer) ApplyChatTemplate(msgs []Message, opts ChatOptions) (string, error) {
	list := make([]any, len(msgs))
	for i, m := range msgs {
		list[i] = messageMap(m)
	}
	return t.render(list, opts)
}

// ApplyChatTemplateMaps renders messages given as decoded JSON objects (for fields Message
// does not model).
func (t *Tokenizer) ApplyChatTemplateMaps(msgs []map[string]any, opts ChatOptions) (string, error) {
	list := make([]any, len(msgs))
	for i, m := range msgs {
		list[i] = m
	}
	return t.render(list, opts)
}

func messageMap(m Message) map[string]any {
	out := map[string]any{"role": m.Role, "content": m.Content}
	if m.ReasoningContent != nil {
		out["reasoning_content"] = *m.ReasoningContent
	}
	if m.Name != "" {
		out["name"] = m.Name
	}
	if m.ToolCallID != "" {
		out["tool_call_id"] = m.ToolCallID
	}
	if len(m.ToolCalls) > 0 {
		calls := make([]any, len(m.ToolCalls))
		for i, c := range m.ToolCalls {
			call := map[string]any{
				"type":     c.Type,
				"function": map[string]any{"name": c.Function.Name, "arguments": c.Function.Arguments},
			}
			if c.ID != "" {
				call["id"] = c.ID
			}
			calls[i] = call
		}
		out["tool_calls"] = calls
	}
	return out
}

// ApplyChatTemplateJSON renders the "messages" array of a request as the client sent it
// (JSON), keeping every object's key order, so templates that print objects with `tojson`
// (tool-call arguments given as objects, tool definitions in ToolsJSON) render exactly as
// transformers renders the parsed request. Integers stay integers, other numbers floats.
func (t *Tokenizer) ApplyChatTemplateJSON(messages json.RawMessage, opts ChatOptions) (string, error) {
	v, err := decodeJSONValue(messages)
	if err != nil {
		return "", fmt.Errorf("%w: messages: %w", ErrTemplate, err)
	}
	if !v.IsList() {
		return "", fmt.Errorf("%w: messages is not a JSON array", ErrTemplate)
	}
	return t.renderValue(v, opts)
}

func (t *Tokenizer) render(msgs []any, opts ChatOptions) (string, error) {
	return t.renderValue(jinja.FromGoValue(msgs), opts)
}

func (t *Tokenizer) renderValue(msgs jinja.Value, opts ChatOptions) (string, error) {
	if t.chat == nil {
		return "", ErrNoChatTemplate
	}
	data, err := t.chatData(opts)
	if err != nil {
		return "", err
	}
	data["messages"] = msgs
	data["add_generation_prompt"] = jinja.NewBool(opts.AddGenerationPrompt)
	out, err := t.chat.tmpl.RenderValues(data)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrTemplate, err)
	}
	return out, nil
}

// chatData is the template's variables besides messages and add_generation_prompt: tools and
// documents (None unless given), the special tokens, opts.Vars. A fresh map each call.
func (t *Tokenizer) chatData(opts ChatOptions) (map[string]jinja.Value, error) {
	data := make(map[string]jinja.Value, len(t.specialVars)+len(opts.Vars)+4)
	data["tools"], data["documents"] = jinja.None(), jinja.None()
	for k, v := range t.specialVars {
		data[k] = jinja.FromGoValue(v)
	}
	for k, v := range opts.Vars {
		data[k] = jinja.FromGoValue(v)
	}
	if len(opts.ToolsJSON) > 0 {
		tools, err := decodeJSONValue(opts.ToolsJSON)
		if err != nil {
			return nil, fmt.Errorf("%w: tools: %w", ErrTemplate, err)
		}
		data["tools"] = tools
	}
	return data, nil
}

// decodeJSONValue parses one JSON value into template values, keeping object key order.
func decodeJSONValue(raw []byte) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValue(dec, 0)
	if err != nil {
		return jinja.Undefined(), err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return jinja.Undefined(), errors.New("trailing data after the JSON value")
	}
	return v, nil
}

// maxJSONDepth bounds nesting (a request body is client input).
const maxJSONDepth = 128

func decodeValue(dec *json.Decoder, depth int) (jinja.Value, error) {
	if depth > maxJSONDepth {
		return jinja.Undefined(), errors.New("JSON nested too deeply")
	}
	tok, err := dec.Token()
	if err != nil {
		return jinja.Undefined(), err
	}
	switch x := tok.(type) {
	case json.Delim:
		switch x {
		case '[':
			var items []jinja.Value
			for dec.More() {
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Undefined(), err
				}
				items = append(items, v)
			}
			if _, err := dec.Token(); err != nil { // ']'
				return jinja.Undefined(), err
			}
			return jinja.NewList(items), nil
		case '{':
			d := jinja.NewDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return jinja.Undefined(), err
				}
				key, ok := kt.(string)
				if !ok {
					return jinja.Undefined(), errors.New("object key is not a string")
				}
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return jinja.Undefined(), err
				}
				d.AsDict().Set(key, v)
			}
			if _, err := dec.Token(); err != nil { // '}'
				return jinja.Undefined(), err
			}
			return d, nil
		}
		return jinja.Undefined(), fmt.Errorf("unexpected %v", x)
	case nil:
		return jinja.None(), nil
	default: // string, bool, json.Number
		return jinja.FromGoValue(x), nil
	}
}
