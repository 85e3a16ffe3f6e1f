package server

import (
	"encoding/json"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/toolcall"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// sink writes the client's answer: SSE for streaming requests (OpenAI chunks or SGLang chunks
// passed through), one JSON document otherwise. Nothing is written before the first token, so a
// request can still be retried or answered with a plain HTTP error until then.
type sink struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	req     *api.Request
	started bool // headers and status written
	retries int
	// retriedFrom lists the decode workers of the attempts that failed and were retried, in order
	// (X-KVC-Retried-From): a client or a benchmark can tell which worker a request lost time on.
	retriedFrom []string

	acc        strings.Builder // text so far (deltas)
	chunks     int
	cumulative bool // the worker streams cumulative text (SGLang's default)
	// cumulativeIDs: the worker streams cumulative output_ids (each chunk repeats the earlier).
	cumulativeIDs bool
	// The current attempt's part of the answer: after a resume (resume.go) the continuation's
	// worker streams its text and ids from the join, not from the answer's start.
	seg       int     // acc's length where this attempt's text starts
	segChunks int     // this attempt's chunks
	firstIDs  []int64 // the output ids of this attempt's first chunk (the ids' style, as delta's)
	base      *resumeBase
	id        string
	// answer parses a whole chat answer (answer.go); nil: the text is the message's content.
	answer func(req *api.Request, text, finish string) (api.Answer, string)
	// reasoning splits a streamed chat answer's reasoning (answer.go); nil: none.
	reasoning *toolcall.ReasoningStream
	// tools holds back a streamed chat answer's tool-call markup and parses its calls at the
	// end (answer.go); nil: none.
	tools    *toolcall.ToolStream
	onCalls  func(calls []toolcall.Call, fail toolcall.Failure) // counts a streamed answer's calls
	sentRole bool                                               // the first chat chunk (with role) went out
	onReason func()
}

func newSink(w http.ResponseWriter, req *api.Request) *sink {
	prefix := "cmpl-"
	if req.Kind == api.Chat {
		prefix = "chatcmpl-"
	}
	return &sink{w: w, rc: http.NewResponseController(w), req: req, id: prefix + req.RID}
}

func (s *sink) routeHeaders(p *plan, req *api.Request) {
	h := s.w.Header()
	h.Set("X-KVC-Mode", modeName(p.mode))
	h.Set("X-KVC-Reason", p.reason)
	if p.decisionID != "" {
		h.Set("X-KVC-Decision-Id", p.decisionID)
	}
	h.Set("X-KVC-Fail-Open", strconv.FormatBool(p.failOpen))
	h.Set("X-KVC-Retries", strconv.Itoa(s.retries))
	if len(s.retriedFrom) > 0 {
		h.Set("X-KVC-Retried-From", strings.Join(s.retriedFrom, ","))
	}
	h.Set("X-KVC-Input-Tokens", strconv.FormatInt(req.InputTokens, 10))
	h.Set("X-KVC-Cached-Tokens", strconv.FormatInt(p.cached, 10))
	if s.base != nil {
		h.Set("X-KVC-Resumed-From", s.base.from)
		s.base.attemptHeaders(h, "")
	}
	if n := p.exec.GetLoadPrefixTokens(); n > 0 && p.exec.GetCallPrefill() {
		// Prefill from the snapshot: P loads this many tokens of the session's snapshot from its
		// store and computes only the rest (the workers cut it to whole pages).
		h.Set("X-KVC-Prefill-Load-Tokens", strconv.FormatInt(n, 10))
	}
	if p.decode != nil {
		h.Set("X-KVC-Decode-Worker", p.decode.GetWorkerId())
	}
	h.Set("X-Request-Id", req.RID)
}

func (s *sink) begin(p *plan, req *api.Request) {
	if s.started || !req.Stream {
		return
	}
	s.routeHeaders(p, req)
	h := s.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	s.w.WriteHeader(http.StatusOK)
	s.started = true
}

func (s *sink) event(payload []byte) error {
	if _, err := s.w.Write([]byte("data: ")); err != nil {
		return err
	}
	if _, err := s.w.Write(payload); err != nil {
		return err
	}
	if _, err := s.w.Write([]byte("\n\n")); err != nil {
		return err
	}
	return s.rc.Flush()
}

// delta turns a worker chunk's text into the new text, whether the worker streams cumulative
// text (SGLang's default) or increments; the style is fixed by the second chunk (of the first
// attempt that has two). A continuation's cumulative text starts at the join.
func (s *sink) delta(text string) string {
	s.chunks++
	s.segChunks++
	acc := s.acc.String()[s.seg:]
	if s.segChunks == 2 && len(acc) > 0 && len(text) > len(acc) && strings.HasPrefix(text, acc) {
		s.cumulative = true
	}
	d := text
	if s.cumulative {
		if strings.HasPrefix(text, acc) {
			d = text[len(acc):]
		}
	}
	s.acc.WriteString(d)
	return d
}

// resume starts a continuation's part of the answer (resume.go): its worker's text and ids
// begin at the join, after what the client has; b is what the client has.
func (s *sink) resume(b *resumeBase) {
	s.base = b
	s.seg = s.acc.Len()
	s.segChunks = 0
	s.firstIDs = nil
}

