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
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/pkg/kvhints"
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
	retry bool
	// gone is the worker that refused or dropped the connection (or answered a 503 other than
	// no_capacity): a retry excludes it.
	gone *kvcv1.WorkerRef
	// transfer: the KV transfer failed (transfer_failed, kv_verify_failed) before D's first
	// token: retryable, and the retry excludes both ends of the transfer.
	transfer  bool
	meta      json.RawMessage // the decode worker's last meta_info
	promptTok int64
	outputTok int64
	// outputIDs are the generated token ids D streamed (output_ids), for the outcome's chain.
	outputIDs []int64
	// truncatedTo: D rewrote the session from this token on (meta_info.kvc.truncated_to).
	truncatedTo int64
}

// carry keeps what D streamed before attempt res failed (its TTFT, ids and counts) in r, the
// failure as classified: a resume continues from them (resume.go).
func (r *result) carry(res result) {
	r.ttft, r.outputIDs, r.promptTok, r.outputTok, r.meta = res.ttft, res.outputIDs, res.promptTok, res.outputTok, res.meta
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

// Worker error codes the gateway tells apart (docs/interfaces.md).
const (
	// codeNoCapacity is a live worker's 503: it is full, not gone (the control plane's rejection
	// counters handle it; retrying at once would only add load).
	codeNoCapacity = "no_capacity"
	// codeNotResident is D's 409 for a session it does not hold (it evicted it before the
	// control plane heard): the control plane drops the residency, the retry reseeds.
	codeNotResident = "session_not_resident"
	// codeWorkerBodyTooLarge (413 to the client): a worker answered 413, its body limit is
	// below the gateway's (the message names it).
	codeWorkerBodyTooLarge = "worker_body_too_large"
	// codeWorkerRefused (502 to the client): a worker answered 400 to a request the gateway
	// accepted (the message is the worker's).
	codeWorkerRefused = "worker_refused"
)

// classify maps a worker failure to an outcome error kind and a client-facing error; the kind
// for a D that did not take the request and for a failed transfer are the decision's
// (RouteExecution), not the gateway's. A worker that is gone — the connection refused, reset
// or closed (while the request is still alive), or a 503 other than no_capacity — is retryable
// and named in gone, as is D's 409 session_not_resident (D is alive: not gone).
func classify(we *workerError, p *plan, ctx, clientCtx context.Context) result {
	if we.status == 0 {
		switch {
		case clientCtx.Err() != nil:
			return failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, 499, "client_closed", "client went away")
		case errors.Is(ctx.Err(), context.DeadlineExceeded):
			return failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT, http.StatusGatewayTimeout, "timeout", "request timed out")
		}
		r := failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, http.StatusBadGateway, "worker_unreachable", we.Error())
		if r.retry = ctx.Err() == nil; r.retry {
			r.gone = p.worker(we.role)
		}
		return r
	}
	code := we.code
	if code == "" {
		code = "worker_error"
	}
	status := we.status
	switch {
	case we.status == http.StatusRequestEntityTooLarge:
		// The gateway took the body but the worker's limit is lower (issue 23 item 3): the
		// client's request is too large for the cluster, said with the worker's limit.
		code = codeWorkerBodyTooLarge
	case we.status == http.StatusBadRequest:
		// The gateway validated the request; a worker that refuses it disagrees with the
		// gateway, which is not the client's error.
		status, code = http.StatusBadGateway, codeWorkerRefused
	}
	r := failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, status, code, we.role+" worker: "+we.message)
	decode := we.role == roleDecode
	switch {
	case we.status == http.StatusConflict && decode && code == codeNotResident:
		r.kind, r.retry = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT, true
	case we.status == http.StatusConflict && decode:
		r.kind, r.retry = p.onRefused(), true
	case we.status == http.StatusServiceUnavailable:
		if decode {
			r.kind = p.onRefused()
		}
		if r.retry = code != codeNoCapacity; r.retry {
			r.gone = p.worker(we.role)
		}
	case we.status == http.StatusBadGateway || code == "transfer_failed" || code == "kv_verify_failed":
		// A sidecar that restarts, dies mid-transfer, or is offered a transfer before it
		// re-attached (issue 16 finding 4): a new decision without these workers may serve it.
		r.kind = p.onTransferFailed()
		r.retry, r.transfer = true, true
	case we.status == http.StatusGatewayTimeout:
		r.kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT
	}
	return r
}

