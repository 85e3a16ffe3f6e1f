package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/routeclient"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Router is the part of the Route stream the server uses (routeclient.Client implements it).
type Router interface {
	Decide(ctx context.Context, q *kvcv1.RouteQuery) (*kvcv1.RouteDecision, error)
	Report(o *kvcv1.RouteOutcome) error
}

// Picker chooses fail-open decode workers round robin, skipping the given worker URLs
// (workers.Pool implements it; the fail-open plan needs no prefill worker).
type Picker interface {
	PickDecode(skipURLs ...string) (dec workers.Worker, ok bool)
}

// Options configure a Server.
type Options struct {
	RequestTimeout time.Duration
	ConnectTimeout time.Duration
	MaxBodyBytes   int64
	Parse          api.Options
	// SessionTimeout is the idle timeout of the streaming sessions the gateway opens on decode
	// workers (SGLang's open_session timeout); 0: DefaultSessionTimeout.
	SessionTimeout time.Duration
	Admission      *Admission // nil: no admission limits (admission.go)
	// Content: tokenizer and page hashes (content.go); nil: lengths alone.
	Content *Content
	// ResumeMidStream: a request whose decode worker dies after its first token continues
	// through a new decision from the tokens generated so far (resume.go); false: it fails.
	ResumeMidStream bool
}

// DefaultSessionTimeout matches the control plane's default session_ttl_ms.
const DefaultSessionTimeout = 24 * time.Hour

// Server serves the client APIs.
type Server struct {
	router Router // nil: no control plane configured, always fail open
	pool   Picker
	opt    Options
	log    zerolog.Logger
	m      *Metrics
	hc     *http.Client
	seq    atomic.Uint64
	bg     sync.WaitGroup // background close_session calls
}

// New builds a server. router may be nil.
func New(router Router, pool Picker, opt Options, log zerolog.Logger, m *Metrics) *Server {
	tr := &http.Transport{
		DialContext:         (&net.Dialer{Timeout: opt.ConnectTimeout, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        512,
		MaxIdleConnsPerHost: 128,
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
	}
	return &Server{router: router, pool: pool, opt: opt, log: log, m: m, hc: &http.Client{Transport: workerTransport(tr)}} // trace.go
}

// Close waits for background session calls (each bounded by the connect timeout) and releases
// idle worker connections.
func (s *Server) Close() {
	s.bg.Wait()
	s.hc.CloseIdleConnections()
}

// Register adds the client routes to mux. Every client route goes through middleware.
func (s *Server) Register(mux *http.ServeMux) {
	client := func(kind api.Kind) http.Handler {
		return s.middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.handle(w, r, kind) }))
	}
	mux.Handle("POST /v1/chat/completions", client(api.Chat))
	mux.Handle("POST /v1/completions", client(api.Completion))
	mux.Handle("POST /generate", client(api.Generate))
	mux.Handle("POST /close_session", s.middleware(http.HandlerFunc(s.handleCloseSession)))
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
}

// middleware wraps every client route before the request is read (admission limits go here,
// outermost last).
func (s *Server) middleware(h http.Handler) http.Handler {
	return traced(s.opt.Admission.Wrap(h)) // trace.go: a span per client request
}

// plan is one decision to carry out: the control plane's, or the gateway's own fail-open one.
type plan struct {
	mode       kvcv1.RouteMode
	reason     string // for headers and logs
	decisionID string
	failOpen   bool
	prefill    *kvcv1.WorkerRef
	decode     *kvcv1.WorkerRef
	room       int64
	cached     int64
	snapSeqlen int64
	pause      time.Duration
	// priority is the decision's prefill_priority (lower is more important): P's request
	// carries it as SGLang's priority (sglangPriority).
	priority int32
	// exec is what to do; the gateway applies no routing rule of its own.
	exec *kvcv1.RouteExecution
	// routeDur is how long the decision took (the Route query to its answer) and openDur the
	// open_session calls on D: the gateway's part of a turn before D's request, on the debug
	// "request" line (issue 20's recovery accounting).
	routeDur, openDur time.Duration
}

