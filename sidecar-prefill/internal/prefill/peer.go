package prefill

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

// maxEndpoint bounds ReserveSnapshotRequest.source_transfer_endpoint (a host:port or unix path).
const maxEndpoint = 1024

func (s *Sidecar) storeAndArena() (*store.Store, *kvxfer.Pool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.st == nil {
		return nil, nil, status.Error(codes.Unavailable, "snapshot store not ready: the prefill worker has not registered its KV pool")
	}
	return s.st, s.arena, nil
}

// ReserveSnapshot reserves store pages for tokens [base_len, base_len+tokens) of a session.
func (s *Sidecar) ReserveSnapshot(ctx context.Context, req *kvcv1.ReserveSnapshotRequest) (*kvcv1.ReserveSnapshotResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	// Under mTLS the caller's certificate must name the source worker (nil in plaintext mode).
	if err := tlsx.PeerAllowsWorker(ctx, req.GetSourceWorkerId()); err != nil {
		return nil, err
	}
	st, arena, err := s.storeAndArena()
	if err != nil {
		return nil, err
	}
	if err := kvxfer.CompatibleLayouts(req.GetSourceLayout(), arena.Layout()); err != nil {
		return nil, err
	}
	if err := s.checkPeerTP(ctx); err != nil {
		return nil, err
	}
	if n := len(req.GetSourceTransferEndpoint()); n > maxEndpoint {
		return nil, status.Errorf(codes.InvalidArgument, "source_transfer_endpoint of %d bytes (at most %d)", n, maxEndpoint)
	}
	// With the endpoint named, the store's write guard accepts writes into the reservation from
	// that peer only; without, from the first peer that writes into it.
	// Store credit (store/credit.go): the writer's first use_credit_pages credit pages, already
	// written, lead a full push's reservation; its credit is topped up to credit_pages after.
	// A re-tag (retag_from_generation) appends onto the snapshot the writer's worker received by
	// a reseed and gives the entry the push's generation: no full re-push after a reseed.
	// The range's token ids (optional) stay with the entry: a decode sidecar that loads the
	// snapshot later asks for them (SnapshotTokens). A wrong count or a negative id refuses the
	// reservation (INVALID_ARGUMENT).
	res, err := st.ReserveIDs(req.GetSessionId(), req.GetGeneration(), req.GetBaseLen(), req.GetTokens(), req.GetSourceWorkerId(),
		req.GetSourceTransferEndpoint(), store.CreditRequest{Pages: req.GetCreditPages(), Use: req.GetUseCreditPages(), ID: req.GetCreditId()},
		req.GetRetagFromGeneration(), req.GetTokenIds())
	if err != nil {
		s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvRejected, Session: req.GetSessionId(), Generation: req.GetGeneration(),
			BaseLen: req.GetBaseLen(), Tokens: req.GetTokens(), Peer: req.GetSourceWorkerId(), Reason: err.Error()})
		return nil, err
	}
	// The store's reservation is the only record of this ingest (store.Ingest): commit, abort
	// and expiry end it there.
	return &kvcv1.ReserveSnapshotResponse{IngestId: res.ID, StoreLayout: arena.Layout(), Pages: res.Pages, StoreTransferEndpoint: s.eng.SegmentName(),
		CreditPages: res.Credit.Pages, CreditId: res.Credit.ID}, nil
}

// SnapshotTokens answers a loading decode sidecar with the token ids of [0, seqlen) of the
// stored snapshot of the generation it loads (none when it was pushed without ids): the load's
// worker builds its request from them (docs/sidecars.md "Loading a session").
func (s *Sidecar) SnapshotTokens(_ context.Context, req *kvcv1.SnapshotTokensRequest) (*kvcv1.SnapshotTokensResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if req.GetSeqlen() <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "seqlen %d must be positive", req.GetSeqlen())
	}
	st, _, err := s.storeAndArena()
	if err != nil {
		return nil, err
	}
	ids, v, err := st.TokenIDs(req.GetSessionId(), req.GetGeneration(), req.GetSeqlen())
	outcome := "ids"
	switch {
	case err != nil:
		outcome = "refused"
	case ids == nil:
		outcome = "none"
	}
	s.tokenAnswers.WithLabelValues(outcome).Inc()
	if err != nil {
		return nil, err
	}
	return &kvcv1.SnapshotTokensResponse{TokenIds: ids, Generation: v.Generation, StoredSeqlen: v.Seqlen}, nil
}

