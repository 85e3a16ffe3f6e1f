package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// KVCMeta is meta_info.kvc of an answer (docs/interfaces.md).
type KVCMeta struct {
	Mode           string `json:"mode"`
	Role           string `json:"role"`
	WorkerID       string `json:"worker_id"`
	KVLenAfter     int64  `json:"kv_len_after"`
	ReceivedBytes  int64  `json:"received_bytes"`
	VerifiedBytes  int64  `json:"verified_bytes"`
	VerifyFailures int64  `json:"verify_failures"`
	// LoadUnverified: a load without input_ids kept KV whose content it could not check (its
	// next turn checks it against the prompt before reusing it).
	LoadUnverified  bool    `json:"load_unverified,omitempty"`
	SentBytes       int64   `json:"sent_bytes,omitempty"`
	TransferMS      float64 `json:"transfer_ms"`
	TransferRealMS  float64 `json:"transfer_real_ms"`
	ReceiveWaitMS   float64 `json:"receive_wait_ms,omitempty"`
	TransferModelMS float64 `json:"transfer_model_ms"`
	PrefillTokens   int64   `json:"prefill_tokens"`
	PrefillMS       float64 `json:"prefill_ms"`
	EvictedSessions int     `json:"evicted_sessions"`
	// TruncatedTo: the session was rewritten from this token on (truncate_to, or a divergence
	// in its partial last page); 0 = not.
	TruncatedTo int64 `json:"truncated_to,omitempty"`
	// PrefixCachedTokens: a local first turn reused this many tokens of KV the worker held for
	// other sessions (its prefix cache) instead of prefilling them.
	PrefixCachedTokens int64 `json:"prefix_cached_tokens,omitempty"`
	// BootstrapWaitMS (prefill): the wait for the decode side's pre-allocation before this
	// prefill could start (SGLang's prefill bootstrap queue).
	BootstrapWaitMS float64 `json:"bootstrap_wait_ms,omitempty"`
	// FetchMS (prefill): the modeled fetch of a prefix from a KV tier, on the fetch lane.
	FetchMS float64 `json:"fetch_ms,omitempty"`
	// Prefill from the snapshot (prefill): tokens of the session's snapshot loaded from the
	// sidecar's store into this worker's pages, their bytes, the bytes verified against the
	// known pattern, the load's wall time (with the modeled fetch lane), and LoadMiss when the
	// store could not serve it (the whole context was prefilled).
	LoadedTokens      int64   `json:"loaded_tokens,omitempty"`
	LoadedBytes       int64   `json:"loaded_bytes,omitempty"`
	LoadVerifiedBytes int64   `json:"load_verified_bytes,omitempty"`
	LoadMS            float64 `json:"load_ms,omitempty"`
	LoadMiss          bool    `json:"load_miss,omitempty"`
	// ReceivedFrom (decode): a suffix-only receive kept [0, received_from) and received the rest.
	ReceivedFrom int64 `json:"received_from,omitempty"`
	// TurnWaitMS (decode): the wait for the session's previous turn here; AllocMS: the wait for
	// KV pages (the prealloc queue: behind earlier requests, for pages the capacity release or
	// running requests free), evictions included. The names kvc-refworker reports them under.
	TurnWaitMS float64 `json:"turn_wait_ms,omitempty"`
	AllocMS    float64 `json:"alloc_ms,omitempty"`
	// TTFTMS (decode): from the request's arrival here to its first token; GPUWaitMS: the time
	// its append-prefill chunks and its first decode step waited for the GPU (another request's
	// prefill chunk, or the running batch's step, held it). With TurnWaitMS, AllocMS,
	// ReceiveWaitMS / TransferMS and PrefillMS they account for a turn's time on this worker
	// phase by phase (docs/benchmark.md, issue 20's recovery, p42); the client's TTFT minus
	// TTFTMS is the gateway's and the control plane's part.
	TTFTMS    float64 `json:"ttft_ms,omitempty"`
	GPUWaitMS float64 `json:"gpu_wait_ms,omitempty"`
}

type metaInfo struct {
	ID               string          `json:"id"`
	PromptTokens     int64           `json:"prompt_tokens"`
	CompletionTokens int64           `json:"completion_tokens"`
	CachedTokens     int64           `json:"cached_tokens"`
	FinishReason     json.RawMessage `json:"finish_reason,omitempty"`
	E2ELatency       float64         `json:"e2e_latency,omitempty"`
	KVC              *KVCMeta        `json:"kvc"`
}

type answer struct {
	Text string `json:"text"`
	// OutputIDs are the generated token ids: this chunk's when streaming, all of them otherwise.
	OutputIDs []int64  `json:"output_ids,omitempty"`
	MetaInfo  metaInfo `json:"meta_info"`
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func roleName(r kvcv1.WorkerRole) string {
	if r == kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
		return "prefill"
	}
	return "decode"
}

// Register serves the worker HTTP API: POST /generate, POST /open_session, POST /close_session,
// GET /health, GET /get_model_info, GET /kvc/sessions.
func (w *Worker) Register(mux *http.ServeMux) {
	mux.HandleFunc("POST /generate", w.handleGenerate)
	mux.HandleFunc("POST /open_session", w.handleOpenSession)
	mux.HandleFunc("POST /close_session", w.handleCloseSession)
	mux.HandleFunc("GET /health", func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(rw, "ok\n")
	})
	mux.HandleFunc("GET /get_model_info", func(rw http.ResponseWriter, _ *http.Request) {
		writeJSON(rw, http.StatusOK, map[string]any{
			"model_path": w.cfg.Model, "is_generation": true, "kvc_role": roleName(w.cfg.Role),
			"worker_id": w.cfg.WorkerID, "page_size": w.cfg.Geometry.PageSize,
			"kv_capacity_tokens": w.CapacityTokens(),
		})
	})
	mux.HandleFunc("GET /kvc/sessions", func(rw http.ResponseWriter, _ *http.Request) {
		writeJSON(rw, http.StatusOK, map[string]any{
			"worker_id": w.cfg.WorkerID, "role": roleName(w.cfg.Role), "stats": w.stats(), "sessions": w.Sessions(),
		})
	})
}

func writeJSON(rw http.ResponseWriter, status int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	_ = json.NewEncoder(rw).Encode(v)
}