// modeName is a mode's name for headers, logs and metric labels.
func modeName(m kvcv1.RouteMode) string { return strings.TrimPrefix(m.String(), "ROUTE_MODE_") }

// failOpenExec is the gateway's own plan without a usable decision: a decode worker prefills
// the whole request itself (local_prefill; decode workers are colocated servers able to
// prefill) and keeps nothing. It needs no sidecar and no prefill worker: it serves while every
// sidecar restarts, and whatever the control plane knows or does not know (issue 16 finding 2).
var failOpenExec = &kvcv1.RouteExecution{
	CallDecode: true, LocalPrefill: true,
	OnDecodeRefused:  kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D,
	OnTransferFailed: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED,
	RetryAllowed:     true,
}

// CodeNoDCapacity (503, Retry-After 1): the control plane refused a new session
// (RESOURCE_EXHAUSTED NO_D_CAPACITY): every decode worker's reservations of new sessions are at
// its --new-session-share and none has free room for it. Not failed open: any worker would
// evict resident sessions for it.
const CodeNoDCapacity = "no_d_capacity"

// Fail-open reasons (kvc_gateway_failopen_total{reason}; upper-cased in X-KVC-Reason).
const (
	foUnavailable = "control_plane_unavailable" // no stream, no answer in time, or no control plane configured
	foNoSession   = "no_session"                // single-shot request (--require-session=false)
	foRouteError  = "route_error"               // the control plane answered an error other than INVALID_ARGUMENT or RESOURCE_EXHAUSTED
	foNoDecode    = "no_decode_worker"          // the decision names no usable decode worker
	foNoPrefill   = "no_prefill_worker"         // the decision needs a prefill worker and names none
	foNoExecution = "no_execution"              // the decision carries no execution plan (an older control plane)
)

func writeErr(w http.ResponseWriter, e *api.Error, extra http.Header) {
	for k, v := range extra {
		w.Header()[k] = v
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.Status)
	_, _ = w.Write(e.Body())
}