// checkPeerTP refuses a peer whose worker's tensor parallelism differs from this worker's.
func (s *Sidecar) checkPeerTP(ctx context.Context) error {
	s.mu.Lock()
	p := s.pool
	s.mu.Unlock()
	if p == nil {
		return nil // nothing registered yet: the store or the room refuses on its own
	}
	return kvxfer.CheckPeerTP(ctx, p)
}

// checkIngestCaller refuses a commit or abort of ingest id from a caller whose certificate
// does not name the worker that reserved it (TLS only; unknown ingests are the store's to refuse).
func (s *Sidecar) checkIngestCaller(ctx context.Context, st *store.Store, id uint64) error {
	in, ok := st.Ingest(id)
	if !ok {
		return nil
	}
	return tlsx.PeerAllowsWorker(ctx, in.Source)
}

// onExpire reports a reservation the store freed because it was neither committed nor aborted
// in time (the pusher died or hung); the store's table was its only record.
func (s *Sidecar) onExpire(in store.Ingest) {
	s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvRejected, Session: in.Session, Generation: in.Generation, BaseLen: in.BaseLen,
		Tokens: in.Tokens, Peer: in.Source, Reason: fmt.Sprintf("expired: ingest %d not committed within %s", in.ID, in.Deadline.Sub(in.Started))})
}

// readyWaiter is an engine that can wait for another process's ready event
// (rdma.CUDAEngine.WaitReady).
type readyWaiter interface {
	WaitReady(ctx context.Context, handle []byte) error
}

// readyWaitMax bounds how long a commit waits for its ready event when the caller set no
// shorter deadline: a 50,000-token push copies in about 15 ms on NVLink and 100 ms to host.
const readyWaitMax = 30 * time.Second

// CommitSnapshot makes the written range part of the snapshot. With a ready event the bytes
// may still be moving: it waits for the event first, and aborts the ingest if the wait fails.
func (s *Sidecar) CommitSnapshot(ctx context.Context, req *kvcv1.CommitSnapshotRequest) (*kvcv1.CommitSnapshotResponse, error) {
	st, arena, err := s.storeAndArena()
	if err != nil {
		return nil, err
	}
	if err := s.checkIngestCaller(ctx, st, req.GetIngestId()); err != nil {
		return nil, err
	}
	if ev := req.GetReadyEvent(); len(ev) > 0 {
		if len(ev) != rdma.ReadyEventSize {
			return nil, status.Errorf(codes.InvalidArgument, "ready_event of %d bytes, want %d", len(ev), rdma.ReadyEventSize)
		}
		w, ok := s.eng.(readyWaiter)
		if !ok {
			return nil, status.Errorf(codes.FailedPrecondition, "ready_event needs the cuda transport; this sidecar uses %s", s.eng.Backend())
		}
		wctx, cancel := context.WithTimeout(ctx, readyWaitMax)
		err := w.WaitReady(wctx, ev)
		cancel()
		if err != nil {
			in, aerr := st.AbortIngest(req.GetIngestId())
			if aerr != nil {
				s.log.Warn().Err(aerr).Uint64("ingest", req.GetIngestId()).Msg("abort ingest after a failed ready event")
			}
			s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvRejected, Session: in.Session, Generation: in.Generation, BaseLen: in.BaseLen,
				Tokens: in.Tokens, Peer: in.Source, Reason: "ready event: " + err.Error()})
			return nil, status.Errorf(codes.Aborted, "ingest %d aborted: waiting for the ready event: %v", req.GetIngestId(), err)
		}
	}
	v, in, err := st.CommitIngest(req.GetIngestId())
	if err != nil {
		return nil, err
	}
	bytes := in.Tokens * arena.BytesPerToken()
	s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvIngested, Session: v.Session, Generation: v.Generation, BaseLen: in.BaseLen,
		Tokens: in.Tokens, Seqlen: v.Seqlen, Bytes: bytes, Peer: v.Source, DurationMs: sidecar.Ms(s.now().Sub(in.Started))})
	s.rep.Report(&kvcv1.SessionEvent{SessionId: v.Session, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED,
		KvLen: v.Seqlen, Generation: v.Generation, Bytes: v.Bytes, PeerWorker: v.Source})
	return &kvcv1.CommitSnapshotResponse{Seqlen: v.Seqlen}, nil
}