func writeError(rw http.ResponseWriter, e *apiError) {
	writeJSON(rw, e.status, map[string]any{"error": map[string]string{"code": e.code, "message": e.msg}})
}

// sessionRequest is SGLang's OpenSessionReqInput / CloseSessionReqInput.
type sessionRequest struct {
	SessionID        string   `json:"session_id"`
	Streaming        *bool    `json:"streaming"`
	Timeout          *float64 `json:"timeout"`
	CapacityOfStrLen *int64   `json:"capacity_of_str_len"`
}

func (w *Worker) parseSessionRequest(rw http.ResponseWriter, r *http.Request) (*sessionRequest, *apiError) {
	if w.cfg.Role != kvcv1.WorkerRole_WORKER_ROLE_DECODE {
		return nil, errf(http.StatusBadRequest, "bad_request", "sessions live on decode workers; this is a prefill worker")
	}
	body, err := io.ReadAll(http.MaxBytesReader(rw, r.Body, 64<<10))
	if err != nil {
		return nil, errf(http.StatusBadRequest, "bad_request", "reading body: %v", err)
	}
	var sr sessionRequest
	if err := json.Unmarshal(body, &sr); err != nil {
		return nil, errf(http.StatusBadRequest, "bad_request", "malformed JSON body: %v", err)
	}
	if err := kvcv1.ValidateID("session_id", sr.SessionID); err != nil {
		return nil, errf(http.StatusBadRequest, "bad_request", "%v", err)
	}
	if sr.Timeout != nil && (*sr.Timeout < 0 || *sr.Timeout != *sr.Timeout) {
		return nil, errf(http.StatusBadRequest, "bad_request", "timeout %v must be a non-negative number of seconds", *sr.Timeout)
	}
	if sr.CapacityOfStrLen != nil && *sr.CapacityOfStrLen < 0 {
		return nil, errf(http.StatusBadRequest, "bad_request", "capacity_of_str_len %d is negative", *sr.CapacityOfStrLen)
	}
	return &sr, nil
}

// handleOpenSession is SGLang's POST /open_session for a streaming session: it answers the
// session id as a JSON string. Like SGLang, it refuses an id that is already open — here, a
// session this worker holds — so the caller closes the stale copy first. kvc-sim holds no state
// for an open session without KV: the first turn's KV makes it resident. Only streaming
// sessions are supported (SGLang's non-streaming sessions branch and rewind, which kvcentric
// does not use).
func (w *Worker) handleOpenSession(rw http.ResponseWriter, r *http.Request) {
	sr, e := w.parseSessionRequest(rw, r)
	if e == nil && (sr.Streaming == nil || !*sr.Streaming) {
		e = errf(http.StatusBadRequest, "bad_request", "only streaming sessions are supported (\"streaming\": true)")
	}
	if e == nil {
		w.mu.Lock()
		_, held := w.sessions[sr.SessionID]
		w.mu.Unlock()
		if held {
			e = errf(http.StatusBadRequest, "bad_request", "session %q is already open on %s", sr.SessionID, w.cfg.WorkerID)
		}
	}
	if e != nil {
		w.m.requests.WithLabelValues("open_session", e.code).Inc()
		writeError(rw, e)
		return
	}
	w.m.requests.WithLabelValues("open_session", "ok").Inc()
	writeJSON(rw, http.StatusOK, sr.SessionID)
}

// handleCloseSession is SGLang's POST /close_session: the session's KV is released (the sidecar
// hears ReleaseSession before the pages are freed) once its running turn, if any, has ended.
// Closing a session this worker does not hold is not an error.
func (w *Worker) handleCloseSession(rw http.ResponseWriter, r *http.Request) {
	sr, e := w.parseSessionRequest(rw, r)
	if e != nil {
		w.m.requests.WithLabelValues("close_session", e.code).Inc()
		writeError(rw, e)
		return
	}
	unlock, err := w.lockTurn(r.Context(), sr.SessionID)
	if err != nil {
		e = ctxError(r.Context(), "waiting for the session's running turn")
		w.m.requests.WithLabelValues("close_session", e.code).Inc()
		writeError(rw, e)
		return
	}
	w.mu.Lock()
	s := w.sessions[sr.SessionID]
	if s != nil {
		w.pinLocked(s) // no eviction while the sidecar is told
	}
	w.mu.Unlock()
	if s != nil {
		w.dropSession(s, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED)
		w.unpin(s)
	}
	unlock()
	w.m.requests.WithLabelValues("close_session", "ok").Inc()
	writeJSON(rw, http.StatusOK, map[string]any{"session_id": sr.SessionID, "closed": s != nil})
}

func (w *Worker) handleGenerate(rw http.ResponseWriter, r *http.Request) {
	start := time.Now()
	mode := "unknown"
	code := "ok"
	defer func() { w.m.requests.WithLabelValues(mode, code).Inc() }()
	fail := func(e *apiError) {
		code = e.code
		w.log.Debug().Str("mode", mode).Str("code", e.code).Msg(e.msg)
		writeError(rw, e)
	}
	body, err := io.ReadAll(http.MaxBytesReader(rw, r.Body, maxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			fail(errf(http.StatusRequestEntityTooLarge, "body_too_large", "body larger than %d bytes, kvc-sim's limit", mbe.Limit))
			return
		}
		fail(errf(http.StatusBadRequest, "bad_request", "reading body: %v", err))
		return
	}
	p, err := parseGenerate(body, w.cfg.Role, w.CapacityTokens())
	if err != nil {
		fail(errf(http.StatusBadRequest, "bad_request", "%v", err))
		return
	}
	mode = p.mode
	if p.rid == "" {
		p.rid = "sim-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	meta := &KVCMeta{Mode: mode, Role: roleName(w.cfg.Role), WorkerID: w.cfg.WorkerID}
	if w.cfg.Role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
		if e := w.servePrefill(r.Context(), p, meta); e != nil {
			fail(e)
			return
		}
		w.m.ttft.WithLabelValues(mode).Observe(time.Since(start).Seconds())
		a := answer{MetaInfo: metaInfo{ID: p.rid, PromptTokens: p.input, CachedTokens: 0, KVC: meta,
			FinishReason: json.RawMessage(`{"type":"length","length":0}`), E2ELatency: time.Since(start).Seconds()}}
		if p.stream {
			sse := newSSE(rw)
			_ = sse.send(a)
			sse.done()
			return
		}
		writeJSON(rw, http.StatusOK, a)
		return
	}
	ready, end := w.serve() // running_requests
	defer end()             // after finish (deferred below)
	t, e := w.begin(r.Context(), p, meta, ready)
	if e != nil {
		fail(e)
		return
	}
	defer func() {
		if !t.finished {
			w.finish(t, false)
		}
	}()
	if e := w.decode(r.Context(), rw, t, start); e != nil {
		code = e.code
	}
}

