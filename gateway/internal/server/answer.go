package server

import (
	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/toolcall"
)

// parsesAnswers reports whether a chat answer goes through the reasoning or tool-call parser
// (the gateway's --reasoning-parser, --tool-call-parser).
func (s *Server) parsesAnswers(req *api.Request) bool {
	p := s.opt.Parse
	return req.Kind == api.Chat && !req.Stream && req.Tools != nil &&
		((p.ReasoningParser != "" && req.Tools.SeparateReasoning) || (p.ToolCallParser != "" && req.Tools.HasTools()))
}

// streamsReasoning sets out to split a streamed chat answer's reasoning (--reasoning-parser,
// separate_reasoning), as SGLang's _process_reasoning_stream does: reasoning_content deltas,
// then content deltas; and, with tools under --tool-call-parser, to hold back the content's
// tool-call markup and send its calls whole at the end (toolcall.ToolStream: the calls of the
// whole answer's parse, as a non-streaming answer's).
func (s *Server) streamsReasoning(req *api.Request, out *sink) {
	p := s.opt.Parse
	if req.Kind != api.Chat || !req.Stream || req.Tools == nil {
		return
	}
	ct := req.Tools
	if p.ReasoningParser != "" && ct.SeparateReasoning {
		out.reasoning = toolcall.NewReasoningStream(p.ReasoningParser, toolcall.ForceReasoning(p.ReasoningParser, ct.Vars),
			ct.Vars["force_nonempty_content"] == true, ct.StreamReasoning)
		out.onReason = s.m.ReasoningAnswers.Inc
	}
	if p.ToolCallParser != "" && ct.HasTools() {
		out.tools = toolcall.NewToolStream(p.ToolCallParser, toolNames(ct))
		out.onCalls = s.countCalls
	}
}

func toolNames(ct *api.ChatTools) []string {
	names := make([]string, len(ct.Tools))
	for i, f := range ct.Tools {
		names[i] = f.Name
	}
	return names
}

// countCalls counts an answer's parsed tool calls and why markup gave none.
func (s *Server) countCalls(calls []toolcall.Call, fail toolcall.Failure) {
	if fail != "" {
		s.m.ToolParseFailures.WithLabelValues(string(fail)).Inc()
	}
	s.m.ToolCalls.Add(float64(len(calls)))
}

// answer splits a whole chat answer as SGLang's serving_chat does: the reasoning block into
// reasoning_content, then the tool calls (tool_choice "auto") into tool_calls with finish_reason
// "tool_calls" when the answer stopped on its own. finish is the answer's finish reason.
func (s *Server) answer(req *api.Request, text, finish string) (api.Answer, string) {
	p, ct := s.opt.Parse, req.Tools
	var a api.Answer
	if p.ReasoningParser != "" && ct.SeparateReasoning {
		force := toolcall.ForceReasoning(p.ReasoningParser, ct.Vars)
		var r string
		r, text = toolcall.Reasoning(p.ReasoningParser, text, force, ct.Vars["force_nonempty_content"] == true)
		if r != "" {
			a.ReasoningContent = &r
			s.m.ReasoningAnswers.Inc()
		}
	}
	if p.ToolCallParser != "" && ct.HasTools() {
		content, calls, fail := toolcall.Parse(p.ToolCallParser, text, toolNames(ct))
		s.countCalls(calls, fail)
		text = content
		for i, c := range calls {
			a.ToolCalls = append(a.ToolCalls, api.ToolCall{ID: toolcall.CallID(), Index: i, Type: "function",
				Function: api.ToolCallFunction{Name: c.Name, Arguments: c.Arguments}})
		}
		if len(calls) > 0 && finish == "stop" {
			finish = "tool_calls"
		}
	}
	a.Content = text
	return a, finish
}