// AbortSnapshot frees a reservation.
func (s *Sidecar) AbortSnapshot(ctx context.Context, req *kvcv1.AbortSnapshotRequest) (*kvcv1.AbortSnapshotResponse, error) {
	st, _, err := s.storeAndArena()
	if err != nil {
		return nil, err
	}
	if err := s.checkIngestCaller(ctx, st, req.GetIngestId()); err != nil {
		return nil, err
	}
	in, err := st.AbortIngest(req.GetIngestId())
	if err != nil {
		return nil, err
	}
	s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvRejected, Session: in.Session, Generation: in.Generation, BaseLen: in.BaseLen,
		Tokens: in.Tokens, Peer: in.Source, Reason: "aborted by sender: " + req.GetReason()})
	return &kvcv1.AbortSnapshotResponse{}, nil
}

// TransferDone goes to decode sidecars.
func (s *Sidecar) TransferDone(context.Context, *kvcv1.TransferDoneRequest) (*kvcv1.TransferDoneResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "TransferDone goes to a decode sidecar; this is a prefill sidecar")
}

// OfferReceive records the decode side's pages for a room. A seed room is then written by the
// worker's SendKV calls; a snapshot room is written from the store right away.
func (s *Sidecar) OfferReceive(ctx context.Context, req *kvcv1.OfferReceiveRequest) (*kvcv1.OfferReceiveResponse, error) {
	switch {
	case req.GetRoom() == 0:
		return nil, status.Error(codes.InvalidArgument, "room is required")
	case req.GetTokens() <= 0:
		return nil, status.Errorf(codes.InvalidArgument, "tokens %d must be positive", req.GetTokens())
	case req.GetDecodeLayout() == nil:
		return nil, status.Error(codes.InvalidArgument, "decode_layout is required")
	case req.GetDecodePeerAddr() == "" || req.GetDecodeTransferEndpoint() == "":
		return nil, status.Error(codes.InvalidArgument, "decode_peer_addr and decode_transfer_endpoint are required")
	case req.GetKind() != kvcv1.TransferKind_TRANSFER_KIND_SEED && req.GetKind() != kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT:
		return nil, status.Errorf(codes.InvalidArgument, "unknown transfer kind %v", req.GetKind())
	}
	if ps := int64(req.GetDecodeLayout().GetPageSize()); ps <= 0 || int64(len(req.GetPages())) < (req.GetTokens()+ps-1)/ps {
		return nil, status.Errorf(codes.InvalidArgument, "%d pages do not cover %d tokens", len(req.GetPages()), req.GetTokens())
	}
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	// Under mTLS the caller's certificate must name the decode worker (nil in plaintext mode).
	if err := tlsx.PeerAllowsWorker(ctx, req.GetDecodeWorkerId()); err != nil {
		return nil, err
	}
	// Refused before the room exists: unequal tensor parallelism, or an MLA pool on one side
	// and MHA on the other (nothing could ever be written).
	if err := s.checkPeerTP(ctx); err != nil {
		return nil, err
	}
	s.mu.Lock()
	mine := s.pool
	if s.arena != nil && req.GetKind() == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
		mine = s.arena
	}
	s.mu.Unlock()
	if mine != nil {
		if err := kvxfer.CompatibleLayouts(mine.Layout(), req.GetDecodeLayout()); err != nil {
			return nil, err
		}
	}
	r := s.room(req.GetRoom())
	if r == nil {
		return nil, status.Errorf(codes.AlreadyExists, "room %d was already served", req.GetRoom())
	}
	s.mu.Lock()
	if r.offer != nil {
		s.mu.Unlock()
		return nil, status.Errorf(codes.AlreadyExists, "room %d already has an offer", req.GetRoom())
	}
	r.offer = req
	close(r.offerCh)
	s.mu.Unlock()
	if req.GetKind() == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.reseed(r)
		}()
	}
	return &kvcv1.OfferReceiveResponse{}, nil
}