// onRefused is the kind to report when D did not take the request (the decision's; a plan
// without one reports WORKER_ERROR).
func (p *plan) onRefused() kvcv1.RouteErrorKind {
	if k := p.exec.GetOnDecodeRefused(); k != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_UNSPECIFIED {
		return k
	}
	return kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR
}

// onTransferFailed is the kind to report for a failed transfer (the decision's; else
// TRANSFER_FAILED).
func (p *plan) onTransferFailed() kvcv1.RouteErrorKind {
	if k := p.exec.GetOnTransferFailed(); k != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_UNSPECIFIED {
		return k
	}
	return kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED
}

const (
	rolePrefill = "prefill"
	roleDecode  = "decode"
)

// worker is the plan's worker of role.
func (p *plan) worker(role string) *kvcv1.WorkerRef {
	if role == rolePrefill {
		return p.prefill
	}
	return p.decode
}

// keepSession: the decode worker keeps the session resident afterwards (the decision says so,
// and the request has a session).
func (p *plan) keepSession(req *api.Request) bool {
	return req.SessionID != "" && p.exec.GetKeepSession()
}

// payloadFor is the ExecutionPayload of one half of the request (role prefill or decode): the
// decision's RouteExecution for that worker, the one place the gateway turns a plan into what a
// worker does. The workers act on its fields; the mode rides along as a label.
func payloadFor(p *plan, req *api.Request, role string) *kvcv1.ExecutionPayload {
	e := p.exec
	keep := p.keepSession(req)
	out := &kvcv1.ExecutionPayload{
		DecisionId: p.decisionID, Mode: p.mode, SessionId: req.SessionID,
		InputTokens: req.InputTokens, CachedTokens: p.cached, KeepSession: keep,
	}
	if n := e.GetLoadPrefixTokens(); n > 0 && e.GetCallPrefill() {
		// Prefill from the snapshot: P loads [0, n) of the session's snapshot from its store first
		// (D gets it too: the KV it receives was computed on loaded KV, not by one full prefill).
		out.LoadPrefixTokens, out.LoadGeneration = n, e.GetLoadGeneration()
	}
	transfer := e.GetTransfer()
	// A seed through the prefill store (colocated D): P writes the prompt's KV into its
	// sidecar's store as the session's snapshot of store_generation; D, called after P answered,
	// loads [0, input) from there in a room of its own, as a snapshot (docs/sglang.md).
	store := e.GetStoreGeneration() != 0 && transfer == kvcv1.TransferKind_TRANSFER_KIND_SEED
	// Suffix-only receive: D keeps [0, from) and P sends only the pages past it.
	var from int64
	if transfer == kvcv1.TransferKind_TRANSFER_KIND_SEED {
		from = e.GetReceiveFrom()
	}
	if role == rolePrefill {
		out.Role = kvcv1.WorkerRole_WORKER_ROLE_PREFILL
		out.Send = &kvcv1.ExecutionSend{Room: p.room, FromToken: from}
		if store {
			out.Send.StoreGeneration = e.GetStoreGeneration()
		}
		return out
	}
	out.Role = kvcv1.WorkerRole_WORKER_ROLE_DECODE
	out.OpenSession = keep && e.GetOpenSession()
	out.TruncateTo = e.GetTruncateTo()
	out.LocalPrefill = e.GetLocalPrefill()
	if transfer == kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED {
		return out
	}
	r := &kvcv1.ExecutionReceive{Kind: transfer, Room: p.room, PeerAddr: p.prefill.GetPeerAddr(),
		// Tensor parallelism: rank r of D receives from rank r of P (every rank of the worker
		// gets this body; each takes its own, peer_addr is rank 0's).
		PeerAddrs: rankPeers(p.prefill), Tokens: req.InputTokens, FromToken: from}
	switch {
	case store:
		r.Kind, r.Room, r.FromToken = kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, e.GetStoreLoadRoom(), 0
	case transfer == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT:
		r.Tokens = p.snapSeqlen
	}
	out.Receive = r
	return out
}

