package toolcall

import "strings"

// ReasoningStream splits a streamed answer's reasoning block as SGLang's reasoning detector
// does chunk by chunk (parse_streaming_increment, then finish at the end): text that may be
// the start of a tag is held back until the next chunk tells.
type ReasoningStream struct {
	start, end, toolStart string
	stream                bool // SGLang's stream_reasoning: reasoning as it comes, else at its end
	forceNonempty         bool
	inReasoning           bool
	stripped              bool
	buf                   string
	acc                   string // reasoning so far, for forceNonempty
}

// NewReasoningStream starts a stream for parser (force and forceNonempty as for Reasoning;
// stream is the request's stream_reasoning).
func NewReasoningStream(parser string, force, forceNonempty, stream bool) *ReasoningStream {
	s := &ReasoningStream{start: "<think>", end: "</think>", stream: stream, forceNonempty: forceNonempty, inReasoning: force}
	if parser == "qwen3" {
		s.toolStart = "<tool_call>"
	}
	return s
}

// Chunk takes the next piece of the answer and returns what is now known to be reasoning
// and content.
func (s *ReasoningStream) Chunk(text string) (reasoning, normal string) {
	reasoning, normal = s.chunk(text)
	if s.forceNonempty {
		if s.inReasoning {
			s.acc += reasoning
		} else {
			s.acc = ""
		}
	}
	return reasoning, normal
}

func (s *ReasoningStream) chunk(text string) (string, string) {
	s.buf += text
	cur := s.buf
	for _, tok := range []string{s.start, s.end, s.toolStart} {
		if tok != "" && tok != cur && strings.HasPrefix(tok, cur) {
			return "", "" // the text so far may be a tag: wait
		}
	}
	if !s.stripped && strings.Contains(cur, s.start) {
		cur = strings.Replace(cur, s.start, "", 1)
		s.buf = cur
		s.stripped = true
		s.inReasoning = true
	}
	if s.inReasoning {
		if i := strings.Index(cur, s.end); i >= 0 {
			s.buf, s.inReasoning = "", false
			return cur[:i], cur[i+len(s.end):]
		}
		if s.toolStart != "" {
			if i := strings.Index(cur, s.toolStart); i >= 0 {
				s.buf, s.inReasoning = "", false
				return cur[:i], cur[i:]
			}
		}
		if !s.stream {
			return "", ""
		}
		hold := partialSuffix(cur, s.end)
		if s.toolStart != "" {
			hold = max(hold, partialSuffix(cur, s.toolStart))
		}
		if !s.stripped {
			hold = max(hold, partialSuffix(cur, s.start))
		}
		s.buf = cur[len(cur)-hold:]
		return cur[:len(cur)-hold], ""
	}
	s.buf = ""
	return "", cur
}

// End flushes what is held back when the answer ends (a block cut short is reasoning).
func (s *ReasoningStream) End() (reasoning, normal string) {
	if !s.inReasoning {
		left := s.buf
		s.buf = ""
		return "", left
	}
	buf := strings.TrimPrefix(s.buf, s.start)
	s.buf = ""
	if s.forceNonempty {
		n := s.acc + buf
		s.acc = ""
		return "", n
	}
	return buf, ""
}

// partialSuffix is the length of the longest end of buf that is a strict prefix of tok.
func partialSuffix(buf, tok string) int {
	for i := min(len(buf), len(tok)-1); i > 0; i-- {
		if strings.HasPrefix(tok, buf[len(buf)-i:]) {
			return i
		}
	}
	return 0
}

// ToolStream holds back a streamed answer's tool-call markup (the text after any reasoning):
// content passes as it comes until the parser's call start ("<tool_call>\n" for qwen25,
// "<tool_call>" for hermes; text that may be its beginning is held until the next chunk
// tells), and everything from the start on is kept for End, which parses the whole answer as
// Parse does — the calls come whole, after the content, as one delta.
type ToolStream struct {
	parser string
	tools  []string
	bot    string
	all    strings.Builder // the whole text
	held   string          // what Chunk has not passed on
	inCall bool            // the call start was seen: everything after it is held
}

// NewToolStream starts a stream for parser with the request's function names.
func NewToolStream(parser string, tools []string) *ToolStream {
	bot := "<tool_call>\n"
	if parser == "hermes" {
		bot = "<tool_call>"
	}
	return &ToolStream{parser: parser, tools: tools, bot: bot}
}

// Chunk takes the next piece of the answer and returns the content now known not to be a call.
func (s *ToolStream) Chunk(text string) (content string) {
	s.all.WriteString(text)
	if s.inCall {
		s.held += text
		return ""
	}
	cur := s.held + text
	if i := strings.Index(cur, s.bot); i >= 0 {
		s.held, s.inCall = cur[i:], true
		return cur[:i]
	}
	h := partialSuffix(cur, s.bot)
	s.held = cur[len(cur)-h:]
	return cur[:len(cur)-h]
}

// End parses the whole answer (Parse) and returns the content still to send — what was held
// when the whole text is content (no markup, or markup that fails the answer); nothing when
// the markup gave calls or was dropped — the calls, and why markup gave none.
func (s *ToolStream) End() (content string, calls []Call, fail Failure) {
	all := s.all.String()
	c, calls, fail := Parse(s.parser, all, s.tools)
	if c == all {
		content = s.held
	}
	s.held = ""
	return content, calls, fail
}
