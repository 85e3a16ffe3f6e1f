package tokenizer

import (
	"fmt"
	"maps"

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
	// Vars are extra template variables (enable_thinking, tools, ...). Values are plain Go
	// values (string, bool, float64, []any, map[string]any). Note: map keys have no order in
	// Go, so a template that runs `tojson` over a map renders keys in the library's order,
	// which may differ from the client's JSON order.
	Vars map[string]any
}

// chatTemplate is a compiled chat template.
type chatTemplate struct {
	tmpl *jinja.Template
}

func compileTemplate(src string) (*chatTemplate, error) {
	t, err := jinja.Compile(src)
	if err != nil {
		return nil, err
	}
	return &chatTemplate{tmpl: t}, nil
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

func (t *Tokenizer) render(msgs []any, opts ChatOptions) (string, error) {
	if t.chat == nil {
		return "", ErrNoChatTemplate
	}
	data := map[string]any{"tools": nil, "documents": nil}
	maps.Copy(data, t.specialVars)
	maps.Copy(data, opts.Vars)
	data["messages"] = msgs
	data["add_generation_prompt"] = opts.AddGenerationPrompt
	out, err := t.chat.tmpl.Render(data)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrTemplate, err)
	}
	return out, nil
}
