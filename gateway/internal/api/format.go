package api

import (
	"encoding/json"
	"time"
)

// RouteInfo is what the gateway tells a client about how its request was served (also sent as
// X-KVC-* headers). It appears as the "kvc" field of OpenAI answers.
type RouteInfo struct {
	Mode       string          `json:"mode"`
	Reason     string          `json:"reason"`
	DecisionID string          `json:"decision_id,omitempty"`
	FailOpen   bool            `json:"fail_open,omitempty"`
	Retries    int             `json:"retries,omitempty"`
	Worker     json.RawMessage `json:"worker,omitempty"` // the decode worker's meta_info.kvc
	// RetriedFrom: the decode workers of the failed attempts that were retried, in order.
	RetriedFrom []string `json:"retried_from,omitempty"`
	// ResumedFrom: the decode worker that died mid-answer; a new decision continued the
	// answer from the tokens generated there (the gateway's --resume-mid-stream). Mode,
	// Reason, DecisionID, FailOpen and Worker are then the last continuation's.
	ResumedFrom string `json:"resumed_from,omitempty"`
	// ResumedDecodeWorker: the decode worker of the continuation that finished the answer
	// (X-KVC-Resumed-Decode-Worker).
	ResumedDecodeWorker string `json:"resumed_decode_worker,omitempty"`
	// ResumedAttempts: the continuation attempts run (X-KVC-Resumed-Attempts): all but the
	// last failed before their first token and were retried through a new decision.
	ResumedAttempts int `json:"resumed_attempts,omitempty"`
	// ResumedRetriedFrom: the decode workers of those retried continuation attempts, in order
	// (X-KVC-Resumed-Retried-From).
	ResumedRetriedFrom []string `json:"resumed_retried_from,omitempty"`
}

// Usage is OpenAI's token usage object.
type Usage struct {
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	TotalTokens      int64 `json:"total_tokens"`
}

func object(k Kind, stream bool) string {
	switch {
	case k == Chat && stream:
		return "chat.completion.chunk"
	case k == Chat:
		return "chat.completion"
	default:
		return "text_completion"
	}
}

// Chunk encodes one OpenAI streaming chunk carrying delta text (finish empty while streaming).
func Chunk(k Kind, id, model, delta string, first bool, finish string, usage *Usage, info *RouteInfo) []byte {
	choice := map[string]any{"index": 0, "finish_reason": nil}
	if finish != "" {
		choice["finish_reason"] = finish
	}
	if k == Chat {
		d := map[string]any{}
		if first {
			d["role"] = "assistant"
		}
		if delta != "" || finish == "" {
			d["content"] = delta
		}
		choice["delta"] = d
	} else {
		choice["text"] = delta
	}
	m := map[string]any{"id": id, "object": object(k, true), "created": time.Now().Unix(), "model": model, "choices": []any{choice}}
	if usage != nil {
		m["usage"] = usage
	}
	if info != nil {
		m["kvc"] = info
	}
	b, _ := json.Marshal(m)
	return b
}

// ReasoningChunk encodes one chat streaming chunk carrying reasoning text (delta
// reasoning_content, as SGLang streams it with --reasoning-parser).
func ReasoningChunk(id, model, reasoning string, first bool) []byte {
	d := map[string]any{"reasoning_content": reasoning}
	if first {
		d["role"] = "assistant"
	}
	choice := map[string]any{"index": 0, "finish_reason": nil, "delta": d}
	b, _ := json.Marshal(map[string]any{"id": id, "object": object(Chat, true), "created": time.Now().Unix(), "model": model, "choices": []any{choice}})
	return b
}

// ToolCallsChunk encodes one chat streaming chunk carrying a streamed answer's tool calls, each
// whole (delta tool_calls: index, id, type, the function's name and its arguments string; OpenAI
// clients join a call's deltas by index).
func ToolCallsChunk(id, model string, calls []ToolCall, first bool) []byte {
	d := map[string]any{"tool_calls": calls}
	if first {
		d["role"] = "assistant"
	}
	choice := map[string]any{"index": 0, "finish_reason": nil, "delta": d}
	b, _ := json.Marshal(map[string]any{"id": id, "object": object(Chat, true), "created": time.Now().Unix(), "model": model, "choices": []any{choice}})
	return b
}

// Full encodes a non-streaming OpenAI answer.
func Full(k Kind, id, model, text, finish string, usage Usage, info *RouteInfo) []byte {
	choice := map[string]any{"index": 0, "finish_reason": finish}
	if k == Chat {
		choice["message"] = map[string]string{"role": "assistant", "content": text}
	} else {
		choice["text"] = text
	}
	b, _ := json.Marshal(map[string]any{"id": id, "object": object(k, false), "created": time.Now().Unix(), "model": model, "choices": []any{choice}, "usage": usage, "kvc": info})
	return b
}

// ToolCall is one tool call of a chat answer (OpenAI's message.tool_calls[i], as SGLang writes
// it: id, index, type "function", the function's name and its arguments as a JSON string).
type ToolCall struct {
	ID       string           `json:"id"`
	Index    int              `json:"index"`
	Type     string           `json:"type"`
	Function ToolCallFunction `json:"function"`
}

// ToolCallFunction is a tool call's function.
type ToolCallFunction struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// Answer is a parsed chat answer: SGLang's message with --reasoning-parser or
// --tool-call-parser (reasoning_content null when none, tool_calls only when some).
type Answer struct {
	Content          string
	ReasoningContent *string
	ToolCalls        []ToolCall
}

// FullChat encodes a non-streaming chat answer whose message the gateway parsed (Answer).
func FullChat(id, model string, a Answer, finish string, usage Usage, info *RouteInfo) []byte {
	msg := map[string]any{"role": "assistant", "content": a.Content, "reasoning_content": a.ReasoningContent}
	if len(a.ToolCalls) > 0 {
		msg["tool_calls"] = a.ToolCalls
	}
	choice := map[string]any{"index": 0, "finish_reason": finish, "message": msg}
	b, _ := json.Marshal(map[string]any{"id": id, "object": object(Chat, false), "created": time.Now().Unix(), "model": model, "choices": []any{choice}, "usage": usage, "kvc": info})
	return b
}
