package prefill

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// LoadFromStore is the prefill from the snapshot (RouteExecution.load_prefix_tokens): it copies
// tokens [0, tokens) of the session's snapshot in this sidecar's own store into the worker's
// pages through the engine (this sidecar's own segment), so that the worker prefills only the
// rest of the prompt. The entry is held for reading while it is copied (Acquire: neither
// evicted nor cut back by a re-tag meanwhile). Refusals: NOT_FOUND (no snapshot),
// FAILED_PRECONDITION with a PeerError — SNAPSHOT_CHANGED (the store holds another generation
// than the decision saw) or BASE_MISMATCH (it holds fewer tokens); the worker then prefills
// the whole context.
func (s *Sidecar) LoadFromStore(ctx context.Context, req *kvcv1.LoadFromStoreRequest) (*kvcv1.LoadFromStoreResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil || req.GetSessionId() == "" {
		return nil, status.Errorf(codes.InvalidArgument, "load from the store needs a session id: %v", err)
	}
	if req.GetTokens() <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "tokens %d must be positive", req.GetTokens())
	}
	s.mu.Lock()
	pool := s.pool
	s.mu.Unlock()
	if pool == nil {
		return nil, status.Error(codes.FailedPrecondition, "no KV pool registered")
	}
	ps := int64(pool.PageSize)
	if int64(len(req.GetPages())) < (req.GetTokens()+ps-1)/ps {
		return nil, status.Errorf(codes.InvalidArgument, "%d pages do not cover %d tokens", len(req.GetPages()), req.GetTokens())
	}
	if err := pool.CheckPages(req.GetPages()); err != nil {
		return nil, err
	}
	st, arena, err := s.storeAndArena()
	if err != nil {
		return nil, err
	}
	miss := func(c codes.Code, d *kvcv1.PeerError, format string, a ...any) error {
		reason := fmt.Sprintf(format, a...)
		s.ev.Emit(sidecar.Event{Event: sidecar.EvStoreLoadMiss, Session: req.GetSessionId(), Generation: req.GetGeneration(),
			Tokens: req.GetTokens(), Reason: reason})
		if d == nil {
			return status.Error(c, reason)
		}
		return kvxfer.PeerStatus(c, d, "%s", reason)
	}
	v, release, ok := st.Acquire(req.GetSessionId())
	if !ok {
		return nil, miss(codes.NotFound, nil, "no snapshot of session %s in the store", req.GetSessionId())
	}
	defer release()
	if g := req.GetGeneration(); g != 0 && v.Generation != g {
		return nil, miss(codes.FailedPrecondition, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_SNAPSHOT_CHANGED,
			StoredSeqlen: v.Seqlen, StoredGeneration: v.Generation},
			"the store holds generation %d of session %s, not %d", v.Generation, req.GetSessionId(), g)
	}
	if v.Seqlen < req.GetTokens() {
		return nil, miss(codes.FailedPrecondition, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH,
			StoredSeqlen: v.Seqlen, StoredGeneration: v.Generation},
			"the store holds %d tokens of session %s, fewer than %d", v.Seqlen, req.GetSessionId(), req.GetTokens())
	}
	start := time.Now()
	self := s.eng.SegmentName()
	seg, err := s.segs.Open(ctx, self)
	var moved uint64
	if err == nil {
		var plan *kvxfer.TokenPlan
		plan, err = kvxfer.PlanRuns(kvxfer.PageMap{Layout: arena.Layout(), Pages: v.Pages},
			kvxfer.PageMap{Layout: pool.Layout(), Pages: req.GetPages()}, 0, req.GetTokens())
		if err == nil {
			moved, err = plan.Transfer(ctx, s.eng, seg)
		}
		if err != nil && !errors.Is(err, kvxfer.ErrAborted) {
			s.segs.Forget(self)
		}
	}
	if err != nil {
		return nil, miss(codes.Aborted, nil, "copying the snapshot prefix into the worker's pages: %v", err)
	}
	d := time.Since(start)
	s.ev.Emit(sidecar.Event{Event: sidecar.EvStoreLoad, Session: v.Session, Generation: v.Generation, Tokens: req.GetTokens(),
		Seqlen: v.Seqlen, Bytes: int64(moved), DurationMs: sidecar.Ms(d), Peer: s.cfg.WorkerID})
	return &kvcv1.LoadFromStoreResponse{Bytes: int64(moved), Tokens: req.GetTokens(), Generation: v.Generation, Seqlen: v.Seqlen,
		DurationUs: d.Microseconds()}, nil
}

// memRange is [lo, hi) of this process's memory.
type memRange struct{ lo, hi uint64 }

// poolRangesOf is the memory of each buffer of the worker's pool.
func poolRangesOf(p *kvxfer.Pool) *[]memRange {
	l := p.Layout()
	n := uint64(l.GetItemLen()) * uint64(l.GetPageCount())
	rs := make([]memRange, 0, len(l.GetBufferAddrs()))
	for _, a := range l.GetBufferAddrs() {
		rs = append(rs, memRange{a, a + n})
	}
	return &rs
}

// writeGuard is the store's write guard (store.CheckWrite: peers write only the token span of
// an ingest in flight) plus this sidecar's own loopback writes into its worker's pool — the
// prefill from the snapshot's copy out of the store, which nobody else may make.
func (s *Sidecar) writeGuard(st interface {
	CheckWrite(peer string, addr, n uint64) error
}) rdma.WriteGuard {
	self := s.eng.SegmentName()
	return func(peer string, addr, n uint64) error {
		if peer == self && addr+n > addr {
			if rs := s.poolRanges.Load(); rs != nil {
				for _, r := range *rs {
					if addr >= r.lo && addr+n <= r.hi {
						return nil
					}
				}
			}
		}
		return st.CheckWrite(peer, addr, n)
	}
}
