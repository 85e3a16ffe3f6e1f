package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
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

// Picker chooses fail-open workers (workers.Pool implements it).
type Picker interface {
	Pick() (pre, dec workers.Worker, ok bool)
}

// Options configure a Server.
type Options struct {
	RequestTimeout time.Duration
	ConnectTimeout time.Duration
	MaxBodyBytes   int64
	Parse          api.Options
}

// Server serves the client APIs.
type Server struct {
	router Router // nil: no control plane configured, always fail open
	pool   Picker
	opt    Options
	log    zerolog.Logger
	m      *Metrics
	hc     *http.Client
	seq    atomic.Uint64
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
	return &Server{router: router, pool: pool, opt: opt, log: log, m: m, hc: &http.Client{Transport: tr}}
}

// Close releases idle worker connections.
func (s *Server) Close() { s.hc.CloseIdleConnections() }

// Register adds the client routes to mux.
func (s *Server) Register(mux *http.ServeMux) {
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.handle(w, r, api.Chat) })
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.handle(w, r, api.Completion) })
	mux.HandleFunc("POST /generate", func(w http.ResponseWriter, r *http.Request) { s.handle(w, r, api.Generate) })
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
}

// plan is one decision to carry out.
type plan struct {
	mode       kvcv1.RouteMode
	reason     string
	decisionID string
	failOpen   bool
	prefill    *kvcv1.WorkerRef
	decode     *kvcv1.WorkerRef
	room       int64
	cached     int64
	snapSeqlen int64
	pause      time.Duration
	turn       int32
}

func modeName(m kvcv1.RouteMode) string { return strings.TrimPrefix(m.String(), "ROUTE_MODE_") }

func (p *plan) needsPrefill() bool {
	switch p.mode {
	case kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK:
		return true
	}
	return false
}

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

	raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.opt.MaxBodyBytes))
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

	out := newSink(w, req)
	var res result
	var p *plan
	for attempt := 0; ; attempt++ {
		var rerr *api.Error
		p, rerr = s.route(ctx, req)
		if rerr != nil {
			s.m.BadRequests.WithLabelValues(rerr.Code).Inc()
			writeErr(w, rerr, nil)
			return
		}
		out.retries = attempt
		res = s.execute(ctx, r.Context(), start, p, req, out)
		s.report(p, res, start) // before the retry's query: the control plane decides knowing it
		if attempt < maxRetries && retryable(res, out) && ctx.Err() == nil {
			why := "worker_unavailable"
			if res.code == "session_not_resident" {
				why = "session_not_resident"
			}
			s.m.Retries.WithLabelValues(why).Inc()
			s.log.Debug().Str("session", req.SessionID).Str("decision", p.decisionID).Str("why", why).
				Str("detail", res.detail).Msg("retrying through a new decision")
			continue
		}
		break
	}
	result := "ok"
	if !res.ok {
		result = strings.ToLower(strings.TrimPrefix(res.kind.String(), "ROUTE_ERROR_KIND_"))
		out.fail(p, res)
	} else {
		out.finish(p, res)
	}
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
	ev.Str("rid", req.RID).Str("session", req.SessionID).Str("mode", mode).Str("reason", p.reason).
		Str("decision", p.decisionID).Bool("ok", res.ok).Str("error_kind", res.kind.String()).
		Str("detail", res.detail).Dur("ttft", res.ttft).Dur("latency", time.Since(start)).Msg("request")
}

// maxRetries bounds the new decisions one request may take after a retryable failure.
const maxRetries = 1

// retryable: the attempt failed in a way a new decision may fix (res.retry) and retrying is
// safe — nothing was written to the client and D sent no token (so a non-streaming client's
// buffered text is empty too).
func retryable(res result, out *sink) bool {
	return !res.ok && res.retry && !out.started && res.ttft == 0 && out.chunks == 0
}

// route gets a decision, or a fail-open plan when the control plane cannot give one in time.
func (s *Server) route(ctx context.Context, req *api.Request) (*plan, *api.Error) {
	failReason := "control_plane_unavailable"
	if req.SessionID == "" {
		failReason = "no_session"
	} else if s.router != nil {
		t0 := time.Now()
		d, err := s.router.Decide(ctx, &kvcv1.RouteQuery{
			SessionId: req.SessionID, Turn: req.Turn, InputTokens: req.InputTokens,
			MaxOutputTokens: req.MaxTokens, MultiturnHint: req.Multiturn,
		})
		s.m.RouteLatency.Observe(time.Since(t0).Seconds())
		if err == nil {
			return &plan{
				mode: d.GetMode(), reason: strings.TrimPrefix(d.GetReason().String(), "ROUTE_REASON_"), decisionID: d.GetDecisionId(),
				prefill: d.GetPrefill(), decode: d.GetDecode(), room: d.GetBootstrapRoom(), cached: d.GetCachedTokens(),
				snapSeqlen: d.GetSnapshotSeqlen(), pause: time.Duration(d.GetRecommendedPauseMs()) * time.Millisecond, turn: d.GetTurn(),
			}, nil
		}
		var rej *routeclient.RejectedError
		if errors.As(err, &rej) && rej.Code == codes.InvalidArgument {
			return nil, api.BadRequest("control plane refused the request: %s", rej.Message)
		}
		if ctx.Err() != nil {
			return nil, &api.Error{Status: http.StatusGatewayTimeout, Code: "timeout", Message: "request ended while waiting for a routing decision"}
		}
		s.log.Debug().Err(err).Str("session", req.SessionID).Msg("fail-open")
	}
	pre, dec, ok := s.pool.Pick()
	if !ok {
		return nil, &api.Error{Status: http.StatusServiceUnavailable, Code: "no_workers", Message: "no routing decision and no fail-open workers known"}
	}
	s.m.FailOpen.WithLabelValues(failReason).Inc()
	reason := "CONTROL_PLANE_UNAVAILABLE"
	if failReason == "no_session" {
		reason = "SINGLE_SHOT"
	}
	return &plan{
		mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: reason, failOpen: true,
		prefill: pre.Ref(), decode: dec.Ref(), room: int64(rand.Uint64() >> 1),
	}, nil
}

func (s *Server) report(p *plan, res result, start time.Time) {
	if p.decisionID == "" || s.router == nil {
		return
	}
	o := &kvcv1.RouteOutcome{
		DecisionId: p.decisionID, Success: res.ok, ErrorKind: res.kind,
		TtftUs: res.ttft.Microseconds(), LatencyUs: time.Since(start).Microseconds(),
		KvLenAfter: res.kvLenAfter, Detail: res.detail, ExecutedMode: p.mode,
	}
	if res.ok {
		o.ErrorKind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE
	}
	if err := s.router.Report(o); err != nil {
		s.m.Outcomes.WithLabelValues("lost").Inc()
		s.log.Debug().Err(err).Str("decision", p.decisionID).Msg("outcome not sent")
		return
	}
	s.m.Outcomes.WithLabelValues("sent").Inc()
}
