package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// result is how one attempt ended.
type result struct {
	ok     bool
	kind   kvcv1.RouteErrorKind
	detail string
	// client-facing error
	status  int
	code    string
	message string

	ttft       time.Duration
	kvLenAfter int64
	// retry: a new decision may serve the request, provided nothing went to the client and no
	// token came from D (see retryable).
	retry     bool
	meta      json.RawMessage // the decode worker's last meta_info
	promptTok int64
	outputTok int64
}

func failure(kind kvcv1.RouteErrorKind, status int, code, msg string) result {
	return result{kind: kind, status: status, code: code, message: msg, detail: code + ": " + msg}
}

// workerError is a non-2xx answer (or a transport failure) of one worker.
type workerError struct {
	role    string
	status  int // 0 for transport failures
	code    string
	message string
	err     error
}

func (e *workerError) Error() string {
	if e.status == 0 {
		return fmt.Sprintf("%s worker: %v", e.role, e.err)
	}
	return fmt.Sprintf("%s worker answered %d %s: %s", e.role, e.status, e.code, e.message)
}

// codeNoCapacity is a live worker's 503: it is full, not gone (the control plane's rejection
// counters handle it; retrying at once would only add load).
const codeNoCapacity = "no_capacity"

// classify maps a worker failure to an outcome error kind and a client-facing error. A worker
// that is gone — the connection refused, reset or closed (while the request is still alive), or
// a 503 other than no_capacity — is marked retryable, as is D's 409 session_not_resident.
func classify(we *workerError, mode kvcv1.RouteMode, ctx, clientCtx context.Context) result {
	if we.status == 0 {
		switch {
		case clientCtx.Err() != nil:
			return failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, 499, "client_closed", "client went away")
		case errors.Is(ctx.Err(), context.DeadlineExceeded):
			return failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT, http.StatusGatewayTimeout, "timeout", "request timed out")
		}
		r := failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, http.StatusBadGateway, "worker_unreachable", we.Error())
		r.retry = ctx.Err() == nil
		return r
	}
	code := we.code
	if code == "" {
		code = "worker_error"
	}
	r := failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, we.status, code, we.role+" worker: "+we.message)
	switch {
	case we.status == http.StatusConflict && we.role == "decode" && code == "session_not_resident":
		// D evicted the session before the control plane heard: it drops the residency at
		// once, so the retry's new decision reseeds instead of coming back here.
		r.kind, r.retry = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT, true
	case we.status == http.StatusConflict && we.role == "decode":
		r.kind, r.retry = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, true
	case we.status == http.StatusServiceUnavailable && we.role == "decode":
		r.kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D
		r.retry = code != codeNoCapacity
	case we.status == http.StatusServiceUnavailable:
		r.retry = code != codeNoCapacity
	case we.status == http.StatusBadGateway || code == "transfer_failed" || code == "kv_verify_failed":
		r.kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED
		if mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
			r.kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED
		}
	case we.status == http.StatusGatewayTimeout:
		r.kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT
	}
	return r
}

// keepSession: the decode worker keeps the session resident afterwards. Every session mode
// but PD_FALLBACK; and a PD_FALLBACK for a REAL_LARGE_APPEND, which the control plane sends to
// the session's own decode worker: it adopts the received KV as the session's, so the next
// turn goes direct-to-D against the new length (docs/routing.md §1).
func (p *plan) keepSession(req *api.Request) bool {
	if req.SessionID == "" || p.failOpen {
		return false
	}
	return p.mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || p.reason == reasonLargeAppend
}

// reasonLargeAppend is plan.reason of a REAL_LARGE_APPEND decision.
var reasonLargeAppend = strings.TrimPrefix(kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND.String(), "ROUTE_REASON_")

