package prefill

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

// storeSeed is a seed the worker writes into this sidecar's own snapshot store (SendKV with
// to_store): the SEED of a colocated decode worker, which then loads it like a snapshot
// (docs/sglang.md "SEED into a colocated decode worker"). Its store reservation is the ingest;
// the chunks are copied from the worker's pool into it through the engine (this sidecar's own
// segment), and the last chunk commits it as the session's full snapshot.
type storeSeed struct {
	room    int64
	session string
	gen     uint64
	tokens  int64
	ingest  uint64
	pages   []int64 // the reservation's store pages, token order from token 0

	mu     sync.Mutex // serialises the chunks
	last   time.Time  // the last chunk's arrival (the room timeout counts from it)
	bytes  int64
	closed bool
}

// sendToStore serves SendKV with to_store.
func (s *Sidecar) sendToStore(ctx context.Context, req *kvcv1.SendKVRequest, pool *kvxfer.Pool) (*kvcv1.SendKVResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil || req.GetSessionId() == "" {
		return nil, status.Errorf(codes.InvalidArgument, "to_store needs a session id: %v", err)
	}
	if req.GetGeneration() == 0 {
		return nil, status.Error(codes.InvalidArgument, "to_store needs a generation > 0")
	}
	if req.GetTokens() <= 0 {
		return nil, status.Error(codes.InvalidArgument, "to_store needs the transfer's tokens on every chunk")
	}
	ps := int64(pool.PageSize)
	if end := req.GetFirstPage() + int64(len(req.GetPages())); end > (req.GetTokens()+ps-1)/ps {
		return nil, status.Errorf(codes.InvalidArgument, "chunk ends at page %d, past the %d pages of %d tokens", end, (req.GetTokens()+ps-1)/ps, req.GetTokens())
	}
	st, arena, err := s.storeAndArena()
	if err != nil {
		return nil, err
	}
	sd, err := s.seed(req, st)
	if err != nil {
		return nil, err
	}
	sd.mu.Lock()
	defer sd.mu.Unlock()
	if sd.closed {
		return nil, status.Errorf(codes.FailedPrecondition, "room %d is already finished", req.GetRoom())
	}
	if req.GetSessionId() != sd.session || req.GetGeneration() != sd.gen || req.GetTokens() != sd.tokens {
		err := fmt.Sprintf("room %d is the store seed of %s generation %d (%d tokens); this chunk names %s generation %d (%d tokens)",
			req.GetRoom(), sd.session, sd.gen, sd.tokens, req.GetSessionId(), req.GetGeneration(), req.GetTokens())
		s.endSeed(sd, st, err)
		return nil, status.Error(codes.FailedPrecondition, err)
	}
	sd.last = s.now()
	if !st.Touch(sd.ingest) { // each chunk keeps the reservation alive for the store's reserve timeout
		// The store freed the reservation (no chunk within its reserve timeout): its pages may be
		// another's now.
		reason := "the store's reservation expired: no chunk within the store's reserve timeout"
		s.endSeed(sd, st, reason)
		return nil, status.Errorf(codes.Aborted, "room %d: store seed: %s", req.GetRoom(), reason)
	}
	from := req.GetFirstPage() * ps
	to := min((req.GetFirstPage()+int64(len(req.GetPages())))*ps, sd.tokens)
	var moved uint64
	if to > from {
		self := s.eng.SegmentName()
		seg, err := s.segs.Open(ctx, self)
		if err == nil {
			var plan *kvxfer.TokenPlan
			plan, err = kvxfer.PlanRuns(kvxfer.PageMap{Layout: pool.Layout(), Pages: req.GetPages(), First: req.GetFirstPage()},
				kvxfer.PageMap{Layout: arena.Layout(), Pages: sd.pages}, from, to)
			if err == nil {
				moved, err = plan.Transfer(ctx, s.eng, seg)
			}
			if err != nil && !errors.Is(err, kvxfer.ErrAborted) {
				s.segs.Forget(self)
			}
		}
		if err != nil {
			reason := err.Error()
			if ctx.Err() != nil {
				reason = "prefill worker went away mid-seed: " + reason
			}
			s.endSeed(sd, st, reason)
			return nil, status.Errorf(codes.Aborted, "room %d: store seed: %s", req.GetRoom(), reason)
		}
	}
	sd.bytes += int64(moved)
	if !req.GetLast() {
		return &kvcv1.SendKVResponse{Bytes: int64(moved)}, nil
	}
	sd.closed = true
	s.forgetSeed(sd)
	v, in, err := st.CommitIngest(sd.ingest)
	if err != nil {
		s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvRejected, Kind: "seed", Session: sd.session, Generation: sd.gen, Room: sd.room,
			Tokens: sd.tokens, Peer: s.cfg.WorkerID, Reason: "commit: " + err.Error()})
		return nil, err
	}
	s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvIngested, Kind: "seed", Session: v.Session, Generation: v.Generation, Room: sd.room,
		Tokens: in.Tokens, Seqlen: v.Seqlen, Bytes: sd.bytes, Peer: v.Source, DurationMs: sidecar.Ms(s.now().Sub(in.Started))})
	s.rep.Report(&kvcv1.SessionEvent{SessionId: v.Session, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED,
		KvLen: v.Seqlen, Generation: v.Generation, Bytes: v.Bytes, PeerWorker: v.Source, Detail: "seed"})
	return &kvcv1.SendKVResponse{Bytes: int64(moved), StoredSeqlen: v.Seqlen}, nil
}