func (s *Server) handle(w http.ResponseWriter, r *http.Request, kind api.Kind) {
	defer func() {
		if p := recover(); p != nil {
			s.log.Error().Interface("panic", p).Msg("handler panic")
			writeErr(w, &api.Error{Status: http.StatusInternalServerError, Code: "internal", Message: "internal error"}, nil)
		}
	}()
	start := time.Now()
	s.m.Inflight.Inc()
	defer s.m.Inflight.Dec()

	raw, err := readBody(http.MaxBytesReader(w, r.Body, s.opt.MaxBodyBytes), r.ContentLength, s.opt.MaxBodyBytes)
	defer func() { memReturn.after(int64(len(raw))) }() // memory.go: a large body's memory back to the OS
	if err != nil {
		var mbe *http.MaxBytesError
		e := api.BadRequest("reading body: %v", err)
		if errors.As(err, &mbe) {
			e = &api.Error{Status: http.StatusRequestEntityTooLarge, Code: "body_too_large", Message: fmt.Sprintf("body larger than %d bytes", mbe.Limit)}
		}
		s.m.BadRequests.WithLabelValues(e.Code).Inc()
		writeErr(w, e, nil)
		return
	}
	req, perr := api.Parse(kind, r.Header, raw, s.opt.Parse)
	if perr != nil {
		s.m.BadRequests.WithLabelValues(perr.Code).Inc()
		writeErr(w, perr, nil)
		return
	}
	if req.RID == "" {
		req.RID = "gw-" + strconv.FormatUint(s.seq.Add(1), 10) + "-" + strconv.FormatUint(rand.Uint64()>>40, 36)
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.opt.RequestTimeout)
	defer cancel()
	release, perr := s.prepare(ctx, req)
	defer release()
	if perr == nil { // the tokens the request makes the cluster hold, from its client's bound
		var crel func(bool)
		crel, perr = s.opt.Admission.HoldClientTokens(r.Context(), req)
		defer func() { crel(r.Context().Err() != nil) }() // the client went away: an aborted request
		if perr != nil && perr.Status == http.StatusTooManyRequests {
			w.Header().Set("Retry-After", s.opt.Admission.retryAfter)
		}
	}
	if perr != nil {
		s.m.BadRequests.WithLabelValues(perr.Code).Inc()
		if perr.Status == http.StatusServiceUnavailable && s.opt.Content != nil {
			w.Header().Set("Retry-After", s.tokGate().retryAfter)
		}
		writeErr(w, perr, nil)
		return
	}

	out := newSink(w, req)
	if s.parsesAnswers(req) {
		out.answer = s.answer
	}
	s.streamsReasoning(req, out)
	var res result
	var p *plan
	var gone []*kvcv1.WorkerRef // workers that refused or dropped an attempt: the retry avoids them
	cur := req                  // the request as this attempt runs it (a resume's continuation extends it)
	var first *result           // the interrupted attempt, once resumed
	attemptStart := start
	for retries, resumes, resumeRetries := 0, 0, 0; ; {
		tr := time.Now()
		np, rerr := s.route(ctx, cur, gone)
		if rerr != nil {
			if p != nil {
				// The retry or the continuation found nothing to run: the failed attempt's error stands.
				if first != nil {
					s.resumeDone(req, first, nil, resumeFailed, "no decision: "+rerr.Message)
				}
				break
			}
			s.m.BadRequests.WithLabelValues(rerr.Code).Inc()
			var extra http.Header
			if rerr.Code == CodeNoDCapacity {
				extra = http.Header{"Retry-After": {"1"}}
			}
			writeErr(w, rerr, extra)
			return
		}
		p = np
		p.routeDur = time.Since(tr)
		out.retries = retries
		if first != nil {
			out.base.tried = append(out.base.tried, workerName(p.decode))
		}
		res = s.execute(ctx, r.Context(), attemptStart, p, cur, out)
		s.report(p, cur, res, attemptStart) // before the retry's query: the control plane decides knowing it
		if first != nil {
			if !res.ok && resumeRetries < maxResumeRetries && resumeRetryable(res, out, p) && ctx.Err() == nil {
				// The continuation failed before its first token (its worker is gone too, or
				// refused it): nothing of it reached the client, so a new decision, avoiding
				// every worker found gone, tries again from the same join.
				resumeRetries++
				gone = avoid(gone, res, p)
				s.m.Resumes.WithLabelValues(resumeRetried).Inc()
				s.log.Info().Str("rid", req.RID).Str("session", req.SessionID).Str("decision", p.decisionID).
					Str("decode_worker", workerName(p.decode)).Int("attempt", len(out.base.tried)).Str("detail", res.detail).
					Msg("mid-stream resume: the continuation failed before its first token, retrying through a new decision")
				res.ttft = first.ttft // should no decision come, the client's first token was the first attempt's
				continue
			}
			// The continuation ended: the answer's end either way (maxResumes).
			if res.ok {
				s.resumeDone(req, first, p, resumeOK, "")
				res = out.base.merged(*first, res)
			} else {
				s.resumeDone(req, first, p, resumeFailed, res.detail)
				res.ttft = first.ttft // the client's first token came from the first attempt
			}
			break
		}
		if retries < maxRetries && retryable(res, out, p) && ctx.Err() == nil {
			retries++
			why := "worker_unavailable"
			switch {
			case res.code == codeNotResident:
				why = "session_not_resident"
			case res.transfer:
				why = "transfer_failed"
			}
			gone = avoid(gone, res, p)
			if w := workerName(p.decode); w != "" {
				out.retriedFrom = append(out.retriedFrom, w)
			}
			s.m.Retries.WithLabelValues(why).Inc()
			s.log.Debug().Str("session", req.SessionID).Str("decision", p.decisionID).Str("why", why).
				Str("detail", res.detail).Msg("retrying through a new decision")
			continue
		}
		if resumes < maxResumes && midStreamGone(res, out) && ctx.Err() == nil {
			c, why := s.resumable(ctx, cur, res, out, p)
			if c == nil {
				s.m.Resumes.WithLabelValues(why).Inc()
				s.log.Info().Str("rid", req.RID).Str("session", req.SessionID).Str("decision", p.decisionID).
					Str("why", why).Int("streamed_tokens", len(res.outputIDs)).Msg("decode worker gone mid-stream: not resumed")
				break
			}
			resumes++
			from := workerName(p.decode)
			prompt := res.promptTok
			if prompt == 0 {
				prompt = req.InputTokens
			}
			gone = append(gone, res.gone)
			out.resume(&resumeBase{prompt: prompt, ids: slices.Clip(res.outputIDs), from: from})
			f := res
			first = &f
			cur = c
			attemptStart = time.Now()
			s.log.Info().Str("rid", req.RID).Str("session", req.SessionID).Str("decision", p.decisionID).Str("from", from).
				Int("streamed_tokens", len(res.outputIDs)).Int64("tokens_left", c.MaxTokens).Str("detail", res.detail).
				Msg("decode worker gone mid-stream: resuming through a new decision")
			continue
		}
		break
	}
	if res.ok {
		s.closeSessions(p, req)
	} else if res.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED && p.exec.GetOpenSession() {
		s.closeAbandoned(p, req)
	}
	result := "ok"
	if !res.ok {
		result = strings.ToLower(strings.TrimPrefix(res.kind.String(), "ROUTE_ERROR_KIND_"))
		out.fail(p, res)
	} else {
		out.finish(p, res)
	}
	s.releaseAfter(req, res)
	mode := modeName(p.mode)
	s.m.Requests.WithLabelValues(kind.String(), mode, result).Inc()
	if res.ttft > 0 {
		s.m.TTFT.WithLabelValues(mode).Observe(res.ttft.Seconds())
	}
	s.m.Latency.WithLabelValues(mode).Observe(time.Since(start).Seconds())
	ev := s.log.Debug()
	if !res.ok {
		ev = s.log.Info()
	}
	if out.base != nil {
		ev = ev.Str("resumed_from", out.base.from)
	}
	ev.Str("rid", req.RID).Str("session", req.SessionID).Str("mode", mode).Str("reason", p.reason).
		Str("decision", p.decisionID).Bool("ok", res.ok).Str("error_kind", res.kind.String()).
		Str("detail", res.detail).Dur("route", p.routeDur).Dur("open_session", p.openDur).Dur("ttft", res.ttft).
		Dur("latency", time.Since(start)).Msg("request")
}