func (s *sink) chunk(raw []byte, text string, ids []int64) error {
	d := s.delta(text)
	switch s.segChunks { // the ids' style, fixed by the second chunk as the text's
	case 1:
		s.firstIDs = slices.Clone(ids)
	case 2:
		if n := len(s.firstIDs); n > 0 && len(ids) > n && slices.Equal(ids[:n], s.firstIDs) {
			s.cumulativeIDs = true
		}
	}
	if !s.req.Stream {
		return nil
	}
	if s.req.Kind == api.Generate {
		if s.base != nil {
			raw = s.continued(raw, ids)
		}
		return s.event(raw) // SGLang format: pass the worker's chunk through (meta_info.kvc included)
	}
	if s.reasoning != nil {
		r, n := s.reasoning.Chunk(d)
		return s.reasoned(r, s.toolContent(n))
	}
	if s.tools != nil {
		return s.reasoned("", s.tools.Chunk(d))
	}
	return s.event(api.Chunk(s.req.Kind, s.id, s.req.Model, d, s.chunks == 1, "", nil, nil))
}

// toolContent passes a streamed answer's content through the tool-call stream when there is one.
func (s *sink) toolContent(n string) string {
	if s.tools == nil {
		return n
	}
	return s.tools.Chunk(n)
}

// endTools ends a streamed answer's tool-call stream: the content it still held, then its calls
// as one tool_calls delta (each call whole: its arguments one JSON string); the finish reason
// becomes "tool_calls" when there are calls and the answer stopped on its own, as SGLang's.
func (s *sink) endTools(finish string) string {
	if s.tools == nil {
		return finish
	}
	rest, calls, fail := s.tools.End()
	_ = s.reasoned("", rest)
	if s.onCalls != nil {
		s.onCalls(calls, fail)
	}
	if len(calls) == 0 {
		return finish
	}
	tc := make([]api.ToolCall, len(calls))
	for i, c := range calls {
		tc[i] = api.ToolCall{ID: toolcall.CallID(), Index: i, Type: "function", Function: api.ToolCallFunction{Name: c.Name, Arguments: c.Arguments}}
	}
	_ = s.event(api.ToolCallsChunk(s.id, s.req.Model, tc, !s.sentRole))
	s.sentRole = true
	if finish == "stop" {
		finish = "tool_calls"
	}
	return finish
}

// continued is a continuation's /generate chunk as the uninterrupted stream's would be: its
// text and output_ids in the worker's style (cumulative: from the answer's start), meta_info's
// counts over the whole answer (resumeBase.meta). A chunk it cannot read goes as it is.
func (s *sink) continued(raw []byte, ids []int64) []byte {
	var m map[string]json.RawMessage
	if json.Unmarshal(raw, &m) != nil || m == nil {
		return raw
	}
	if _, ok := m["text"]; ok && s.cumulative {
		m["text"], _ = json.Marshal(s.acc.String())
	}
	if _, ok := m["output_ids"]; ok && s.cumulativeIDs {
		m["output_ids"], _ = json.Marshal(append(slices.Clip(s.base.ids), ids...))
	}
	if mi, ok := m["meta_info"]; ok {
		m["meta_info"] = s.base.meta(mi)
	}
	out, err := json.Marshal(m)
	if err != nil {
		return raw
	}
	return out
}

// trailers name, at the end of a started stream, the worker it resumed from, the one that
// finished it (the last continuation's), the continuation's mode and whether it failed open
// (X-KVC-Resumed-From, X-KVC-Resumed-Decode-Worker, X-KVC-Resumed-Mode,
// X-KVC-Resumed-Fail-Open), the continuation attempts and the workers of those that failed
// before their first token (X-KVC-Resumed-Attempts, X-KVC-Resumed-Retried-From): the headers
// went out with the first worker's.
func (s *sink) trailers(p *plan) {
	if s.base == nil || !s.started {
		return
	}
	h := s.w.Header()
	h.Set(http.TrailerPrefix+"X-KVC-Resumed-From", s.base.from)
	h.Set(http.TrailerPrefix+"X-KVC-Resumed-Decode-Worker", p.decode.GetWorkerId())
	h.Set(http.TrailerPrefix+"X-KVC-Resumed-Mode", modeName(p.mode))
	h.Set(http.TrailerPrefix+"X-KVC-Resumed-Fail-Open", strconv.FormatBool(p.failOpen))
	s.base.attemptHeaders(h, http.TrailerPrefix)
}

// attemptHeaders sets X-KVC-Resumed-Attempts (the continuation attempts run) and, when some
// failed before their first token and were retried, X-KVC-Resumed-Retried-From (their decode
// workers, in order), each name prefixed (a trailer's http.TrailerPrefix).
func (b *resumeBase) attemptHeaders(h http.Header, prefix string) {
	h.Set(prefix+"X-KVC-Resumed-Attempts", strconv.Itoa(len(b.tried)))
	if r := b.retriedFrom(); len(r) > 0 {
		h.Set(prefix+"X-KVC-Resumed-Retried-From", strings.Join(r, ","))
	}
}

