package api

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

// Tool choices (ChatTools.Choice).
const (
	ChoiceNone     = "none"
	ChoiceAuto     = "auto"
	ChoiceRequired = "required"
	// ChoiceFunction is a named function ({"type":"function","function":{"name":…}}).
	ChoiceFunction = "function"
)

// ToolFunc is one request tool's function, as the output parser needs it.
type ToolFunc struct {
	Name   string
	Strict bool
}

// ChatTools are a chat request's tools and chat-template inputs besides the messages, as
// SGLang 0.5.23 computes them (protocol.py ChatCompletionRequest, serving_chat.py
// _validate_request, _process_messages, _apply_jinja_template): see docs/gateway.md.
type ChatTools struct {
	// ToolsJSON is what the chat template gets as `tools`: each tool as SGLang's
	// Tool.model_dump() writes it, in its key order; nil: none (no tools, tool_choice "none").
	ToolsJSON json.RawMessage
	// Vars are the template's extra variables: reasoning_effort, then chat_template_kwargs
	// (after reasoning_effort / reasoning set their thinking defaults). nil: none.
	Vars map[string]any
	// Choice is the tool choice (Choice*); Named is the function's name for ChoiceFunction
	// (nil: the client named none).
	Choice string
	Named  *string
	// Tools are the request's tools (the output parser reads calls to them).
	Tools []ToolFunc
	// SeparateReasoning and StreamReasoning are SGLang's separate_reasoning and
	// stream_reasoning (default true: a streamed answer's reasoning comes as it is generated,
	// else in one piece when its block ends).
	SeparateReasoning bool
	StreamReasoning   bool
}

// Template reports whether the chat template gets anything besides the messages.
func (t *ChatTools) Template() bool { return t != nil && (len(t.ToolsJSON) > 0 || len(t.Vars) > 0) }

// HasTools reports whether the request declared tools the model may call (tool parsing runs).
func (t *ChatTools) HasTools() bool { return t != nil && len(t.Tools) > 0 && t.Choice != ChoiceNone }

// Size is the bytes the template inputs add to a rendering (for the tokenizer's bounds).
func (t *ChatTools) Size() int64 {
	if t == nil {
		return 0
	}
	n := int64(len(t.ToolsJSON))
	for k, v := range t.Vars {
		n += int64(len(k)) + int64(len(pyjson.Dumps(v, pyjson.Options{Compact: true})))
	}
	return n
}

// chatToolFields are the body's fields parseChatTools reads (slices of the body).
type chatToolFields struct {
	Tools              rawField
	ToolChoice         rawField
	ChatTemplateKwargs rawField
	ReasoningEffort    rawField
	Reasoning          rawField
	SeparateReasoning  *bool
	// Defaults are the server's default template kwargs (--default-chat-template-kwargs);
	// nil: none.
	Defaults *pyjson.Object
}

// ParseDefaultKwargs decodes --default-chat-template-kwargs (SGLang's server argument of the
// same name): a JSON object, without chat_template (the gateway renders the model's own).
func ParseDefaultKwargs(raw string) (*pyjson.Object, error) {
	if strings.TrimSpace(raw) == "" {
		return nil, nil
	}
	v, err := pyjson.Decode([]byte(raw))
	if err != nil {
		return nil, fmt.Errorf("--default-chat-template-kwargs: %w", err)
	}
	o, ok := v.(*pyjson.Object)
	if !ok {
		return nil, fmt.Errorf("--default-chat-template-kwargs must be a JSON object")
	}
	if _, ok := o.Values["chat_template"]; ok {
		return nil, fmt.Errorf("--default-chat-template-kwargs: chat_template is not supported (the gateway renders the tokenizer's template)")
	}
	if len(o.Keys) == 0 {
		return nil, nil
	}
	return o, nil
}

func isNull(f rawField) bool { return len(f) == 0 || string(f) == "null" }

// reasoningTiers are SGLang's string reasoning efforts (ReasoningEffortTier).
var reasoningTiers = map[string]bool{"none": true, "minimal": true, "low": true, "medium": true, "high": true, "xhigh": true, "ultra": true, "max": true}

func invalid(format string, a ...any) *Error {
	return badRequestCode(CodeInvalidParameter, format, a...)
}