// readBody reads a request body into one buffer of its declared length (io.ReadAll grows its
// buffer by doubling: about twice the body in garbage, per request, under a flood of large
// bodies — issue 16 finding 6). An undeclared or wrong length still reads correctly.
func readBody(r io.Reader, declared, limit int64) ([]byte, error) {
	if declared < 0 || declared > limit {
		return io.ReadAll(r)
	}
	buf := bytes.NewBuffer(make([]byte, 0, declared+bytes.MinRead)) // room for the EOF read
	_, err := buf.ReadFrom(r)
	return buf.Bytes(), err
}

// avoid adds to gone what attempt res (of plan p) found gone: the worker that refused or dropped
// the connection, and both ends of a failed transfer (without a prefill worker the new decision
// prefills on a decode worker: no transfer).
func avoid(gone []*kvcv1.WorkerRef, res result, p *plan) []*kvcv1.WorkerRef {
	if res.gone != nil {
		gone = append(gone, res.gone)
	}
	if res.transfer {
		for _, w := range []*kvcv1.WorkerRef{p.prefill, p.decode} {
			if w.GetWorkerId() != "" || w.GetWorkerUrl() != "" {
				gone = append(gone, w)
			}
		}
	}
	return gone
}

// workerName is how the headers name a worker: its id, else its URL.
func workerName(w *kvcv1.WorkerRef) string {
	if id := w.GetWorkerId(); id != "" {
		return id
	}
	return w.GetWorkerUrl()
}