// workerBody is the SGLang /generate body for one half of the request (role prefill or decode),
// as a real SGLang worker takes it: the full context (text or input_ids) on both halves;
// session_params only on D and only when D keeps the session (its streaming session); the
// bootstrap fields when P computes (host/port = the prefill sidecar's peer address); and the
// decision's ExecutionPayload in SGLang's kv_hints envelope (one "kvc" action, pkg/kvhints).
func workerBody(p *plan, req *api.Request, role string) wireBody {
	b := map[string]any{
		"rid":    req.RID,
		"stream": role == roleDecode,
	}
	if len(req.Sampling) == 0 {
		// A request built without them (not through api.Parse) gets its max tokens only.
		b["sampling_params"] = map[string]any{"max_new_tokens": req.MaxTokens}
	}
	if len(req.InputIDs) > 0 {
		b["input_ids"] = req.InputIDs
	}
	if role == roleDecode && p.keepSession(req) {
		b["session_params"] = map[string]any{"id": req.SessionID}
	}
	e := p.exec
	if role == rolePrefill && p.priority != 0 {
		b["priority"] = sglangPriority(p.priority)
	}
	store := e.GetStoreGeneration() != 0
	if e.GetCallPrefill() && !(store && role == roleDecode) {
		b["bootstrap_room"] = p.room
		if host, port, err := net.SplitHostPort(p.prefill.GetPeerAddr()); err == nil {
			if n, err := strconv.Atoi(port); err == nil {
				b["bootstrap_host"], b["bootstrap_port"] = host, n
			}
		}
	}
	msgID := p.decisionID
	if msgID == "" {
		msgID = req.RID
	}
	// Build fails only on invalid UTF-8 in a string field; the ids and addresses are validated.
	if env, err := kvhints.Build(msgID, payloadFor(p, req, role)); err == nil {
		b["kv_hints"] = env
	}
	out, _ := json.Marshal(b)
	if len(req.Sampling) > 0 {
		// The request's sampling_params as SGLang builds them for its API (api.Request.Sampling:
		// already JSON), spliced in as they are: not re-encoded per call.
		const key = `,"sampling_params":`
		full := make([]byte, 0, len(out)+len(key)+len(req.Sampling))
		out = append(append(append(append(full, out[:len(out)-1]...), key...), req.Sampling...), '}')
	}
	return withText(out, req.Text)
}

// sglangPriority is SGLang's request priority (GenerateReqInput.priority) for a decision's
// prefill_priority. The two run opposite ways: prefill_priority is lower-is-more-important (100
// for a session bound direct-to-D), while SGLang 0.5.23's --radix-eviction-policy priority
// evicts the radix nodes of the lowest priority values first (PriorityStrategy: (priority,
// last_access_time)), a node keeping the highest value of the requests that inserted it; and,
// with --enable-priority-scheduling, higher values are scheduled first by default. So the low
// prefill priority 100 is SGLang's -100: those pages go first, LRU among them, and a prefix
// shared with a normal (0) request stays at 0.
func sglangPriority(prefillPriority int32) int64 { return -int64(prefillPriority) }

// prefillPriorityClass is the closed label of kvc_gateway_prefill_priority_total.
func prefillPriorityClass(prefillPriority int32) string {
	switch {
	case prefillPriority > 0:
		return "low"
	case prefillPriority < 0:
		return "high"
	}
	return "normal"
}

// rankPeers is the peer address of each rank of a tensor-parallel worker (WorkerRef.tp_ranks),
// in rank order; nil for a worker without tensor parallelism.
func rankPeers(w *kvcv1.WorkerRef) []string {
	rs := w.GetTpRanks()
	if len(rs) == 0 {
		return nil
	}
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.GetPeerAddr()
	}
	return out
}

// wireBody is a worker call's JSON body in parts: head, then the prompt text (the request's own
// string, sent as it is: no copy), then tail. A large prompt is not copied into every worker
// call's body (json.Marshal copied it about three times per call, for P and for D; issue 16
// finding 6).
type wireBody struct {
	head []byte
	text string
	tail []byte
}