// seed returns the room's store seed, reserving the store pages of the whole seed on the first
// chunk. The reservation's writer is this sidecar's own segment: the store's write guard then
// accepts the engine's loopback writes into that reservation only.
func (s *Sidecar) seed(req *kvcv1.SendKVRequest, st *store.Store) (*storeSeed, error) {
	s.mu.Lock()
	if _, done := s.finished[req.GetRoom()]; done {
		s.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "room %d is already finished", req.GetRoom())
	}
	if r, ok := s.rooms[req.GetRoom()]; ok && r.offer != nil {
		s.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "room %d is a decode room (offered by %s), not a store seed", req.GetRoom(), r.offer.GetDecodeWorkerId())
	}
	if sd, ok := s.seeds[req.GetRoom()]; ok {
		s.mu.Unlock()
		return sd, nil
	}
	s.mu.Unlock()
	if req.GetFirstPage() != 0 {
		return nil, status.Errorf(codes.FailedPrecondition, "room %d: store seed starts at page %d; the first chunk must start at page 0", req.GetRoom(), req.GetFirstPage())
	}
	res, err := st.ReserveFor(req.GetSessionId(), req.GetGeneration(), 0, req.GetTokens(), s.cfg.WorkerID, s.eng.SegmentName())
	if err != nil {
		s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvRejected, Kind: "seed", Session: req.GetSessionId(), Generation: req.GetGeneration(),
			Room: req.GetRoom(), Tokens: req.GetTokens(), Peer: s.cfg.WorkerID, Reason: err.Error()})
		return nil, err
	}
	sd := &storeSeed{room: req.GetRoom(), session: req.GetSessionId(), gen: req.GetGeneration(), tokens: req.GetTokens(),
		ingest: res.ID, pages: res.Pages, last: s.now()}
	s.mu.Lock()
	defer s.mu.Unlock()
	if other, ok := s.seeds[req.GetRoom()]; ok { // a concurrent first chunk of the same room won
		_ = st.Abort(res.ID)
		return other, nil
	}
	s.seeds[req.GetRoom()] = sd
	return sd, nil
}

// endSeed fails a store seed: its reservation is freed (the store's previous snapshot of the
// session, if any, stays valid) and the room is finished. The caller holds sd.mu.
func (s *Sidecar) endSeed(sd *storeSeed, st *store.Store, reason string) {
	sd.closed = true
	s.forgetSeed(sd)
	if err := st.Abort(sd.ingest); err != nil {
		s.log.Debug().Err(err).Uint64("ingest", sd.ingest).Msg("store seed reservation already gone")
	}
	s.ev.Emit(sidecar.Event{Event: sidecar.EvRecvRejected, Kind: "seed", Session: sd.session, Generation: sd.gen, Room: sd.room,
		Tokens: sd.tokens, Peer: s.cfg.WorkerID, Reason: reason})
}

func (s *Sidecar) forgetSeed(sd *storeSeed) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seeds[sd.room] == sd {
		delete(s.seeds, sd.room)
	}
	s.finished[sd.room] = time.Now()
}

// expireSeeds fails the store seeds without a chunk for longer than the room timeout (the worker
// stopped sending).
func (s *Sidecar) expireSeeds(now time.Time, st *store.Store) {
	var seeds []*storeSeed
	s.mu.Lock()
	for _, sd := range s.seeds {
		seeds = append(seeds, sd)
	}
	s.mu.Unlock()
	for _, sd := range seeds {
		if !sd.mu.TryLock() {
			continue // a chunk is being copied; its own deadline bounds it
		}
		if !sd.closed && now.Sub(sd.last) > s.cfg.RoomTimeout {
			s.endSeed(sd, st, "timeout: the worker never sent the last chunk of this store seed")
		}
		sd.mu.Unlock()
	}
}