// servePrefill runs the prefill half. Like SGLang's prefill bootstrap queue, it first waits
// until the decode side has pre-allocated its pages (its sidecar's offer: the first chunk of
// the transfer, page 0, is sent — SendKV returns once the offer is in), then fetches what a KV
// tier holds (the fetch lane, link.go; the GPU is not held), then prefills on the GPU (one pass
// at a time), writes the known bytes into this worker's pages, sends the rest (SendKV) and frees
// the pages once sent (release-after-transfer). A seed through the prefill store has no decode
// side to wait for.
func (w *Worker) servePrefill(ctx context.Context, p *plan, meta *KVCMeta) *apiError {
	ps := int64(w.cfg.Geometry.PageSize)
	n := pagesFor(p.input, int(ps))
	t := &turn{p: p}
	var pages []int64
	defer func() { w.freePages(pages) }()
	// sendFrom is the transfer's first page: 0, or with a suffix-only receive (receive_from)
	// the first page the decode worker does not hold.
	sendFrom := p.receiveFrom / ps
	first := sendFrom // pages already sent end here
	var head []int64
	tb := time.Now()
	if !p.toStore {
		var e *apiError
		head, _, e = w.allocate(ctx, 1, "")
		if e != nil {
			return e
		}
		pages = head
		at := make([]int64, sendFrom+1) // the head page at its place in token order
		at[sendFrom] = head[0]
		if e := w.fillContent(t, at, sendFrom*ps, min((sendFrom+1)*ps, p.input)); e != nil {
			return e
		}
		sctx, cancel := context.WithTimeout(ctx, w.cfg.TransferTimeout)
		resp, err := w.bridge.SendKV(sctx, &kvcv1.SendKVRequest{Room: p.room, SessionId: p.seedKey, Pages: head, FirstPage: sendFrom, Tokens: p.input})
		cancel()
		if err != nil {
			w.m.bridgeErrors.WithLabelValues("SendKV").Inc()
			if ctx.Err() != nil {
				return ctxError(ctx, "waiting for the decode side's pre-allocation")
			}
			return errf(http.StatusBadGateway, "transfer_failed", "SendKV room %d (bootstrap): %v", p.room, err)
		}
		meta.SentBytes += resp.GetBytes()
		first = sendFrom + 1
		meta.BootstrapWaitMS = ms(time.Since(tb))
		w.m.bootstrapSeconds.Observe(time.Since(tb).Seconds())
	}
	rest, _, e := w.allocate(ctx, n-int64(len(head)), "")
	if e != nil {
		return e
	}
	if len(head) > 0 {
		// token order: the pages before the head page, the head page, the pages after it
		pages = append(append(append(make([]int64, 0, n), rest[:sendFrom]...), head[0]), rest[sendFrom:]...)
	} else {
		pages = rest
	}
	t0 := time.Now()
	loaded, e := w.loadPrefix(ctx, t, pages, meta) // prefill from the snapshot: the fetch lane, not the GPU
	if e != nil {
		return e
	}
	compute, cached, pulled, from := w.prefillCost(p) // baseline.go: prefix cache, pulled tiers
	if loaded > 0 {
		// The GPU computes the tail only.
		compute, cached, pulled, from = w.cfg.Timing.Prefill(p.input-loaded), loaded, 0, ""
	}
	if pulled > 0 {
		d, err := w.fetch(ctx, pulled, from) // the fetch lane: this node's NIC and the tier's egress, not the GPU
		meta.FetchMS = ms(d)
		if err != nil {
			return ctxError(ctx, "fetching KV from a tier")
		}
	}
	select {
	case w.prefillGPU <- struct{}{}:
	case <-ctx.Done():
		return ctxError(ctx, "waiting for the prefill GPU")
	}
	// What the GPU computes: everything past the loaded prefix (the head page, written before
	// the prefill for the bootstrap chunk, again with the same bytes). Its known bytes are
	// written beside the modeled compute they stand for, not after it (one prefill, timed
	// once): after it, the write of the whole context added its wall time (3.3x at time scale
	// 0.3) to every prefill of every arm.
	fillFrom := min(first*ps, p.input)
	if sendFrom > 0 || loaded > 0 {
		fillFrom = loaded
	}
	filled := make(chan *apiError, 1)
	tg := time.Now()
	w.m.busy.begin()
	go func() { filled <- w.fillContent(t, pages, fillFrom, p.input) }()
	err := sleepCtx(ctx, compute)
	fe := <-filled
	w.m.busy.end()
	w.m.prefillBusy.Add(time.Since(tg).Seconds())
	<-w.prefillGPU
	w.m.pulledBytes.Add(float64(pulled * int64(w.cfg.Geometry.Buffers()) * int64(w.cfg.Geometry.BytesPerToken)))
	if err != nil {
		return ctxError(ctx, "during prefill")
	}
	if fe != nil {
		return fe
	}
	meta.PrefillTokens = p.input - cached - pulled
	meta.PrefixCachedTokens = cached + pulled
	meta.PrefillMS = ms(time.Since(t0))
	// P's prefix-cache hit rate counts the cache alone: a prefix loaded from the store is
	// neither a hit nor a prompt token the cache could have served (kvc_sim_store_load_tokens_total).
	w.m.prefillPromptTokens.Add(float64(p.input - loaded))
	w.m.prefillCacheHitTokens.Add(float64(cached - loaded))
	w.m.prefillTokens.Add(float64(meta.PrefillTokens))
	t1 := time.Now()
	sctx, cancel := context.WithTimeout(ctx, w.cfg.TransferTimeout)
	resp, err := w.bridge.SendKV(sctx, &kvcv1.SendKVRequest{
		Room: p.room, SessionId: p.seedKey, Pages: pages[first:], FirstPage: first, Last: true, Tokens: p.input,
		ToStore: p.toStore, Generation: p.storeGen, // a seed through the prefill store
	})
	cancel()
	if err != nil {
		w.m.bridgeErrors.WithLabelValues("SendKV").Inc()
		return errf(http.StatusBadGateway, "transfer_failed", "SendKV room %d: %v", p.room, err)
	}
	meta.SentBytes += resp.GetBytes()
	meta.TransferRealMS = ms(time.Since(t1))
	meta.TransferMS = meta.TransferRealMS
	w.m.sentBytes.Add(float64(meta.SentBytes))
	return nil
}