// retriedFrom is the decode workers of the continuation attempts that failed before their
// first token and were retried (all tried but the last), in order; nil when none.
func (b *resumeBase) retriedFrom() []string {
	if len(b.tried) < 2 {
		return nil
	}
	return slices.Clip(b.tried[:len(b.tried)-1])
}

// reasoned streams what the reasoning split gave: a reasoning_content delta, then a content
// delta, each only when not empty (the role goes with the first one sent).
func (s *sink) reasoned(r, n string) error {
	if r != "" {
		if s.onReason != nil {
			s.onReason()
			s.onReason = nil
		}
		if err := s.event(api.ReasoningChunk(s.id, s.req.Model, r, !s.sentRole)); err != nil {
			return err
		}
		s.sentRole = true
	}
	if n != "" {
		if err := s.event(api.Chunk(s.req.Kind, s.id, s.req.Model, n, !s.sentRole, "", nil, nil)); err != nil {
			return err
		}
		s.sentRole = true
	}
	return nil
}

func (s *sink) info(p *plan, res result) *api.RouteInfo {
	ri := &api.RouteInfo{Mode: modeName(p.mode), Reason: p.reason, DecisionID: p.decisionID, FailOpen: p.failOpen, Retries: s.retries, RetriedFrom: s.retriedFrom}
	if s.base != nil { // the resume's trailers (X-KVC-Resumed-*), for a client reading the body
		ri.ResumedFrom = s.base.from
		ri.ResumedDecodeWorker = p.decode.GetWorkerId()
		ri.ResumedAttempts = len(s.base.tried)
		ri.ResumedRetriedFrom = s.base.retriedFrom()
	}
	if len(res.meta) > 0 {
		var mi struct {
			KVC json.RawMessage `json:"kvc"`
		}
		if json.Unmarshal(res.meta, &mi) == nil {
			ri.Worker = mi.KVC
		}
	}
	return ri
}

func (s *sink) usage(res result) api.Usage {
	prompt := res.promptTok
	if prompt == 0 {
		prompt = s.req.InputTokens
	}
	return api.Usage{PromptTokens: prompt, CompletionTokens: res.outputTok, TotalTokens: prompt + res.outputTok}
}

func finishReason(res result, max int64) string {
	if res.outputTok >= max {
		return "length"
	}
	return "stop"
}

func (s *sink) finish(p *plan, res result) {
	if s.req.Stream {
		if !s.started { // no token at all (an empty answer)
			s.begin(p, s.req)
		}
		if s.reasoning != nil {
			r, n := s.reasoning.End() // what was held back: a tag that never came
			_ = s.reasoned(r, s.toolContent(n))
		}
		finish := s.endTools(finishReason(res, s.req.MaxTokens))
		if s.req.Kind != api.Generate {
			u := s.usage(res)
			_ = s.event(api.Chunk(s.req.Kind, s.id, s.req.Model, "", false, finish, &u, s.info(p, res)))
		}
		_ = s.event([]byte("[DONE]"))
		s.trailers(p)
		return
	}
	s.routeHeaders(p, s.req)
	s.w.Header().Set("Content-Type", "application/json")
	var body []byte
	if s.req.Kind == api.Generate {
		meta := res.meta
		if len(meta) == 0 {
			meta = json.RawMessage("{}")
		}
		body, _ = json.Marshal(map[string]any{"text": s.acc.String(), "meta_info": meta, "kvc_route": s.info(p, res)})
	} else if s.answer != nil {
		a, finish := s.answer(s.req, s.acc.String(), finishReason(res, s.req.MaxTokens))
		body = api.FullChat(s.id, s.req.Model, a, finish, s.usage(res), s.info(p, res))
	} else {
		body = api.Full(s.req.Kind, s.id, s.req.Model, s.acc.String(), finishReason(res, s.req.MaxTokens), s.usage(res), s.info(p, res))
	}
	s.w.WriteHeader(http.StatusOK)
	_, _ = s.w.Write(body)
}

func (s *sink) fail(p *plan, res result) {
	e := &api.Error{Status: res.status, Code: res.code, Message: res.message}
	if e.Status == 0 {
		e.Status, e.Code, e.Message = http.StatusBadGateway, "worker_error", res.detail
	}
	errKind := strings.TrimPrefix(res.kind.String(), "ROUTE_ERROR_KIND_")
	if res.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_UNSPECIFIED {
		errKind = "WORKER_ERROR"
	}
	if s.started {
		// Mid-stream: an error event, then the end of the stream.
		b, _ := json.Marshal(map[string]any{"error": map[string]string{"code": e.Code, "message": e.Message, "kind": errKind}})
		_ = s.event(b)
		_ = s.event([]byte("[DONE]"))
		s.trailers(p)
		return
	}
	if e.Status == 499 {
		return // the client is gone; nobody reads this
	}
	s.routeHeaders(p, s.req)
	s.w.Header().Set("X-KVC-Error-Kind", errKind)
	writeErr(s.w, e, nil)
}