// parseChatTools decodes, validates and normalizes the fields as SGLang does; hasMessageTools
// is whether a system or developer message carries tools (they set tool_choice's default).
func parseChatTools(f chatToolFields, hasMessageTools bool) (*ChatTools, *Error) {
	ct := &ChatTools{SeparateReasoning: f.SeparateReasoning == nil || *f.SeparateReasoning}

	// normalize_reasoning_inputs (a before-validator: on the raw values).
	var effort any // the raw reasoning_effort (top level, or the reasoning object's)
	if !isNull(f.ReasoningEffort) {
		v, err := pyjson.Decode(f.ReasoningEffort)
		if err != nil {
			return nil, invalid("reasoning_effort: %v", err)
		}
		effort = v
	}
	var thinking *bool
	if !isNull(f.Reasoning) {
		v, err := pyjson.Decode(f.Reasoning)
		if err != nil {
			return nil, invalid("reasoning: %v", err)
		}
		if r, ok := v.(*pyjson.Object); ok {
			e := r.Values["effort"]
			if e == nil {
				e = r.Values["reasoning_effort"]
			}
			switch x := e.(type) {
			case nil:
			case string:
				if reasoningTiers[x] {
					effort = x
				} else if g, err := strconv.ParseFloat(strings.TrimSpace(x), 64); err == nil {
					effort = g
				} else {
					return nil, invalid("invalid reasoning effort: %s", pyRepr(x))
				}
			case pyjson.Int, float64:
				effort = pyjson.Plain(x)
			default:
				return nil, invalid("invalid reasoning effort: %s", pyjson.Dumps(x, pyjson.Options{}))
			}
			en := r.Values["enabled"]
			if en == nil {
				en = r.Values["enable"]
			}
			if s, ok := en.(string); ok {
				switch strings.ToLower(strings.TrimSpace(s)) {
				case "1", "true", "yes", "y", "on":
					en = true
				default:
					en = false
				}
			}
			if pyjson.Truthy(en) {
				t := true
				thinking = &t
			}
		}
	}
	if effort != nil {
		t := effort != "none"
		thinking = &t
	}
	var ctk *pyjson.Object
	if !isNull(f.ChatTemplateKwargs) {
		v, err := pyjson.Decode(f.ChatTemplateKwargs)
		if err != nil {
			return nil, invalid("chat_template_kwargs: %v", err)
		}
		o, ok := v.(*pyjson.Object)
		if !ok && thinking == nil {
			return nil, invalid("chat_template_kwargs must be an object")
		}
		ctk = o
	}
	if thinking != nil {
		if ctk == nil {
			ctk = &pyjson.Object{Values: map[string]any{}}
		}
		for _, k := range []string{"thinking", "enable_thinking"} {
			if _, ok := ctk.Values[k]; !ok {
				ctk.Set(k, *thinking)
			}
		}
	}

	// Field validation: reasoning_effort.
	switch x := effort.(type) {
	case nil:
	case bool:
		return nil, invalid("reasoning_effort must not be a boolean")
	case string:
		if !reasoningTiers[x] {
			g, err := strconv.ParseFloat(strings.TrimSpace(x), 64)
			if err != nil {
				return nil, invalid("reasoning_effort %s is none of none, minimal, low, medium, high, xhigh, ultra, max nor a number in [0, 0.99]", pyRepr(x))
			}
			effort = g
		}
	case pyjson.Int, float64, int64:
		effort = pyjson.Plain(x)
	default:
		return nil, invalid("reasoning_effort must be a string or a number")
	}
	switch x := effort.(type) {
	case int64:
		effort = float64(x)
	}
	if g, ok := effort.(float64); ok && (math.IsNaN(g) || g < 0 || g > 0.99) {
		return nil, invalid("reasoning_effort %v out of range [0, 0.99]", g)
	}

	// tools (Tool, Function) and tool_choice.
	toolsJSON, funcs, e := parseTools(f.Tools)
	if e != nil {
		return nil, e
	}
	ct.Tools = funcs
	switch {
	case isNull(f.ToolChoice):
		ct.Choice = ChoiceAuto
		if isNull(f.Tools) && !hasMessageTools {
			ct.Choice = ChoiceNone
		}
	default:
		v, err := pyjson.Decode(f.ToolChoice)
		if err != nil {
			return nil, invalid("tool_choice: %v", err)
		}
		switch x := v.(type) {
		case string:
			if x != ChoiceNone && x != ChoiceAuto && x != ChoiceRequired {
				return nil, invalid("tool_choice %s is none of \"auto\", \"required\", \"none\" or a function object", pyRepr(x))
			}
			ct.Choice = x
		case *pyjson.Object:
			if t, ok := x.Values["type"]; ok && t != "function" {
				return nil, invalid("tool_choice.type must be \"function\"")
			}
			fn, ok := x.Values["function"].(*pyjson.Object)
			if !ok {
				return nil, invalid("tool_choice.function must be an object")
			}
			ct.Choice = ChoiceFunction
			switch n := fn.Values["name"].(type) {
			case nil:
			case string:
				ct.Named = &n
			default:
				return nil, invalid("tool_choice.function.name must be a string")
			}
		default:
			return nil, invalid("tool_choice must be a string or an object")
		}
	}

	// _validate_request.
	if ctk != nil {
		if _, ok := ctk.Values["chat_template"]; ok {
			return nil, invalid("Request-supplied chat_template is not allowed. Start the server with --trust-request-chat-template to permit it.")
		}
	}
	if ct.Choice == ChoiceRequired && len(funcs) == 0 {
		return nil, invalid("Tools cannot be empty if tool choice is set to required.")
	}
	if ct.Choice == ChoiceFunction {
		if len(funcs) == 0 {
			return nil, invalid("Tools cannot be empty if tool choice is set to a specific tool.")
		}
		found := false
		for _, fn := range funcs {
			found = found || (ct.Named != nil && fn.Name == *ct.Named)
		}
		if !found {
			name := "None"
			if ct.Named != nil {
				name = *ct.Named
			}
			return nil, invalid("Tool '%s' not found in tools list.", name)
		}
	}

	// _process_messages: the server's default kwargs fill what the request left unset, and
	// their reasoning_effort stands in for a request without one (unchecked, as SGLang has it).
	if f.Defaults != nil {
		if ctk == nil {
			ctk = &pyjson.Object{Values: map[string]any{}}
		}
		for _, k := range f.Defaults.Keys {
			if _, ok := ctk.Values[k]; !ok {
				ctk.Set(k, f.Defaults.Values[k])
			}
		}
		if e := ctk.Values["reasoning_effort"]; e != nil && effort == nil {
			effort = pyjson.Plain(e)
		}
	}
	// The tools the template gets.
	if len(funcs) > 0 && ct.Choice != ChoiceNone {
		var picked []any
		for i, t := range toolsJSON {
			if ct.Choice != ChoiceFunction || funcs[i].Name == *ct.Named {
				picked = append(picked, t)
			}
		}
		if len(picked) > 0 {
			ct.ToolsJSON = json.RawMessage(pyjson.Dumps(picked, pyjson.Options{Compact: true}))
		}
	}
	// _apply_jinja_template: the template's extra kwargs.
	vars := map[string]any{}
	if effort != nil {
		vars["reasoning_effort"] = effort
	}
	if ctk != nil {
		for _, k := range ctk.Keys {
			vars[k] = pyjson.Plain(ctk.Values[k])
		}
	}
	if len(vars) > 0 {
		ct.Vars = vars
	}
	return ct, nil
}