func ctxError(ctx context.Context, where string) *apiError {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return errf(http.StatusGatewayTimeout, "timeout", "request timed out %s", where)
	}
	return errf(499, "aborted", "client went away %s", where)
}

// turn is one decode request in flight.
type turn struct {
	p     *plan
	meta  *KVCMeta
	s     *session // nil for a single-shot (anonymous) request
	pages []int64  // anonymous requests only
	// extend: a keep_session PD_FALLBACK (large append) extending the held session s; prefixKV
	// is the session's kv_len before it, and dirty says the transfer may have written into the
	// session's own pages of that prefix and not yet been verified.
	extend   bool
	prefixKV int64
	dirty    bool
	// recvFrom: a suffix-only receive of a large append: the transfer writes [recvFrom, input).
	recvFrom int64
	// direct: the turn runs on the session held here, nothing received (a failed one keeps it).
	direct bool
	unlock func()
	kv     int64    // tokens of KV computed
	ids    []uint32 // the content of the turn's KV (content.go), built on first use
	local  bool     // a new session's first turn prefilled here (local_prefill)
	// radix: the decode radix's pages (poolradix.go) this plain P/D turn locked for its prefix;
	// they are the first pages of t.pages.
	radix []*rnode
	// finished: finish ran (decode runs it before the last write, so that a client that has the
	// whole answer knows the session is committed on the sidecar).
	finished bool
}

func (t *turn) pageList() []int64 {
	if t.s != nil {
		return t.s.pages
	}
	return t.pages
}

// begin does everything before the first decode step: lock the session's turn, find or drop
// its resident KV, allocate pages (evicting if needed), receive and verify transferred KV,
// append-prefill uncached tokens. ready is called once the turn is past its wait for its
// session's previous turn (serve).
func (w *Worker) begin(ctx context.Context, p *plan, meta *KVCMeta, ready func()) (*turn, *apiError) {
	t := &turn{p: p, meta: meta}
	ps := w.cfg.Geometry.PageSize
	need := pagesFor(p.input+p.maxNew, ps)
	anonymous := !p.keep
	if !anonymous {
		tw := time.Now()
		unlock, err := w.lockTurn(ctx, p.sessionID)
		meta.TurnWaitMS = ms(time.Since(tw))
		if err != nil {
			return nil, ctxError(ctx, "waiting for the session's previous turn")
		}
		t.unlock = unlock
	}
	ready() // past its previous turn: running, unless an allocation queues it (running_requests)
	fail := func(e *apiError) (*turn, *apiError) {
		w.finish(t, false)
		return nil, e
	}
	if p.localPrefill && p.keep {
		// A new session's first turn prefilled here (open_session, local_prefill).
		if e := w.beginLocal(ctx, t, need); e != nil {
			return fail(e)
		}
		return t, nil
	}
	if !p.receives() && !p.localPrefill {
		// No transfer: the turn runs on the session this worker holds.
		t.direct = true
		w.mu.Lock()
		s := w.sessions[p.sessionID]
		if s == nil || s.kvLen < p.cached {
			have := int64(-1)
			if s != nil {
				have = s.kvLen
			}
			w.mu.Unlock()
			if have < 0 {
				return fail(errf(http.StatusConflict, "session_not_resident", "session %q is not resident on %s", p.sessionID, w.cfg.WorkerID))
			}
			return fail(errf(http.StatusConflict, "session_not_resident",
				"session %q holds %d tokens on %s, fewer than cached_tokens %d", p.sessionID, have, w.cfg.WorkerID, p.cached))
		}
		w.pinLocked(s)
		w.touch(s)
		t.s = s
		kvLen := s.kvLen
		w.mu.Unlock()
		// Reuse only what is a prefix of this prompt (content.go): the decision's truncate_to
		// (= cached_tokens) already cut at the longest common prefix of full pages.
		keep, e := w.reusable(t, s, p.cached)
		if e != nil {
			return fail(e)
		}
		if keep < kvLen {
			if e := w.truncateSession(t, s, keep); e != nil {
				return fail(e)
			}
		}
		w.mu.Lock()
		have := int64(len(s.pages))
		w.mu.Unlock()
		if need > have {
			w.mu.Lock()
			s.waiting++
			w.mu.Unlock()
			ta := time.Now()
			pages, ev, e := w.allocate(ctx, need-have, p.sessionID)
			meta.AllocMS += ms(time.Since(ta))
			meta.EvictedSessions = ev
			w.mu.Lock()
			s.waiting--
			w.kickReport() // a waiting turn got its pages (or gave up): it pins the session now
			released := w.sessions[p.sessionID] != s
			if e == nil && !released {
				s.pages = append(s.pages, pages...)
			}
			w.mu.Unlock()
			if e != nil {
				return fail(e)
			}
			if released {
				// The sidecar's capacity release took the session while this turn waited for
				// pages (its snapshot is current): re-decided by the control plane (a reseed).
				w.freePages(pages)
				t.s = nil
				w.unpin(s)
				return fail(errf(http.StatusConflict, "session_not_resident",
					"session %q was released for capacity on %s while its turn waited for pages", p.sessionID, w.cfg.WorkerID))
			}
		}
		t.kv = keep
		if e := w.appendPrefill(ctx, t, keep, p.input); e != nil {
			return fail(e)
		}
		return t, nil
	}

	if p.receives() && p.keep && !p.open {
		// A receive into the session kept here that does not replace it: a large append of a
		// session this worker holds: receive the whole context (or its suffix), then extend the
		// session with it (extend). Without a held prefix of it, plain P/D. With receive_from
		// the control plane vouches only for [0, from): the held session may be longer than the
		// prompt past it (an edited or compacted history, cut back below).
		w.mu.Lock()
		s := w.sessions[p.sessionID]
		if s != nil && s.kvLen > 0 && (s.kvLen <= p.input || p.receiveFrom > 0) {
			w.pinLocked(s)
			w.touch(s)
			t.s, t.extend = s, true
		}
		w.mu.Unlock()
		if !t.extend && p.receiveFrom > 0 {
			// P sends only the suffix: without the held prefix the KV cannot be whole here.
			return fail(errf(http.StatusConflict, "session_not_resident",
				"session %q is not resident on %s, and the transfer sends only tokens from %d (receive_from)", p.sessionID, w.cfg.WorkerID, p.receiveFrom))
		}
		if !t.extend {
			p.keep, anonymous = false, true
		}
	}
	if t.extend {
		// The context arrives again from P; a held session that is no longer a prefix of it
		// (a divergence in its partial last page) is cut there first, so its sidecar never
		// holds rewritten tokens under an old commit.
		w.mu.Lock()
		kvLen := t.s.kvLen
		w.mu.Unlock()
		keep, e := w.keptOnExtend(t, t.s, kvLen, p.receiveFrom/int64(ps)*int64(ps))
		if e != nil {
			return fail(e)
		}
		if keep < kvLen {
			if e := w.truncateSession(t, t.s, keep); e != nil {
				return fail(e)
			}
		}
		// Suffix-only receive (receive_from): this worker keeps [0, from) it holds and P sends
		// only the pages past it; the held prefix must cover it.
		from := p.receiveFrom / int64(ps) * int64(ps)
		if from > keep {
			return fail(errf(http.StatusConflict, "session_not_resident",
				"session %q holds %d tokens of this prompt on %s, fewer than receive_from %d", p.sessionID, keep, w.cfg.WorkerID, from))
		}
		if e := w.extendPages(ctx, t, need); e != nil {
			return fail(e)
		}
		t.dirty = from == 0 // a whole-context receive writes into the pages of the held prefix too
		t.recvFrom = from
		if e := w.receive(ctx, t, kvcv1.TransferKind_TRANSFER_KIND_SEED, p.input); e != nil {
			return fail(e)
		}
		if from > 0 {
			meta.ReceivedFrom = from
			w.m.suffixReceives.Inc()
		}
		t.dirty = false
		t.kv = p.input
		return t, nil
	}

	// The KV arrives by transfer: any resident copy of the session here is stale.
	if !anonymous {
		w.mu.Lock()
		old := w.sessions[p.sessionID]
		w.mu.Unlock()
		if old != nil {
			w.dropSession(old, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED)
		}
	}
	var cached []int64
	if anonymous && !p.localPrefill {
		cached = w.radixBegin(t) // the decode radix's pages of the prompt's prefix, locked
	}
	ta := time.Now()
	pages, ev, e := w.allocate(ctx, need-int64(len(cached)), p.sessionID)
	meta.AllocMS += ms(time.Since(ta))
	meta.EvictedSessions = ev
	if e != nil {
		t.pages = cached
		return fail(e)
	}
	if anonymous {
		t.pages = append(cached, pages...)
		if p.localPrefill {
			// A PD_FALLBACK without a prefill worker (or the gateway's fail-open): this worker
			// prefills the whole context itself; no transfer, no sidecar, nothing kept.
			if e := w.appendPrefill(ctx, t, 0, p.input); e != nil {
				return fail(e)
			}
			return t, nil
		}
	} else {
		s := &session{id: p.sessionID, pages: pages, pinned: 1}
		w.mu.Lock()
		w.touch(s)
		w.sessions[s.id] = s
		w.mu.Unlock()
		t.s = s
	}
	kind := kvcv1.TransferKind_TRANSFER_KIND_SEED
	tokens := p.input
	fromStore := p.recvKind == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT // a snapshot, or a seed P left in its store
	if fromStore {
		kind = kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT
		tokens = p.recvTokens
	}
	if e := w.receive(ctx, t, kind, tokens); e != nil {
		return fail(e)
	}
	t.kv = tokens
	if fromStore {
		if e := w.appendPrefill(ctx, t, tokens, p.input); e != nil {
			return fail(e)
		}
	}
	return t, nil
}

