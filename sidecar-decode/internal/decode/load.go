package decode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// DefaultLoadTimeout bounds a LoadSessionCommand without its own timeout_ms.
const DefaultLoadTimeout = 30 * time.Second

// maxLoadTimeout bounds a command's timeout_ms.
const maxLoadTimeout = 10 * time.Minute

// loadClient calls the worker for loads (each call has its own deadline).
var loadClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, IdleConnTimeout: 30 * time.Second}}

// checkLoad validates a LoadSessionCommand (a bad one is refused in its ack).
func checkLoad(c *kvcv1.LoadSessionCommand) error {
	if err := kvcv1.ValidateID("session_id", c.GetSessionId()); err != nil {
		return err
	}
	switch {
	case c.GetSeqlen() <= 0:
		return fmt.Errorf("load_session %s: seqlen %d must be positive", c.GetSessionId(), c.GetSeqlen())
	case c.GetRoom() <= 0 || c.GetRoom() >= 1<<53:
		return fmt.Errorf("load_session %s: room %d out of range [1, 2^53)", c.GetSessionId(), c.GetRoom())
	case c.GetPrefillPeerAddr() == "":
		return fmt.Errorf("load_session %s: prefill_peer_addr is required", c.GetSessionId())
	case c.GetTimeoutMs() < 0 || time.Duration(c.GetTimeoutMs())*time.Millisecond > maxLoadTimeout:
		return fmt.Errorf("load_session %s: timeout_ms %d out of range [0, %d]", c.GetSessionId(), c.GetTimeoutMs(), maxLoadTimeout.Milliseconds())
	}
	return nil
}

// startLoad carries out a LoadSessionCommand in the background: the ack says it started, the
// LOADED / LOAD_FAILED event says how it ended.
func (s *Sidecar) startLoad(ctx context.Context, c *kvcv1.LoadSessionCommand) error {
	if err := checkLoad(c); err != nil {
		return err
	}
	if s.cfg.WorkerURL == "" {
		return errors.New("load_session: this sidecar has no --worker-url to call")
	}
	go s.loadSession(context.WithoutCancel(ctx), c)
	return nil
}