// workerBody is the SGLang /generate body for one half of the request (role prefill or decode).
func workerBody(p *plan, req *api.Request, role string) []byte {
	b := map[string]any{
		"rid":             req.RID,
		"sampling_params": map[string]any{"max_new_tokens": req.MaxTokens},
		"stream":          role == "decode",
	}
	if req.Text != "" {
		b["text"] = req.Text
	}
	if len(req.InputIDs) > 0 {
		b["input_ids"] = req.InputIDs
	}
	if req.SessionID != "" {
		b["session_params"] = map[string]any{"id": req.SessionID}
	}
	kvc := map[string]any{
		"mode": modeName(p.mode), "role": role, "input_tokens": req.InputTokens,
		"cached_tokens": p.cached, "keep_session": p.keepSession(req),
	}
	if p.decisionID != "" {
		kvc["decision_id"] = p.decisionID
	}
	if req.SessionID != "" {
		kvc["session_id"] = req.SessionID
	}
	peer := p.prefill.GetPeerAddr()
	if p.needsPrefill() || p.mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
		kvc["room"] = p.room
		if peer != "" {
			kvc["prefill_peer_addr"] = peer
		}
	}
	if p.needsPrefill() {
		b["bootstrap_room"] = p.room
		if host, port, err := net.SplitHostPort(peer); err == nil {
			if n, err := strconv.Atoi(port); err == nil {
				b["bootstrap_host"], b["bootstrap_port"] = host, n
			}
		}
	}
	if p.mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
		kvc["snapshot_seqlen"] = p.snapSeqlen
	}
	b["kvc"] = kvc
	out, _ := json.Marshal(b)
	return out
}