// extendPages gives the held session t.s pages for need pages in all for a large append: its
// own pages of [0, kv_len) stay, new ones follow. The whole context is then received into
// them: the prefix arrives again into the pages that already hold it, with the same bytes (the
// known-bytes pattern, as real KV would be), so a snapshot push reading them meanwhile reads
// the same bytes, and D needs room only for the append and the output, as for a direct turn.
func (w *Worker) extendPages(ctx context.Context, t *turn, need int64) *apiError {
	s := t.s
	w.mu.Lock()
	t.prefixKV = s.kvLen
	k := pagesFor(s.kvLen, w.cfg.Geometry.PageSize)
	own := s.pages[:k:k]
	surplus := append([]int64(nil), s.pages[k:]...)
	w.mu.Unlock()
	w.freePages(surplus)
	ta := time.Now()
	more, ev, e := w.allocate(ctx, need-k, s.id)
	t.meta.AllocMS += ms(time.Since(ta))
	t.meta.EvictedSessions = ev
	if e != nil {
		w.mu.Lock()
		s.pages = own
		w.mu.Unlock()
		return e
	}
	w.mu.Lock()
	s.pages = append(own, more...)
	w.mu.Unlock()
	return nil
}

// prefillPeer is the prefill sidecar this worker receives from: with tensor parallelism, the
// prefill worker's rank of this worker's own rank (kv_hints prefill_peer_addrs), else
// prefill_peer_addr. A list of another length than this worker's tp_size is refused: the
// prefill worker's tensor parallelism differs (unequal TP is not supported).
func (w *Worker) prefillPeer(p *plan) (string, *apiError) {
	if len(p.peers) == 0 {
		return p.peer, nil
	}
	if n := max(w.cfg.TPSize, 1); int32(len(p.peers)) != n {
		return "", errf(http.StatusBadRequest, "bad_request", "kv_hints prefill_peer_addrs has %d ranks; this worker is rank %d of tp_size %d (prefill and decode pair only with equal tensor parallelism)",
			len(p.peers), w.cfg.TPRank, n)
	}
	return p.peers[w.cfg.TPRank], nil
}