// maxRetries bounds the new decisions one request may take after a retryable failure.
const maxRetries = 1

// retryable: the attempt failed in a way a new decision may fix (res.retry) and retrying is
// safe — nothing was written to the client and D sent no token (so a non-streaming client's
// buffered text is empty too).
func retryable(res result, out *sink, p *plan) bool {
	return !res.ok && res.retry && p.exec.GetRetryAllowed() && !out.started && res.ttft == 0 && out.chunks == 0
}

// resumable is the continuation of cur after its mid-stream failure res, or nil and why not
// (resume.go).
func (s *Server) resumable(ctx context.Context, cur *api.Request, res result, out *sink, p *plan) (*api.Request, string) {
	if !s.opt.ResumeMidStream {
		return nil, resumeDisabled
	}
	if !p.exec.GetRetryAllowed() {
		return nil, resumeNotAllowed
	}
	c, why := resumeRequest(cur, res, out.segChunks)
	if c == nil {
		return nil, why
	}
	s.withContent(ctx, cur, c)
	return c, ""
}

// resumeDone counts and logs how a continuation (its plan p; nil when no decision came) ended.
func (s *Server) resumeDone(req *api.Request, first *result, p *plan, result, detail string) {
	s.m.Resumes.WithLabelValues(result).Inc()
	ev := s.log.Info().Str("rid", req.RID).Str("session", req.SessionID).Str("result", result).
		Int("tokens_before", len(first.outputIDs))
	if p != nil {
		ev = ev.Str("mode", modeName(p.mode)).Str("reason", p.reason).Str("decision", p.decisionID).Str("decode_worker", p.decode.GetWorkerId())
	}
	ev.Str("detail", detail).Msg("mid-stream resume ended")
}