// jsonBody is a body without a spliced text.
func jsonBody(b []byte) wireBody { return wireBody{head: b} }

func (w wireBody) size() int64 { return int64(len(w.head) + len(w.text) + len(w.tail)) }

func (w wireBody) reader() io.Reader {
	if w.text == "" && len(w.tail) == 0 {
		return bytes.NewReader(w.head)
	}
	return io.MultiReader(bytes.NewReader(w.head), strings.NewReader(w.text), bytes.NewReader(w.tail))
}

// withText adds "text" to obj (a marshaled, non-empty JSON object). A text JSON needs no escape
// for is spliced in by reference; any other is encoded (copied) by encoding/json.
func withText(obj []byte, text string) wireBody {
	if text == "" {
		return jsonBody(obj)
	}
	if plainJSONString(text) {
		return wireBody{head: []byte(`{"text":"`), text: text, tail: append([]byte(`",`), obj[1:]...)}
	}
	enc, _ := json.Marshal(text)
	head := append(append([]byte(`{"text":`), enc...), ',')
	return wireBody{head: append(head, obj[1:]...)}
}

// plainJSONString: s is valid UTF-8 without a byte JSON must escape (a quote, a backslash, a
// control character), so `"` + s + `"` is its JSON string.
func plainJSONString(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c == '"' || c == '\\' {
			return false
		}
	}
	return utf8.ValidString(s)
}

// call posts a JSON body to url+path; a non-2xx answer or a transport failure is a workerError.
func (s *Server) call(ctx context.Context, url, path string, body wireBody, role string) (*http.Response, *workerError) {
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, url+path, body.reader())
	if err != nil {
		return nil, &workerError{role: role, err: err}
	}
	hr.ContentLength = body.size()
	hr.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(body.reader()), nil }
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
		} else if m := strings.TrimSpace(string(raw)); m != "" {
			we.message = m // SGLang answers some errors as plain text or {"detail": ...}
		}
		return nil, we
	}
	return resp, nil
}

func (s *Server) post(ctx context.Context, url string, body wireBody, role string) (*http.Response, *workerError) {
	return s.call(ctx, url, "/generate", body, role)
}

// sessionCall is POST /open_session or /close_session on a decode worker, its answer drained.
func (s *Server) sessionCall(ctx context.Context, url, path string, body []byte) *workerError {
	resp, we := s.call(ctx, url, path, jsonBody(body), roleDecode)
	result := "ok"
	if we != nil {
		result = "error"
	} else {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
	}
	s.m.SessionCalls.WithLabelValues(strings.TrimPrefix(path, "/"), result).Inc()
	return we
}

// openSession opens the session as a streaming session on the plan's decode worker (SGLang's
// POST /open_session). A worker that refuses (it still holds an older copy: the session id is
// taken) gets the old copy closed and is asked once more: the decision's KV replaces it.
func (s *Server) openSession(ctx context.Context, p *plan, req *api.Request) *workerError {
	timeout := s.opt.SessionTimeout
	if timeout <= 0 {
		timeout = DefaultSessionTimeout
	}
	open, _ := json.Marshal(map[string]any{
		"session_id": req.SessionID, "streaming": true, "timeout": timeout.Seconds(),
		"capacity_of_str_len": sessionCapacityStrLen,
	})
	url := p.decode.GetWorkerUrl()
	we := s.sessionCall(ctx, url, "/open_session", open)
	if we == nil || we.status == 0 || we.status/100 != 4 {
		return we
	}
	if cwe := s.sessionCall(ctx, url, "/close_session", closeBody(req.SessionID)); cwe != nil && cwe.status == 0 {
		return cwe
	}
	return s.sessionCall(ctx, url, "/open_session", open)
}

// sessionCapacityStrLen is open_session's capacity_of_str_len: room for the largest context
// the gateway accepts.
const sessionCapacityStrLen = (api.MaxInputTokens + api.MaxOutputTokens) * api.CharsPerToken

func closeBody(session string) []byte {
	b, _ := json.Marshal(map[string]string{"session_id": session})
	return b
}