// receive pre-allocates the pages of tokens [0, tokens) with the sidecar, waits for the
// transfer and verifies every received token, with the modeled link time beside them.
func (w *Worker) receive(ctx context.Context, t *turn, kind kvcv1.TransferKind, tokens int64) *apiError {
	p := t.p
	pages := t.pageList()[:pagesFor(tokens, w.cfg.Geometry.PageSize)]
	peer, aerr := w.prefillPeer(p)
	if aerr != nil {
		return aerr
	}
	t0 := time.Now()
	rp := w.receivePlan(t, kind, tokens) // baseline.go: decode radix and its restore
	var restored chan error
	if rp.restore > 0 {
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		restored = make(chan error, 1)
		go func() {
			_, err := w.fetch(rctx, rp.restore, rp.restoreFrom)
			restored <- err
		}()
	}
	// The modeled link time (a decode-radix restore started with the receive must be ready,
	// then the part the sender moves crosses this node's NIC and the sender's egress, link.go)
	// runs beside the real work it stands for — the sidecars' copy of the pages and this
	// worker's check of every received slot — not after it: one transfer, timed once (as the
	// store load on P, loadPrefix). A snapshot's push from the store starts with the receive,
	// so its flow starts here; a seed's sender starts only after P's prefill, which the real
	// wait holds, so its flow starts when the real transfer has ended, beside the check. Run one
	// after the other, the real copy and the check added their wall time (3.3x at time scale
	// 0.3, more under CPU contention) to every received turn's TTFT and page time.
	mctx, mcancel := context.WithCancel(ctx)
	defer mcancel()
	type modeled struct {
		d   time.Duration
		err error
	}
	var mch chan modeled
	startModel := func() {
		mch = make(chan modeled, 1)
		go func() {
			tm := time.Now()
			if restored != nil {
				if err := <-restored; err != nil {
					mch <- modeled{time.Since(tm), err}
					return
				}
			}
			_, err := w.move(mctx, tokens-max(rp.have, t.recvFrom), peer)
			mch <- modeled{time.Since(tm), err}
		}()
	}
	stop := func() { // the receive failed: the modeled flow leaves the links
		mcancel()
		if mch != nil {
			<-mch
		}
	}
	defer stop()
	if kind == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
		startModel()
	}
	pctx, cancel := context.WithTimeout(ctx, w.cfg.BridgeTimeout)
	_, err := w.bridge.PrepareReceive(pctx, &kvcv1.PrepareReceiveRequest{
		Room: p.room, SessionId: p.seedKey, Kind: kind, Pages: pages, Tokens: tokens, SourcePeerAddr: peer,
	})
	cancel()
	if err != nil {
		w.m.bridgeErrors.WithLabelValues("PrepareReceive").Inc()
		if ctx.Err() != nil {
			return ctxError(ctx, "in PrepareReceive")
		}
		return errf(http.StatusBadGateway, "transfer_failed", "PrepareReceive room %d: %v", p.room, err)
	}
	timeout := w.cfg.TransferTimeout
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < timeout {
		timeout = max(time.Until(dl), time.Millisecond)
	}
	wctx, cancel := context.WithTimeout(ctx, timeout+5*time.Second)
	resp, err := w.bridge.WaitReceive(wctx, &kvcv1.WaitReceiveRequest{Room: p.room, TimeoutMs: timeout.Milliseconds()})
	cancel()
	realDur := time.Since(t0)
	w.m.transferSeconds.Observe(realDur.Seconds())
	if err != nil {
		w.m.bridgeErrors.WithLabelValues("WaitReceive").Inc()
		if ctx.Err() != nil {
			return ctxError(ctx, "waiting for the KV transfer")
		}
		return errf(http.StatusBadGateway, "transfer_failed", "WaitReceive room %d: %v", p.room, err)
	}
	if !resp.GetOk() {
		return errf(http.StatusBadGateway, "transfer_failed", "transfer of room %d failed: %s", p.room, resp.GetError())
	}
	if resp.GetTokens() != 0 && resp.GetTokens() != tokens {
		return errf(http.StatusBadGateway, "transfer_failed", "transfer of room %d carried %d tokens, want %d", p.room, resp.GetTokens(), tokens)
	}
	if mch == nil {
		startModel()
	}
	checked, bad, err := w.checkContent(t, t.pageList(), t.recvFrom, tokens) // what the transfer wrote
	if err != nil {
		return errf(http.StatusInternalServerError, "internal", "verifying room %d: %v", p.room, err)
	}
	if bad > 0 && p.load && len(p.ids) == 0 {
		// A load without the session's token ids (re-homing): the bytes are not the made-up
		// ids' KV, so they are some real content; kept unverified, and checked against the
		// next turn's prompt before any reuse (reusable), which fails a mismatch.
		w.log.Debug().Str("session", p.seedKey).Int64("room", p.room).Msg("load without input_ids: received KV kept unverified")
		checked, bad = 0, 0
		t.meta.LoadUnverified = true
	}
	t.meta.ReceivedBytes = resp.GetBytes()
	t.meta.VerifyFailures = bad
	t.meta.VerifiedBytes = checked - bad*int64(w.cfg.Geometry.BytesPerToken)
	w.m.receivedBytes.Add(float64(resp.GetBytes()))
	w.m.verifiedBytes.Add(float64(t.meta.VerifiedBytes))
	w.m.verifyFailures.Add(float64(bad))
	if bad > 0 {
		w.log.Error().Str("session", p.seedKey).Int64("room", p.room).Int64("bad_slots", bad).Msg("received KV does not verify")
		return errf(http.StatusInternalServerError, "kv_verify_failed",
			"%d of %d received (token, buffer) slots of room %d do not hold the session's known bytes",
			bad, tokens*int64(w.cfg.Geometry.Buffers()), p.room)
	}
	m := <-mch // the modeled transfer's end (at once when the real work took longer)
	mch = nil
	if m.err != nil {
		return ctxError(ctx, "during the modeled transfer")
	}
	t.meta.PrefixCachedTokens = max(t.meta.PrefixCachedTokens, rp.have)
	// The sidecar measures the transfer itself; the wall time from PrepareReceive also holds the
	// wait for the sender (in SEED modes the prefill).
	moved := realDur
	if us := resp.GetDurationUs(); us > 0 && time.Duration(us)*time.Microsecond < realDur {
		moved = time.Duration(us) * time.Microsecond
	}
	t.meta.ReceiveWaitMS = ms(realDur)
	t.meta.TransferRealMS = ms(moved)
	t.meta.TransferModelMS = ms(m.d)
	t.meta.TransferMS = ms(time.Since(t0)) // the real and the modeled parts as they overlapped
	return nil
}