// route gets a decision, or a fail-open plan on every path where the control plane cannot give
// a usable one: no control plane, no answer in time, an error other than INVALID_ARGUMENT (a
// 400) or RESOURCE_EXHAUSTED (a 503 no_d_capacity), or a decision without a decode (or needed
// prefill) worker. gone lists the workers a failed attempt
// found dead: the query excludes them and fail-open round robin skips them.
func (s *Server) route(ctx context.Context, req *api.Request, gone []*kvcv1.WorkerRef) (*plan, *api.Error) {
	why := foUnavailable
	if req.SessionID == "" {
		why = foNoSession
	} else if s.router != nil {
		t0 := time.Now()
		q := &kvcv1.RouteQuery{
			SessionId: req.SessionID, Turn: req.Turn, InputTokens: req.InputTokens,
			MaxOutputTokens: req.MaxTokens, MultiturnHint: req.Multiturn,
			PinMs: req.Hints.PinMs, LowPriority: req.Hints.LowPriority,
			Traceparent: traceparent(ctx), // the decision's span is a child of the request's (trace.go)
		}
		if req.PageSize > 0 {
			q.PageSize, q.PromptPages = int32(req.PageSize), req.PromptPages
			s.m.ContentQueries.WithLabelValues("hashes").Inc()
		} else {
			s.m.ContentQueries.WithLabelValues("lengths").Inc()
		}
		for _, g := range gone {
			if id := g.GetWorkerId(); id != "" && !slices.Contains(q.ExcludeWorkers, id) {
				q.ExcludeWorkers = append(q.ExcludeWorkers, id)
			}
		}
		d, err := s.router.Decide(ctx, q)
		s.m.RouteLatency.Observe(time.Since(t0).Seconds())
		if err == nil {
			p := &plan{
				mode: d.GetMode(), reason: strings.TrimPrefix(d.GetReason().String(), "ROUTE_REASON_"), decisionID: d.GetDecisionId(),
				prefill: d.GetPrefill(), decode: d.GetDecode(), room: d.GetBootstrapRoom(), cached: d.GetCachedTokens(),
				snapSeqlen: d.GetSnapshotSeqlen(), pause: time.Duration(d.GetRecommendedPauseMs()) * time.Millisecond,
				priority: d.GetPrefillPriority(), exec: d.GetExecution(),
			}
			if why = unusable(p); why == "" {
				return p, nil
			}
			// The decision cannot run: release its reservation now, then serve it ourselves.
			s.report(p, req, result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, detail: "gateway failed open: " + why}, time.Now())
		} else {
			var rej *routeclient.RejectedError
			if errors.As(err, &rej) && rej.Code == codes.InvalidArgument {
				return nil, api.BadRequest("control plane refused the request: %s", rej.Message)
			}
			if errors.As(err, &rej) && rej.Code == codes.ResourceExhausted {
				// A deliberate refusal (a new session past every decode worker's new-session
				// bound): failing open would evict the resident sessions the bound protects.
				return nil, &api.Error{Status: http.StatusServiceUnavailable, Code: CodeNoDCapacity,
					Message: "control plane refused the request: " + rej.Message}
			}
			if ctx.Err() != nil {
				return nil, &api.Error{Status: http.StatusGatewayTimeout, Code: "timeout", Message: "request ended while waiting for a routing decision"}
			}
			if errors.As(err, &rej) {
				why = foRouteError
			}
		}
		s.log.Debug().Err(err).Str("session", req.SessionID).Str("why", why).Msg("fail-open")
	}
	skip := make([]string, 0, len(gone))
	for _, g := range gone {
		skip = append(skip, g.GetWorkerUrl())
	}
	dec, ok := s.pool.PickDecode(skip...)
	if !ok {
		return nil, &api.Error{Status: http.StatusServiceUnavailable, Code: "no_workers", Message: "no routing decision and no fail-open decode worker known"}
	}
	s.m.FailOpen.WithLabelValues(why).Inc()
	reason := strings.ToUpper(why)
	if why == foNoSession {
		reason = "SINGLE_SHOT"
	}
	return &plan{
		mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: reason, failOpen: true,
		decode: dec.Ref(), exec: failOpenExec,
	}, nil
}

// unusable says why a decision cannot be carried out as it is ("" when it can).
func unusable(p *plan) string {
	switch {
	case p.exec == nil:
		return foNoExecution
	case !p.exec.GetCallDecode() || p.decode.GetWorkerUrl() == "":
		return foNoDecode
	case p.exec.GetCallPrefill() && p.prefill.GetWorkerUrl() == "":
		return foNoPrefill
	}
	return ""
}

func (s *Server) report(p *plan, req *api.Request, res result, start time.Time) {
	if p.decisionID == "" || s.router == nil {
		return
	}
	o := &kvcv1.RouteOutcome{
		DecisionId: p.decisionID, Success: res.ok, ErrorKind: res.kind,
		TtftUs: res.ttft.Microseconds(), LatencyUs: time.Since(start).Microseconds(),
		KvLenAfter: res.kvLenAfter, Detail: res.detail, ExecutedMode: p.mode,
		TruncatedTo: res.truncatedTo,
	}
	if res.ok {
		o.ErrorKind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE
		if p.keepSession(req) {
			// What the gateway saw: the worker's own kv_len_after (meta_info.kvc) when it
			// reports one — never a length made up from the usage counts (the decode sidecar's
			// commit is the control plane's kv_committed_len) — and the chain of the prompt and
			// the generated ids it streamed, up to kv_len_after when known.
			o.KvPages = s.outcomePages(req, res.outputIDs, o.KvLenAfter)
		}
	}
	if err := s.router.Report(o); err != nil {
		s.m.Outcomes.WithLabelValues("lost").Inc()
		s.log.Debug().Err(err).Str("decision", p.decisionID).Msg("outcome not sent")
		return
	}
	s.m.Outcomes.WithLabelValues("sent").Inc()
}