// parseTools validates the tools array (SGLang's Tool and Function models) and returns each
// tool as Tool.model_dump() builds it: type (default "function"), function, defer_loading
// (null when absent); the function's keys in the client's order, then description and
// parameters (null when missing), strict and defer_loading only when not null, the tool's
// defer_loading copied into a function that has none. Unknown keys are dropped; the
// parameters' database-style type names are rewritten as SGLang rewrites them (schematypes.go).
func parseTools(raw rawField) ([]any, []ToolFunc, *Error) {
	if isNull(raw) {
		return nil, nil, nil
	}
	v, err := pyjson.Decode(raw)
	if err != nil {
		return nil, nil, invalid("tools: %v", err)
	}
	list, ok := v.([]any)
	if !ok {
		return nil, nil, invalid("tools must be an array")
	}
	out := make([]any, 0, len(list))
	funcs := make([]ToolFunc, 0, len(list))
	for i, e := range list {
		t, ok := e.(*pyjson.Object)
		if !ok {
			return nil, nil, invalid("tools[%d] must be an object", i)
		}
		typ := any("function")
		if x, ok := t.Values["type"]; ok {
			s, ok := x.(string)
			if !ok {
				return nil, nil, invalid("tools[%d].type must be a string", i)
			}
			typ = s
		}
		toolDefer, e := optBool(t, "defer_loading", fmt.Sprintf("tools[%d]", i))
		if e != nil {
			return nil, nil, e
		}
		fn, ok := t.Values["function"].(*pyjson.Object)
		if !ok {
			return nil, nil, invalid("tools[%d].function must be an object", i)
		}
		where := fmt.Sprintf("tools[%d].function", i)
		name, ok := fn.Values["name"].(string)
		if !ok {
			return nil, nil, invalid("%s.name must be a string", where)
		}
		if d, ok := fn.Values["description"]; ok && d != nil {
			if _, ok := d.(string); !ok {
				return nil, nil, invalid("%s.description must be a string", where)
			}
		}
		strict, e := optBool(fn, "strict", where)
		if e != nil {
			return nil, nil, e
		}
		fnDefer, e := optBool(fn, "defer_loading", where)
		if e != nil {
			return nil, nil, e
		}
		if fnDefer == nil {
			fnDefer = toolDefer
		}
		if p := fn.Values["parameters"]; p != nil {
			normalizeSchemaTypes(p, 0) // SGLang's _validate_request rewrites them before rendering
		}
		data := map[string]any{"description": fn.Values["description"], "name": name, "parameters": fn.Values["parameters"]}
		if strict != nil {
			data["strict"] = *strict
		}
		if fnDefer != nil {
			data["defer_loading"] = *fnDefer
		}
		dump := &pyjson.Object{Values: map[string]any{}}
		for _, k := range fn.Keys {
			if v, ok := data[k]; ok {
				dump.Set(k, v)
			}
		}
		for _, k := range []string{"description", "name", "parameters", "strict", "defer_loading"} {
			if v, ok := data[k]; ok {
				dump.Set(k, v)
			}
		}
		tool := &pyjson.Object{}
		tool.Set("type", typ)
		tool.Set("function", dump)
		if toolDefer != nil {
			tool.Set("defer_loading", *toolDefer)
		} else {
			tool.Set("defer_loading", nil)
		}
		out = append(out, tool)
		funcs = append(funcs, ToolFunc{Name: name, Strict: strict != nil && *strict})
	}
	return out, funcs, nil
}

