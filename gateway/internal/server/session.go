package server

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/routeclient"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// handleCloseSession is the client's session end (SGLang router's POST /close_session
// {"session_id"}; the id may also come in X-Session-ID). The control plane names the decode
// worker the session is resident on (RouteQuery.end_session); the gateway closes it there
// (POST /close_session), and the worker's sidecar reports the release. Without a control plane
// the gateway cannot know where the session lives: 503.
func (s *Server) handleCloseSession(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 64<<10))
	if err != nil {
		s.badRequest(w, api.BadRequest("reading body: %v", err))
		return
	}
	var body struct {
		SessionID string `json:"session_id"`
	}
	if len(strings.TrimSpace(string(raw))) > 0 {
		if err := json.Unmarshal(raw, &body); err != nil {
			s.badRequest(w, api.BadRequest("malformed JSON body: %v", err))
			return
		}
	}
	sid := strings.TrimSpace(r.Header.Get("X-Session-ID"))
	if sid == "" {
		sid = body.SessionID
	}
	if sid == "" {
		s.badRequest(w, &api.Error{Status: http.StatusBadRequest, Code: "missing_session_id", Message: "no session id: set session_id or the X-Session-ID header"})
		return
	}
	if err := kvcv1.ValidateID("session id", sid); err != nil {
		s.badRequest(w, api.BadRequest("%v", err))
		return
	}
	if s.router == nil {
		writeErr(w, &api.Error{Status: http.StatusServiceUnavailable, Code: "control_plane_unavailable",
			Message: "no control plane configured: the gateway does not know where the session lives"}, nil)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.opt.RequestTimeout)
	defer cancel()
	closed, e := s.endSession(ctx, sid, start)
	if e != nil {
		if e.Status == http.StatusBadRequest {
			s.badRequest(w, e)
		} else {
			writeErr(w, e, nil)
		}
		return
	}
	w.Header().Set("Content-Type", "application/json")
	b, _ := json.Marshal(map[string]any{"session_id": sid, "success": true, "closed_on": closed})
	_, _ = w.Write(b)
}

// endSession is the session-end path: the control plane's decision (RouteQuery.end_session)
// names the decode workers the session is resident on, the gateway closes it there (POST
// /close_session) and reports the outcome. It returns the workers it was closed on.
func (s *Server) endSession(ctx context.Context, sid string, start time.Time) ([]string, *api.Error) {
	d, err := s.router.Decide(ctx, &kvcv1.RouteQuery{SessionId: sid, EndSession: true})
	if err != nil {
		var rej *routeclient.RejectedError
		if errors.As(err, &rej) && rej.Code == codes.InvalidArgument {
			return nil, api.BadRequest("control plane refused the request: %s", rej.Message)
		}
		return nil, &api.Error{Status: http.StatusServiceUnavailable, Code: "control_plane_unavailable",
			Message: "no answer from the control plane: " + err.Error()}
	}
	p := &plan{mode: d.GetMode(), decisionID: d.GetDecisionId(), exec: d.GetExecution()}
	closed := []string{}
	res := result{ok: true}
	for _, ref := range d.GetExecution().GetCloseSessionOn() {
		if ref.GetWorkerUrl() == "" {
			continue
		}
		if we := s.sessionCall(ctx, ref.GetWorkerUrl(), "/close_session", closeBody(sid)); we != nil {
			res = result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, detail: "close_session: " + we.Error()}
			s.report(p, &api.Request{}, res, start)
			return nil, &api.Error{Status: http.StatusBadGateway, Code: "worker_unreachable", Message: we.Error()}
		}
		closed = append(closed, ref.GetWorkerId())
	}
	s.report(p, &api.Request{}, res, start)
	return closed, nil
}

// releaseAfter is the agent's release hint (X-KVC-Release, metadata kvc_release): once the
// request's answer is out, the session ends through the session-end path, in the background
// (the client does not wait for it). Nothing is released when the request failed (the agent
// may retry it) or without a control plane (it alone knows where the session lives).
func (s *Server) releaseAfter(req *api.Request, res result) {
	if !req.Hints.Release || req.SessionID == "" || s.router == nil {
		return
	}
	if !res.ok {
		s.m.HintReleases.WithLabelValues("skipped_failed").Inc()
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), s.opt.RequestTimeout)
		defer cancel()
		closed, e := s.endSession(ctx, req.SessionID, time.Now())
		if e != nil {
			s.m.HintReleases.WithLabelValues("error").Inc()
			s.log.Info().Str("session", req.SessionID).Str("err", e.Error()).Msg("release hint: session end failed")
			return
		}
		s.m.HintReleases.WithLabelValues("ok").Inc()
		s.log.Debug().Str("session", req.SessionID).Strs("closed_on", closed).Msg("release hint: session ended after its answer")
	}()
}

func (s *Server) badRequest(w http.ResponseWriter, e *api.Error) {
	s.m.BadRequests.WithLabelValues(e.Code).Inc()
	writeErr(w, e, nil)
}