// appendPrefill models the (append-)prefill of tokens [from, to) and writes their known bytes.
func (w *Worker) appendPrefill(ctx context.Context, t *turn, from, to int64) *apiError {
	t0 := time.Now()
	w.m.busy.begin()
	wait, err := w.gpuPrefill(ctx, to-from) // decodegpu.go: shares the GPU with the decode batch
	w.m.busy.end()
	t.meta.GPUWaitMS += ms(wait)
	if err != nil {
		return ctxError(ctx, "during append-prefill")
	}
	if e := w.fillContent(t, t.pageList(), from, to); e != nil {
		return e
	}
	t.kv = to
	t.meta.PrefillTokens += to - from
	t.meta.PrefillMS += ms(time.Since(t0))
	w.m.prefillTokens.Add(float64(to - from))
	return nil
}

// decode runs the decode steps, streaming each token.
func (w *Worker) decode(ctx context.Context, rw http.ResponseWriter, t *turn, start time.Time) *apiError {
	p := t.p
	var sse *sseWriter
	if p.stream {
		sse = newSSE(rw)
	}
	mi := func(n int64) metaInfo {
		t.meta.KVLenAfter = p.input + n
		m := *t.meta
		return metaInfo{ID: p.rid, PromptTokens: p.input, CompletionTokens: n, CachedTokens: p.cached, KVC: &m}
	}
	var text strings.Builder
	var outIDs []int64
	w.m.busy.begin()
	defer w.m.busy.end()
	var stepEnd time.Time // the GPU's clock of this request's decode steps (gpuDecodeStep)
	for i := int64(0); i < p.maxNew; i++ {
		var err error
		var firstWait time.Duration
		var wait *time.Duration
		if i == 0 {
			wait = &firstWait
		}
		if stepEnd, err = w.gpuDecodeStep(ctx, stepEnd, wait); err != nil {
			return ctxError(ctx, "during decode")
		}
		if e := w.fillContent(t, t.pageList(), t.kv, t.kv+1); e != nil {
			return e
		}
		id := int64(t.content(t.kv + 1)[t.kv])
		t.kv++
		w.m.decodeTokens.Inc()
		tok := fmt.Sprintf(" t%d", t.kv-1)
		if i == 0 {
			w.m.ttft.WithLabelValues(p.mode).Observe(time.Since(start).Seconds())
			t.meta.GPUWaitMS += ms(firstWait)
			t.meta.TTFTMS = ms(time.Since(start))
		}
		if sse != nil {
			m := mi(i + 1)
			if i == p.maxNew-1 {
				m.FinishReason = json.RawMessage(fmt.Sprintf(`{"type":"length","length":%d}`, p.maxNew))
				m.E2ELatency = time.Since(start).Seconds()
			}
			if err := sse.send(answer{Text: tok, OutputIDs: []int64{id}, MetaInfo: m}); err != nil {
				return errf(499, "aborted", "client went away during streaming: %v", err)
			}
		} else {
			text.WriteString(tok)
			outIDs = append(outIDs, id)
		}
		if w.stepWork != nil {
			w.stepWork()
		}
	}
	if p.maxNew == 0 {
		w.m.ttft.WithLabelValues(p.mode).Observe(time.Since(start).Seconds())
	}
	w.finish(t, true)
	final := mi(p.maxNew)
	final.FinishReason = json.RawMessage(fmt.Sprintf(`{"type":"length","length":%d}`, p.maxNew))
	final.E2ELatency = time.Since(start).Seconds()
	if sse != nil {
		if p.maxNew == 0 {
			_ = sse.send(answer{MetaInfo: final})
		}
		sse.done()
		return nil
	}
	writeJSON(rw, http.StatusOK, answer{Text: text.String(), OutputIDs: outIDs, MetaInfo: final})
	return nil
}

// finish ends a decode turn: a kept session that succeeded is trimmed to its KV and committed
// to the sidecar (which pushes snapshots from it). A failed direct-to-D turn leaves the session
// as it was (its KV [0, kv_len) is intact); a failed transfer turn or a not-kept session is
// dropped.
func (w *Worker) finish(t *turn, ok bool) {
	t.finished = true
	if ok {
		w.baselineFinished(t) // baseline.go: decode radix, offload tier
	}
	defer func() {
		if t.unlock != nil {
			t.unlock()
		}
	}()
	if t.s == nil {
		if w.prad != nil && !t.p.localPrefill {
			w.radixFinish(t, ok) // poolradix.go: the turn's KV stays in the pool as the decode radix
			return
		}
		w.freePages(t.pages)
		return
	}
	s := t.s
	// The session stays pinned until its pages are final (dropped, trimmed, committed): an
	// eviction in between would free pages that trim frees again or that the commit hands to
	// the sidecar for snapshot pushes.
	defer w.unpin(s)
	if !ok && t.dirty {
		// A large append failed while its transfer may have written into the session's own
		// prefix pages: keep the session only if its KV [0, kv_len) still verifies. Checked
		// and dropped while still pinned, so no eviction takes it meanwhile.
		checked, bad, err := w.checkContent(t, s.pages, 0, t.prefixKV)
		if err != nil || bad > 0 {
			w.log.Warn().Str("session", s.id).Int64("kv_len", t.prefixKV).Int64("bad_slots", bad).Int64("checked_bytes", checked).
				Msg("failed large append damaged the session's KV; dropping it")
			w.dropSession(s, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED)
			return
		}
	}
	switch {
	case !t.p.keep:
		w.dropSession(s, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED)
		return
	case !ok && t.local:
		w.dropSession(s, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED)
		return
	case !ok && (t.direct || t.extend):
		w.trim(s, s.kvLen)
		return
	case !ok:
		w.dropSession(s, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED)
		return
	}
	pages := w.trim(s, t.kv)
	ctx, cancel := w.bridgeCtx()
	var ids []int32
	if !t.meta.LoadUnverified { // a load kept unverified holds KV of ids this worker does not know
		ids = commitIDs(t.content(t.kv))
	}
	_, err := w.bridge.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: s.id, CommittedLen: t.kv, Pages: pages, TokenIds: ids})
	cancel()
	if err != nil {
		w.m.bridgeErrors.WithLabelValues("CommitSession").Inc()
		w.log.Error().Err(err).Str("session", s.id).Int64("kv_len", t.kv).Msg("CommitSession failed")
		return
	}
	w.mu.Lock()
	s.committed = true
	w.mu.Unlock()
}