// reseed writes the session's snapshot into the decode side's pages and signals done.
func (s *Sidecar) reseed(r *room) {
	off := r.offer
	s.mu.Lock()
	if s.rooms[r.id] == r {
		delete(s.rooms, r.id)
	}
	s.finished[r.id] = time.Now()
	pinned := r.pinned
	r.pinned = false
	st, arena := s.st, s.arena
	s.mu.Unlock()
	if pinned {
		defer st.Unpin(r.push.GetSessionId())
	}
	miss := func(reason string) {
		s.ev.Emit(sidecar.Event{Event: sidecar.EvBypassMiss, Session: off.GetSessionId(), Room: off.GetRoom(), Tokens: off.GetTokens(),
			Peer: off.GetDecodeWorkerId(), Reason: reason})
		s.done(off, false, 0, reason)
	}
	if st == nil {
		miss("snapshot_missing: store not ready")
		return
	}
	v, release, ok := st.Acquire(off.GetSessionId())
	if !ok {
		miss("snapshot_missing")
		return
	}
	defer release()
	if v.Seqlen < off.GetTokens() {
		miss(fmt.Sprintf("snapshot_short: seqlen %d < %d tokens", v.Seqlen, off.GetTokens()))
		return
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), s.cfg.TransferLimit)
	defer cancel()
	seg, err := s.segs.Open(ctx, off.GetDecodeTransferEndpoint())
	var moved uint64
	if err == nil {
		// Every page is checked first; the requests are then laid out a few buffers at a time
		// while the engine copies the previous ones.
		plan, perr := kvxfer.PlanRuns(kvxfer.PageMap{Layout: arena.Layout(), Pages: v.Pages},
			kvxfer.PageMap{Layout: off.GetDecodeLayout(), Pages: off.GetPages()}, 0, off.GetTokens())
		err = perr
		if err == nil {
			moved, err = plan.Transfer(ctx, s.eng, seg)
		}
		if err != nil {
			s.segs.Forget(off.GetDecodeTransferEndpoint())
		}
	}
	if err != nil {
		s.ev.Emit(sidecar.Event{Event: sidecar.EvTransferFailed, Kind: "snapshot", Session: off.GetSessionId(), Room: off.GetRoom(),
			Tokens: off.GetTokens(), Peer: off.GetDecodeWorkerId(), Reason: err.Error()})
		s.done(off, false, int64(moved), "snapshot write failed: "+err.Error())
		return
	}
	s.ev.Emit(sidecar.Event{Event: sidecar.EvBypassHit, Session: off.GetSessionId(), Generation: v.Generation, Room: off.GetRoom(),
		Tokens: off.GetTokens(), Seqlen: v.Seqlen, Bytes: int64(moved), DurationMs: sidecar.Ms(time.Since(start)), Peer: off.GetDecodeWorkerId()})
	s.done(off, true, int64(moved), "")
}

// onEvict reports a snapshot that left the store.
func (s *Sidecar) onEvict(v store.View, reason string) {
	s.ev.Emit(sidecar.Event{Event: sidecar.EvEvicted, Session: v.Session, Generation: v.Generation, Seqlen: v.Seqlen, Bytes: v.Bytes, Reason: reason})
	if reason == store.ReasonReplaced {
		return // the ingest of the newer generation is reported instead
	}
	s.rep.Report(&kvcv1.SessionEvent{SessionId: v.Session, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED,
		KvLen: v.Seqlen, Generation: v.Generation, Bytes: v.Bytes, Detail: reason})
}

// onCut reports a snapshot a re-tag append cut back to its base (store.ReserveRetag): the
// store holds [0, base) of the old generation now, whatever becomes of the append. The control
// plane hears it as a SNAPSHOT_INGESTED of that length (it records what the event names), so
// it routes no reseed for the tokens the append overwrites; one routed before the event
// arrives is refused by the read's length check (snapshot_short). The event keeps the
// snapshot's update time: nothing in it is newer.
func (s *Sidecar) onCut(v store.View, was int64) {
	s.ev.Emit(sidecar.Event{Event: sidecar.EvCutBack, Session: v.Session, Generation: v.Generation, BaseLen: was, Seqlen: v.Seqlen,
		Bytes: v.Bytes, Peer: v.Source, Reason: "re-tag append from a prefix of the snapshot"})
	s.rep.Report(&kvcv1.SessionEvent{SessionId: v.Session, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED,
		KvLen: v.Seqlen, Generation: v.Generation, Bytes: v.Bytes, PeerWorker: v.Source, UnixMs: v.Updated.UnixMilli(),
		Detail: fmt.Sprintf("cut back from %d tokens by a re-tag append", was)})
}