func (s *Server) post(ctx context.Context, url string, body []byte, role string) (*http.Response, *workerError) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/generate", bytes.NewReader(body))
	if err != nil {
		return nil, &workerError{role: role, err: err}
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := s.hc.Do(hr)
	if err != nil {
		return nil, &workerError{role: role, err: err}
	}
	if resp.StatusCode/100 != 2 {
		defer resp.Body.Close()
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		we := &workerError{role: role, status: resp.StatusCode, message: http.StatusText(resp.StatusCode)}
		var e struct {
			Error struct {
				Code    string `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(raw, &e) == nil && e.Error.Code != "" {
			we.code, we.message = e.Error.Code, e.Error.Message
		}
		return nil, we
	}
	return resp, nil
}

// execute carries out p: P and D together for SEED, RESEED_PREFILL and PD_FALLBACK (bootstrap
// host/port/room in both bodies), D only for DIRECT_TO_D and RESEED_SNAPSHOT.
func (s *Server) execute(ctx, clientCtx context.Context, start time.Time, p *plan, req *api.Request, out *sink) result {
	if p.decode.GetWorkerUrl() == "" {
		return failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, http.StatusBadGateway, "no_decode_worker", "decision names no decode worker URL")
	}
	if p.needsPrefill() && p.prefill.GetWorkerUrl() == "" {
		return failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, http.StatusBadGateway, "no_prefill_worker", "decision names no prefill worker URL")
	}
	if p.pause > 0 {
		t := time.NewTimer(p.pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return classify(&workerError{role: "decode", err: ctx.Err()}, p.mode, ctx, clientCtx)
		}
	}
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	// pch carries the prefill call's failure, only when it failed on its own (not because D's
	// failure cancelled it).
	var pch chan *workerError
	if p.needsPrefill() {
		pch = make(chan *workerError, 1)
		body := workerBody(p, req, "prefill")
		go func() {
			resp, we := s.post(dctx, p.prefill.GetWorkerUrl(), body, "prefill")
			if we == nil {
				_, err := io.Copy(io.Discard, io.LimitReader(resp.Body, 16<<20))
				resp.Body.Close()
				if err != nil && dctx.Err() == nil {
					we = &workerError{role: "prefill", err: err}
				}
			}
			if we != nil && dctx.Err() == nil {
				dcancel() // D waits for a transfer that will not come
				pch <- we
				return
			}
			pch <- nil
		}()
	}
	res := s.decode(dctx, start, p, req, out)
	if pch != nil {
		var pe *workerError
		if res.ok {
			select {
			case pe = <-pch:
			case <-ctx.Done():
			}
		} else {
			dcancel()
			pe = <-pch
		}
		if !res.ok && pe != nil && res.kind != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D {
			// The prefill side failed first (or explains D's failure): report that.
			r := classify(pe, p.mode, ctx, clientCtx)
			if r.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR && pe.status == http.StatusBadGateway {
				r.kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED
			}
			r.ttft = res.ttft
			return r
		}
	}
	if !res.ok && res.status == 0 {
		// Transport failure on D: decide with the right contexts.
		r := classify(&workerError{role: "decode", err: errors.New(res.detail)}, p.mode, ctx, clientCtx)
		r.ttft = res.ttft
		res = r
	}
	if !res.ok && res.retry && res.ttft == 0 && res.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR {
		// D refused or dropped the connection before its first token: it did not take the
		// request. Reported as REJECTED_BY_D so that the control plane counts it against this
		// (session, D) like any rejection and migrates the session past the threshold; the
		// detail keeps what happened (worker_unreachable / worker_stream_ended).
		res.kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D
	}
	return res
}

type chunk struct {
	Text     string          `json:"text"`
	MetaInfo json.RawMessage `json:"meta_info"`
	Error    *struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

type metaInfo struct {
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	KVC              struct {
		KVLenAfter int64 `json:"kv_len_after"`
	} `json:"kvc"`
}

// decode calls D (always streaming, so TTFT is measured at the gateway) and relays its chunks.
func (s *Server) decode(ctx context.Context, start time.Time, p *plan, req *api.Request, out *sink) result {
	resp, we := s.post(ctx, p.decode.GetWorkerUrl(), workerBody(p, req, "decode"), "decode")
	if we != nil {
		if we.status == 0 {
			// execute classifies it (with the role) once it knows whether P failed first.
			return result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, detail: we.err.Error()}
		}
		return classify(we, p.mode, ctx, ctx)
	}
	defer resp.Body.Close()
	var res result
	handle := func(payload []byte) bool {
		var c chunk
		if err := json.Unmarshal(payload, &c); err != nil {
			res = failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, http.StatusBadGateway, "bad_worker_stream", "decode worker sent an unreadable chunk")
			return false
		}
		if c.Error != nil {
			st := http.StatusBadGateway
			if c.Error.Code == "kv_verify_failed" || c.Error.Code == "internal" {
				st = http.StatusInternalServerError
			}
			res = classify(&workerError{role: "decode", status: st, code: c.Error.Code, message: c.Error.Message}, p.mode, ctx, ctx)
			res.retry = false
			return false
		}
		if res.ttft == 0 {
			res.ttft = time.Since(start)
			out.begin(p, req)
		}
		if len(c.MetaInfo) > 0 {
			res.meta = c.MetaInfo
			var mi metaInfo
			if json.Unmarshal(c.MetaInfo, &mi) == nil {
				res.promptTok, res.outputTok, res.kvLenAfter = mi.PromptTokens, mi.CompletionTokens, mi.KVC.KVLenAfter
			}
		}
		if err := out.chunk(payload, c.Text); err != nil {
			res = failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, 499, "client_closed", err.Error())
			return false
		}
		return true
	}
	ct := resp.Header.Get("Content-Type")
	if !bytes.HasPrefix([]byte(ct), []byte("text/event-stream")) {
		raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
		if err != nil {
			return result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, detail: "reading decode answer: " + err.Error()}
		}
		if !handle(raw) {
			return res
		}
		res.ok = true
		return res
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		line = bytes.TrimSpace(line)
		if bytes.HasPrefix(line, []byte("data:")) {
			payload := bytes.TrimSpace(line[len("data:"):])
			if bytes.Equal(payload, []byte("[DONE]")) {
				res.ok = true
				return res
			}
			if !handle(payload) {
				return res
			}
		}
		if err != nil {
			if ctx.Err() != nil || !errors.Is(err, io.EOF) {
				return result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, ttft: res.ttft, detail: "decode stream: " + err.Error()}
			}
			r := failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, http.StatusBadGateway, "worker_stream_ended", "decode worker ended the stream before [DONE]")
			r.ttft = res.ttft
			r.retry = res.ttft == 0 // D went away before its first token
			return r
		}
	}
}