// closeSessions closes the session on the decode workers the decision moved it off
// (RouteExecution.close_session_on), in the background: the client's answer does not wait,
// and a dead worker costs at most the connect timeout.
func (s *Server) closeSessions(p *plan, req *api.Request) {
	for _, w := range p.exec.GetCloseSessionOn() {
		url := w.GetWorkerUrl()
		if url == "" || req.SessionID == "" || url == p.decode.GetWorkerUrl() {
			continue
		}
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), s.opt.ConnectTimeout+5*time.Second)
			defer cancel()
			if we := s.sessionCall(ctx, url, "/close_session", closeBody(req.SessionID)); we != nil {
				s.log.Debug().Str("session", req.SessionID).Str("worker", w.GetWorkerId()).Str("err", we.Error()).Msg("close_session failed")
			}
		}()
	}
}

// closeAbandoned closes, in the background, the session a plan opened on its decode worker
// (open_session: a seed, a reseed) when the client went away before the turn succeeded: the
// control plane records no residency for it (ABORTED outcome), so the KV the worker holds for it
// would stay there as its most recently used idle session, and the worker would evict other
// sessions' KV before it (issue 23 item 5: a burst of streams of new sessions, each aborted at
// its first byte, flushed every resident session; the control plane's new-session bound holds
// only while the aborted ones give their pages back).
func (s *Server) closeAbandoned(p *plan, req *api.Request) {
	url := p.decode.GetWorkerUrl()
	if url == "" || req.SessionID == "" {
		return
	}
	s.m.AbandonedCloses.Inc()
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), s.opt.ConnectTimeout+5*time.Second)
		defer cancel()
		if we := s.sessionCall(ctx, url, "/close_session", closeBody(req.SessionID)); we != nil {
			s.log.Debug().Str("session", req.SessionID).Str("worker", p.decode.GetWorkerId()).Str("err", we.Error()).Msg("close_session of an abandoned session failed")
		}
	}()
}