// ---- control plane (sidecar.Handler) ----

// Hello describes this sidecar.
func (s *Sidecar) Hello() *kvcv1.Hello {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := &kvcv1.Hello{WorkerId: s.cfg.WorkerID, Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Node: s.cfg.Node, GpuIndex: s.cfg.GPUIndex,
		WorkerUrl: s.cfg.WorkerURL, TransferEndpoint: s.eng.SegmentName(), Transport: s.cfg.Transport, PeerAddr: s.cfg.PeerAddr, Version: s.cfg.Version}
	if s.pool != nil {
		h.KvCapacityTokens = s.pool.CapacityTokens()
		h.KvBytesPerToken = s.pool.BytesPerToken()
	}
	kvxfer.HelloTP(h, s.pool, s.cfg.TPGroup)
	if s.cfg.KVCapacity > 0 {
		h.KvCapacityTokens = s.cfg.KVCapacity
	}
	return h
}

// Resync lists every snapshot held.
func (s *Sidecar) Resync() *kvcv1.ResidentSessions {
	rs := &kvcv1.ResidentSessions{}
	st := s.Store()
	if st == nil {
		return rs
	}
	for _, v := range st.List() {
		rs.Snapshots = append(rs.Snapshots, &kvcv1.SnapshotHeld{SessionId: v.Session, Seqlen: v.Seqlen, Generation: v.Generation,
			Bytes: v.Bytes, SourceWorker: v.Source, UpdatedUnixMs: v.Updated.UnixMilli()})
	}
	return rs
}

// Load reports store usage and pending rooms.
func (s *Sidecar) Load() *kvcv1.WorkerLoad {
	s.mu.Lock()
	rooms := len(s.rooms) + len(s.seeds)
	s.mu.Unlock()
	l := &kvcv1.WorkerLoad{TransferQueueDepth: int32(rooms)}
	if st := s.Store(); st != nil {
		l.SnapshotBytesUsed = st.UsedBytes()
		l.SnapshotBytesCapacity = st.CapacityBytes()
		l.SnapshotSessions = int32(len(st.List()))
	}
	return l
}

// Policy records the current policy.
func (s *Sidecar) Policy(p *kvcv1.Policy) {
	s.mu.Lock()
	s.policy = p
	s.mu.Unlock()
}

// Apply handles PushSnapshotCommand (reseed via snapshot); other commands are for decode sidecars.
func (s *Sidecar) Apply(_ context.Context, cmd *kvcv1.Command) error {
	switch a := cmd.GetAction().(type) {
	case *kvcv1.Command_PushSnapshot:
		return s.pushSnapshot(a.PushSnapshot)
	default: // DrainCommand too: a prefill worker's drain only stops new work going to it
		return fmt.Errorf("command %T is not for a prefill sidecar", a)
	}
}

func (s *Sidecar) pushSnapshot(c *kvcv1.PushSnapshotCommand) error {
	if c.GetRoom() == 0 || c.GetSessionId() == "" {
		return fmt.Errorf("push_snapshot needs room and session_id")
	}
	st := s.Store()
	r := s.room(c.GetRoom())
	if r == nil {
		return nil // the decode side's offer came first and the room is already served
	}
	s.mu.Lock()
	r.push = c
	started := r.offer != nil
	_, have := (func() (store.View, bool) {
		if st == nil {
			return store.View{}, false
		}
		return st.Get(c.GetSessionId())
	})()
	if !started && have && !r.pinned {
		r.pinned = true
		st.Pin(c.GetSessionId())
	}
	s.mu.Unlock()
	if !have && !started {
		return fmt.Errorf("snapshot_missing: no snapshot of %s here; the offer for room %d will be failed", c.GetSessionId(), c.GetRoom())
	}
	return nil
}