// unpin ends a request's use of s; once no request uses it, it may be evicted, so allocations
// waiting for room (the prealloc queue) are woken to try.
func (w *Worker) unpin(s *session) {
	w.mu.Lock()
	s.pinned--
	if s.pinned == 0 {
		w.wakeLocked()
	}
	w.kickReport()
	w.mu.Unlock()
}

// trim sets the session's KV length to kv and frees the pages beyond it; it returns a copy of
// the remaining page list.
func (w *Worker) trim(s *session, kv int64) []int64 {
	keep := pagesFor(kv, w.cfg.Geometry.PageSize)
	w.mu.Lock()
	surplus := append([]int64(nil), s.pages[keep:]...)
	s.pages = s.pages[:keep:keep]
	s.kvLen = kv
	pages := append([]int64(nil), s.pages...)
	w.touch(s)
	w.mu.Unlock()
	w.freePages(surplus)
	return pages
}

type sseWriter struct {
	rw      http.ResponseWriter
	fl      http.Flusher
	started bool
}

func newSSE(rw http.ResponseWriter) *sseWriter {
	fl, _ := rw.(http.Flusher)
	return &sseWriter{rw: rw, fl: fl}
}

func (s *sseWriter) send(v any) error {
	if !s.started {
		s.rw.Header().Set("Content-Type", "text/event-stream")
		s.rw.Header().Set("Cache-Control", "no-cache")
		s.rw.WriteHeader(http.StatusOK)
		s.started = true
	}
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if _, err := fmt.Fprintf(s.rw, "data: %s\n\n", b); err != nil {
		return err
	}
	if s.fl != nil {
		s.fl.Flush()
	}
	return nil
}

func (s *sseWriter) done() {
	if !s.started {
		s.rw.Header().Set("Content-Type", "text/event-stream")
		s.rw.WriteHeader(http.StatusOK)
	}
	_, _ = io.WriteString(s.rw, "data: [DONE]\n\n")
	if s.fl != nil {
		s.fl.Flush()
	}
}

// loadPrefix is the prefill from the snapshot (kv_hints load_prefix_tokens): the sidecar copies
// tokens [0, n) of the session's snapshot from its store into this worker's pages (n cut to
// whole pages), this worker verifies every loaded token against the session's known bytes,
// and the load costs the fetch lane at link rate (the store's egress; the GPU is not held),
// modeled beside the copy and the check rather than after them.
// It returns the tokens loaded. A load the store cannot serve (the entry left, another
// generation, fewer tokens) is no error: the worker prefills the whole context, as without a
// load. A loaded token that does not verify is (kv_verify_failed).
func (w *Worker) loadPrefix(ctx context.Context, t *turn, pages []int64, meta *KVCMeta) (int64, *apiError) {
	p := t.p
	ps := int64(w.cfg.Geometry.PageSize)
	n := p.loadPrefix / ps * ps
	if n <= 0 || p.role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
		return 0, nil
	}
	t0 := time.Now()
	// The modeled cost — the prefix crossing this node's link out of the store (the fetch lane)
	// — runs beside the real work it stands for (the sidecar's copy of the pages, this worker's
	// check of every loaded slot): one copy, timed once, as the baselines' tier pulls (modeled
	// only) are. Run one after the other, the real copy and check added their wall time (3.3x
	// at time scale 0.3) to every prefill from the snapshot.
	fctx, fcancel := context.WithCancel(ctx)
	defer fcancel()
	type fetched struct {
		d   time.Duration
		err error
	}
	fch := make(chan fetched, 1)
	go func() {
		d, err := w.fetch(fctx, n, "store-"+w.cfg.WorkerID)
		fch <- fetched{d, err}
	}()
	stop := func() { fcancel(); <-fch } // no load happened: the model charges none
	bctx, cancel := context.WithTimeout(ctx, w.cfg.TransferTimeout)
	resp, err := w.bridge.LoadFromStore(bctx, &kvcv1.LoadFromStoreRequest{
		SessionId: p.sessionID, Generation: p.loadGen, Tokens: n, Pages: pages[:n/ps],
	})
	cancel()
	if err != nil {
		stop()
		if ctx.Err() != nil {
			return 0, ctxError(ctx, "loading the snapshot prefix")
		}
		w.m.bridgeErrors.WithLabelValues("LoadFromStore").Inc()
		w.m.storeLoads.WithLabelValues("miss").Inc()
		w.log.Warn().Err(err).Str("session", p.sessionID).Int64("tokens", n).Msg("snapshot prefix not loaded; prefilling the whole context")
		meta.LoadMiss = true
		return 0, nil
	}
	checked, bad, cerr := w.checkContent(t, pages, 0, n)
	if cerr != nil {
		stop()
		return 0, errf(http.StatusInternalServerError, "internal", "verifying the loaded prefix: %v", cerr)
	}
	meta.VerifyFailures += bad
	w.m.verifyFailures.Add(float64(bad))
	if bad > 0 {
		stop()
		w.m.storeLoads.WithLabelValues("verify_failed").Inc()
		return 0, errf(http.StatusInternalServerError, "kv_verify_failed",
			"%d of %d (token, buffer) slots of the snapshot prefix loaded from the store do not hold the session's known bytes",
			bad, n*int64(w.cfg.Geometry.Buffers()))
	}
	meta.LoadedBytes = resp.GetBytes()
	meta.LoadVerifiedBytes = checked
	f := <-fch // the modeled load's end (at once when the real work took longer)
	if f.err != nil {
		return 0, ctxError(ctx, "during the modeled load from the store")
	}
	meta.LoadedTokens = n
	meta.LoadMS = ms(time.Since(t0))
	meta.FetchMS += ms(f.d)
	w.m.storeLoads.WithLabelValues("hit").Inc()
	w.m.storeLoadTokens.Add(float64(n))
	return n, nil
}