// optBool reads an optional boolean field (absent or null: nil).
func optBool(o *pyjson.Object, key, where string) (*bool, *Error) {
	switch x := o.Values[key].(type) {
	case nil:
		return nil, nil
	case bool:
		return &x, nil
	}
	return nil, invalid("%s.%s must be a boolean", where, key)
}

// pyRepr is Python's repr() of a string, for SGLang's messages.
func pyRepr(s string) string { return "'" + strings.ReplaceAll(s, "'", `\'`) + "'" }

// toolCallArguments normalizes an assistant message's tool-call arguments as SGLang's
// normalize_assistant_tool_call_arguments does before rendering: each must be a JSON object,
// which the template then prints with tojson (json.dumps: the client's key order, ", " and
// ": "). The gateway hands the template that text, so a template printing the arguments
// renders SGLang's bytes whatever spacing the client sent.
func toolCallArguments(role string, calls []tokenizer.ToolCall) ([]tokenizer.ToolCall, *Error) {
	if role != "assistant" || len(calls) == 0 {
		return calls, nil
	}
	out := make([]tokenizer.ToolCall, len(calls))
	for i, c := range calls {
		if c.Function.Arguments == "" { // absent (SGLang normalizes only the strings given)
			out[i] = c
			continue
		}
		v, err := pyjson.Decode([]byte(c.Function.Arguments))
		if err != nil {
			return nil, invalid("Assistant tool call function.arguments must be valid JSON.")
		}
		if _, ok := v.(*pyjson.Object); !ok {
			return nil, invalid("Assistant tool call function.arguments must be a JSON object.")
		}
		c.Function.Arguments = pyjson.Dumps(v, pyjson.Options{})
		out[i] = c
	}
	return out, nil
}
