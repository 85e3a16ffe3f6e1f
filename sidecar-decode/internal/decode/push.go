package decode

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/agent"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// pushSession pushes the unpushed tail of a session to its snapshot target.
func (s *Sidecar) pushSession(ctx context.Context, id string) {
	s.mu.Lock()
	ss := s.sessions[id]
	if ss == nil || ss.gone || ss.target == nil || !s.enabled || ss.committed <= ss.lastPushed {
		if ss != nil {
			ss.queued = false
		}
		s.mu.Unlock()
		return
	}
	ss.queued = false
	pool := s.pool
	ps := int64(pool.PageSize)
	job := pushJob{session: id, target: ss.target, gen: ss.target.GetGeneration(), base: ss.lastPushed, end: ss.committed}
	job.pages = append([]int64(nil), ss.pages[:(job.end+ps-1)/ps]...)
	pctx, cancel := context.WithCancelCause(ctx)
	run := &pushRun{cancel: cancel, readDone: make(chan struct{})}
	ss.push = run
	s.inflight++
	s.mu.Unlock()

	seqlen, err := s.doPush(pctx, pool, job)
	cancel(nil)
	close(run.readDone)

	s.mu.Lock()
	s.inflight--
	ss.push = nil
	if err == nil && !ss.gone && ss.target == job.target {
		ss.lastPushed = seqlen
	}
	if err != nil {
		ss.failedLen = job.end // dropped: the old snapshot stays valid for what it covers
	}
	// A push cut off by shutdown is not re-queued: the sidecar is stopping, and re-queueing
	// would spin the worker pool until it exits.
	if !ss.gone && ctx.Err() == nil {
		s.maybeEnqueueLocked(ss)
	}
	s.mu.Unlock()
}

type pushJob struct {
	session   string
	target    *kvcv1.SetSnapshotTargetCommand
	gen       uint64
	base, end int64
	pages     []int64
}

// doPush sends [base, end) (or everything, after a base mismatch), retrying a failure once. When
// it returns, no transfer of the push reads the pages any more.
func (s *Sidecar) doPush(ctx context.Context, pool *agent.Pool, job pushJob) (int64, error) {
	fullTried := job.base == 0
	for attempt := 1; ; {
		start := time.Now()
		seqlen, moved, err := s.pushOnce(ctx, pool, job)
		ev := agent.Event{Session: job.session, Generation: job.gen, BaseLen: job.base, Tokens: job.end - job.base,
			Bytes: int64(moved), DurationMs: agent.Ms(time.Since(start)), Peer: job.target.GetPrefillWorkerId(), Attempt: attempt}
		if err == nil {
			ev.Event, ev.Seqlen = agent.EvPushSent, seqlen
			s.ev.Emit(ev)
			return seqlen, nil
		}
		ev.Reason = err.Error()
		if ctx.Err() != nil || errors.Is(err, agent.ErrAborted) {
			ev.Event = agent.EvPushAborted
			if c := context.Cause(ctx); c != nil {
				ev.Reason = c.Error()
			}
			s.ev.Emit(ev)
			return 0, err
		}
		ev.Event = agent.EvPushFailed
		s.ev.Emit(ev)
		if status.Code(err) == codes.FailedPrecondition && strings.Contains(err.Error(), "does not match the stored seqlen") && !fullTried {
			job.base, fullTried = 0, true // the store lost track: send everything
			continue
		}
		if attempt >= 2 {
			return 0, err
		}
		attempt++
	}
}

func (s *Sidecar) pushOnce(ctx context.Context, pool *agent.Pool, job pushJob) (int64, uint64, error) {
	c, err := s.peers.Client(job.target.GetPeerAddr())
	if err != nil {
		return 0, 0, err
	}
	// Control RPCs are not cut by a release (a reservation made must be known to be aborted);
	// only the transfer, which reads the pages, is.
	rpcCtx, rpcCancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.PushTimeout)
	defer rpcCancel()
	ctx, cancel := context.WithTimeout(ctx, s.cfg.PushTimeout)
	defer cancel()
	res, err := c.ReserveSnapshot(rpcCtx, &kvcv1.ReserveSnapshotRequest{SessionId: job.session, Generation: job.gen, BaseLen: job.base,
		Tokens: job.end - job.base, SourceWorkerId: s.cfg.WorkerID, SourceLayout: pool.Layout()})
	if err != nil {
		return 0, 0, fmt.Errorf("reserve: %w", err)
	}
	abort := func(reason string) {
		actx, acancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer acancel()
		if _, err := c.AbortSnapshot(actx, &kvcv1.AbortSnapshotRequest{IngestId: res.GetIngestId(), Reason: reason}); err != nil {
			s.log.Warn().Err(err).Str("session", job.session).Msg("abort snapshot ingest")
		}
	}
	if ctx.Err() != nil {
		go abort(context.Cause(ctx).Error())
		return 0, 0, fmt.Errorf("%w: %v", agent.ErrAborted, context.Cause(ctx))
	}
	ep := res.GetStoreTransferEndpoint()
	if ep == "" {
		ep = job.target.GetTransferEndpoint()
	}
	seg, err := s.segs.Open(ctx, ep)
	if err != nil {
		abort(err.Error())
		return 0, 0, err
	}
	ps := int64(pool.PageSize)
	reqs, err := agent.PlanTokens(agent.PageMap{Layout: pool.Layout(), Pages: job.pages},
		agent.PageMap{Layout: res.GetStoreLayout(), Pages: res.GetPages(), First: job.base / ps}, seg, job.base, job.end)
	if err != nil {
		abort(err.Error())
		return 0, 0, fmt.Errorf("plan: %w", err)
	}
	moved, err := agent.Transfer(ctx, s.eng, reqs)
	if err != nil {
		if !errors.Is(err, agent.ErrAborted) {
			s.segs.Forget(ep)
		}
		go abort(err.Error())
		return 0, moved, err
	}
	cres, err := c.CommitSnapshot(rpcCtx, &kvcv1.CommitSnapshotRequest{IngestId: res.GetIngestId()})
	if err != nil {
		return 0, moved, fmt.Errorf("commit: %w", err)
	}
	return cres.GetSeqlen(), moved, nil
}