// loadSession has the worker create the session from the prefill store's snapshot, as SGLang's
// client API allows without a client request: POST /open_session (a streaming session), then a
// zero-output POST /generate whose kv_hints payload is a SNAPSHOT receive of [0, seqlen) — the worker's
// receive path (kvc-sim's, or SGLang's cache linker) pre-allocates the pages through this
// sidecar's bridge (PrepareReceive SNAPSHOT in the command's room), the prefill sidecar writes
// the snapshot into them, the worker verifies and commits them (COMMITTED) and answers. Only
// then is LOADED reported: residency follows the worker's commit, never the command.
func (s *Sidecar) loadSession(ctx context.Context, c *kvcv1.LoadSessionCommand) {
	timeout := DefaultLoadTimeout
	if ms := c.GetTimeoutMs(); ms > 0 {
		timeout = time.Duration(ms) * time.Millisecond
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	kv, verified, err := s.loadOnWorker(ctx, c)
	ev := &kvcv1.SessionEvent{SessionId: c.GetSessionId(), Room: c.GetRoom(), PeerWorker: c.GetPrefillWorkerId(),
		Detail: c.GetDecisionId(), UnixMs: time.Now().UnixMilli()}
	s.mu.Lock()
	if err != nil {
		s.loadsFailed++
	} else {
		s.loadsDone++
		if ss := s.sessions[c.GetSessionId()]; ss != nil {
			ev.Generation = ss.gen
			// Loaded now, whatever its last commit: the capacity release spares it for its
			// minimum idle time (a re-homed session waits for its next turn, not for a release).
			ss.loadedAt = time.Now()
		}
	}
	s.mu.Unlock()
	if err != nil {
		ev.Kind = kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED
		ev.Detail = c.GetDecisionId() + ": " + err.Error()
		if len(ev.Detail) > 1024 {
			ev.Detail = ev.Detail[:1024]
		}
		s.log.Warn().Str("session", c.GetSessionId()).Int64("room", c.GetRoom()).Str("prefill", c.GetPrefillWorkerId()).
			Err(err).Dur("took", time.Since(start)).Msg("load of a session from the prefill store failed")
	} else {
		ev.Kind = kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED
		ev.KvLen, ev.Bytes = kv, verified
		s.log.Info().Str("session", c.GetSessionId()).Int64("kv_len", kv).Int64("verified_bytes", verified).
			Str("prefill", c.GetPrefillWorkerId()).Dur("took", time.Since(start)).Msg("session loaded from the prefill store")
	}
	s.rep.Report(ev)
}

// Loads is how many LoadSessionCommands ended loaded and failed so far.
func (s *Sidecar) Loads() (done, failed int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loadsDone, s.loadsFailed
}

// loadOnWorker runs the two worker calls; it returns the KV length the worker holds after the
// load and the bytes it verified.
func (s *Sidecar) loadOnWorker(ctx context.Context, c *kvcv1.LoadSessionCommand) (int64, int64, error) {
	base := strings.TrimRight(s.cfg.WorkerURL, "/")
	id := c.GetSessionId()
	open, _ := json.Marshal(map[string]any{"session_id": id, "streaming": true, "timeout": DefaultLoadTimeout.Seconds() * 20})
	if code, body, err := post(ctx, base+"/open_session", open); err != nil {
		return 0, 0, fmt.Errorf("open_session: %w", err)
	} else if code/100 != 2 && !strings.Contains(body, "already open") {
		return 0, 0, fmt.Errorf("open_session: HTTP %d: %s", code, body)
	}
	// The worker acts on the payload's fields: a new session (open_session) kept here, whose
	// whole KV [0, seqlen) arrives from the prefill store (a SNAPSHOT receive); the mode is a
	// label.
	payload := &kvcv1.ExecutionPayload{
		DecisionId: c.GetDecisionId(), Mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE,
		SessionId: id, InputTokens: c.GetSeqlen(), CachedTokens: c.GetSeqlen(), KeepSession: true, OpenSession: true,
		Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Room: c.GetRoom(),
			PeerAddr: c.GetPrefillPeerAddr(), Tokens: c.GetSeqlen()},
		Load: true,
	}
	msgID := "load-" + id + "-" + fmt.Sprint(c.GetRoom())
	env, err := kvhints.Build(msgID, payload)
	if err != nil {
		return 0, 0, err
	}
	// The context's token ids, when the snapshot was pushed with them: the worker builds the
	// session's request from them (real SGLang needs them; kvc-sim and kvc-refworker verify the
	// loaded KV against them). Without, the load goes as before.
	ids, err := s.snapshotTokens(ctx, c)
	if err != nil {
		return 0, 0, err
	}
	req := map[string]any{
		"rid":             msgID,
		"sampling_params": map[string]any{"max_new_tokens": 0},
		"stream":          false,
		"session_params":  map[string]any{"id": id},
		"kv_hints":        env,
	}
	if ids != nil {
		req["input_ids"] = ids
	}
	gen, _ := json.Marshal(req)
	code, body, err := post(ctx, base+"/generate", gen)
	if err != nil {
		return 0, 0, fmt.Errorf("generate: %w", err)
	}
	var ans struct {
		MetaInfo struct {
			KVC struct {
				KVLenAfter     int64 `json:"kv_len_after"`
				VerifiedBytes  int64 `json:"verified_bytes"`
				VerifyFailures int64 `json:"verify_failures"`
			} `json:"kvc"`
		} `json:"meta_info"`
		Error *struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	perr := json.Unmarshal([]byte(body), &ans)
	if code/100 != 2 || ans.Error != nil || perr != nil {
		if ans.Error != nil {
			return 0, 0, fmt.Errorf("generate: HTTP %d: %s: %s", code, ans.Error.Code, ans.Error.Message)
		}
		return 0, 0, fmt.Errorf("generate: HTTP %d: %s", code, body)
	}
	k := ans.MetaInfo.KVC
	if k.VerifyFailures > 0 {
		return 0, 0, fmt.Errorf("generate: %d verify failures", k.VerifyFailures)
	}
	// Residency follows the worker's commit, never its answer alone: the session must be
	// committed here (CommitSession through this sidecar's bridge) with the whole snapshot.
	s.mu.Lock()
	ss := s.sessions[id]
	committed := int64(0)
	if ss != nil {
		committed = ss.committed
	}
	s.mu.Unlock()
	if committed < c.GetSeqlen() {
		return 0, 0, fmt.Errorf("the worker answered but committed %d of the %d tokens here", committed, c.GetSeqlen())
	}
	return max(committed, k.KVLenAfter), k.VerifiedBytes, nil
}

// ErrBadTokenIDs marks a prefill peer's SnapshotTokens answer that does not fit the load (a
// wrong count, a negative id): the load fails (LOAD_FAILED detail "token_ids_invalid: ...")
// rather than build the session from ids that are not its context.
var ErrBadTokenIDs = errors.New("token_ids_invalid")

// snapshotTokensTimeout bounds the SnapshotTokens call of a load.
const snapshotTokensTimeout = 5 * time.Second

// snapshotTokens asks the prefill peer for the token ids of [0, seqlen) of the snapshot the
// command loads. nil without error: none to be had — the snapshot was pushed without ids, the
// peer predates SnapshotTokens (UNIMPLEMENTED), does not hold that snapshot or cannot be asked
// (the transfer then fails on its own, as before); the load goes without ids.
func (s *Sidecar) snapshotTokens(ctx context.Context, c *kvcv1.LoadSessionCommand) ([]int32, error) {
	var res *kvcv1.SnapshotTokensResponse
	cl, err := s.peers.Client(c.GetPrefillPeerAddr())
	if err == nil {
		cctx, cancel := context.WithTimeout(ctx, snapshotTokensTimeout)
		res, err = cl.SnapshotTokens(cctx, &kvcv1.SnapshotTokensRequest{SessionId: c.GetSessionId(),
			Generation: c.GetSnapshotGeneration(), Seqlen: c.GetSeqlen()})
		cancel()
	}
	if err != nil {
		src := "error"
		switch status.Code(err) {
		case codes.Unimplemented, codes.NotFound, codes.FailedPrecondition:
			src = "none"
		}
		s.loadIDs.WithLabelValues(src).Inc()
		s.log.Debug().Err(err).Str("session", c.GetSessionId()).Msg("load without token ids")
		return nil, nil
	}
	ids := res.GetTokenIds()
	if len(ids) == 0 {
		s.loadIDs.WithLabelValues("none").Inc()
		return nil, nil
	}
	if err := kvcv1.ValidateTokenIDs("token_ids", ids, c.GetSeqlen()); err != nil {
		s.loadIDs.WithLabelValues("invalid").Inc()
		return nil, fmt.Errorf("%w: prefill peer %s answered SnapshotTokens of %s: %v", ErrBadTokenIDs, c.GetPrefillWorkerId(), c.GetSessionId(), err)
	}
	s.loadIDs.WithLabelValues("ids").Inc()
	return ids, nil
}

// post sends a JSON body and returns the status and (up to 64 KiB of) the answer.
func post(ctx context.Context, url string, body []byte) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := loadClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(b), nil
}