// execute carries out p: P and D together when P computes (bootstrap host/port/room in both
// bodies), D only otherwise; a streaming session is opened on D first when the decision makes
// the session resident there.
func (s *Server) execute(ctx, clientCtx context.Context, start time.Time, p *plan, req *api.Request, out *sink) result {
	if p.pause > 0 {
		t := time.NewTimer(p.pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return classify(&workerError{role: roleDecode, err: ctx.Err()}, p, ctx, clientCtx)
		}
	}
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	// pch carries the prefill call's failure, only when it failed on its own (not because D's
	// failure cancelled it).
	var pch chan *workerError
	if p.exec.GetCallPrefill() && p.exec.GetStoreGeneration() != 0 {
		// A seed through the prefill store: D is called only once P answered (its sidecar then
		// holds the seed), so D's batch never waits for P's prefill.
		if we := s.prefillToStore(dctx, p, req); we != nil {
			r := classify(we, p, ctx, clientCtx)
			if we.status != 0 && r.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR && !r.retry {
				r.kind, r.transfer = p.onTransferFailed(), true // P could not store the seed
			}
			return r
		}
	} else if p.exec.GetCallPrefill() {
		pch = make(chan *workerError, 1)
		s.m.PrefillPriority.WithLabelValues(prefillPriorityClass(p.priority)).Inc()
		body := workerBody(p, req, rolePrefill)
		go func() {
			resp, we := s.post(dctx, p.prefill.GetWorkerUrl(), body, rolePrefill)
			if we == nil {
				_, err := io.Copy(io.Discard, io.LimitReader(resp.Body, 16<<20))
				resp.Body.Close()
				if err != nil && dctx.Err() == nil {
					we = &workerError{role: rolePrefill, err: err}
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
	var res result
	if p.exec.GetOpenSession() && req.SessionID != "" {
		to := time.Now()
		we := s.openSession(dctx, p, req)
		p.openDur = time.Since(to)
		if we != nil {
			if we.status == 0 {
				res = result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, detail: "open_session: " + we.err.Error()}
			} else {
				res = classify(we, p, dctx, dctx)
				res.retry = false // a live worker that refuses the session: a new decision may choose it again
			}
		}
	}
	if res.detail == "" {
		res = s.decode(dctx, start, p, req, out)
	}
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
		if !res.ok && pe != nil && res.kind != p.onRefused() {
			// The prefill side failed first (or explains D's failure): report that.
			r := classify(pe, p, ctx, clientCtx)
			r.carry(res)
			return r
		}
	}
	if !res.ok && res.status == 0 {
		// Transport failure on D: decide with the right contexts.
		r := classify(&workerError{role: roleDecode, err: errors.New(res.detail)}, p, ctx, clientCtx)
		r.carry(res)
		res = r
	}
	if !res.ok && res.retry && res.ttft == 0 && res.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR && res.gone != nil {
		// D refused or dropped the connection before its first token: it did not take the
		// request. Reported as the decision says (REJECTED_BY_D: the control plane counts it
		// against this (session, D) and migrates the session past the threshold); the detail
		// keeps what happened (worker_unreachable / worker_stream_ended).
		res.kind = p.onRefused()
	}
	return res
}

// prefillToStore calls P for a seed through its store and waits for its whole answer.
func (s *Server) prefillToStore(ctx context.Context, p *plan, req *api.Request) *workerError {
	s.m.PrefillPriority.WithLabelValues(prefillPriorityClass(p.priority)).Inc()
	resp, we := s.post(ctx, p.prefill.GetWorkerUrl(), workerBody(p, req, rolePrefill), rolePrefill)
	if we != nil {
		return we
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, io.LimitReader(resp.Body, 16<<20)); err != nil {
		return &workerError{role: rolePrefill, err: err}
	}
	return nil
}

// appendOutputIDs adds a chunk's output_ids to those seen so far: SGLang streams them
// cumulatively (each chunk repeats the earlier ids) or incrementally (kvc-sim).
func appendOutputIDs(acc, ids []int64) []int64 {
	if len(ids) > len(acc) && len(acc) > 0 && slices.Equal(ids[:len(acc)], acc) {
		return append(acc[:0], ids...)
	}
	return append(acc, ids...)
}

type chunk struct {
	Text      string          `json:"text"`
	OutputIDs []int64         `json:"output_ids"`
	MetaInfo  json.RawMessage `json:"meta_info"`
	Error     *struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

type metaInfo struct {
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	KVC              struct {
		KVLenAfter  int64 `json:"kv_len_after"`
		TruncatedTo int64 `json:"truncated_to"`
	} `json:"kvc"`
}

// decode calls D (always streaming, so TTFT is measured at the gateway) and relays its chunks.
func (s *Server) decode(ctx context.Context, start time.Time, p *plan, req *api.Request, out *sink) result {
	resp, we := s.post(ctx, p.decode.GetWorkerUrl(), workerBody(p, req, roleDecode), roleDecode)
	if we != nil {
		if we.status == 0 {
			// execute classifies it (with the role) once it knows whether P failed first.
			return result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, detail: we.err.Error()}
		}
		return classify(we, p, ctx, ctx)
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
			res = classify(&workerError{role: roleDecode, status: st, code: c.Error.Code, message: c.Error.Message}, p, ctx, ctx)
			// Only a transfer that failed before D's first token may be retried.
			res.retry = res.transfer && res.ttft == 0
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
				res.truncatedTo = max(res.truncatedTo, mi.KVC.TruncatedTo)
			}
		}
		res.outputIDs = appendOutputIDs(res.outputIDs, c.OutputIDs)
		if err := out.chunk(payload, c.Text, c.OutputIDs); err != nil {
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
				return result{kind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, ttft: res.ttft, detail: "decode stream: " + err.Error(),
					outputIDs: res.outputIDs, promptTok: res.promptTok, outputTok: res.outputTok, meta: res.meta}
			}
			r := failure(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_WORKER_ERROR, http.StatusBadGateway, "worker_stream_ended", "decode worker ended the stream before [DONE]")
			// D went away: before its first token a retry may serve the request (retryable),
			// after it a resume (resume.go); outputIDs and the counts so far go with it.
			r.ttft, r.retry, r.gone = res.ttft, true, p.decode
			r.outputIDs, r.promptTok, r.outputTok, r.meta = res.outputIDs, res.promptTok, res.outputTok, res.meta
			return r
		}
	}
}
