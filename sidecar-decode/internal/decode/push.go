package decode

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
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
	if ss.retagFrom != 0 && job.base > 0 {
		job.retag = ss.retagFrom // the base is the store's snapshot of that generation (a reseed)
	}
	job.pages = append([]int64(nil), ss.pages[:(job.end+ps-1)/ps]...)
	if int64(len(ss.ids)) >= job.end {
		job.ids = ss.ids[:job.end] // the commit's own slice, never written in place
		// an append sends [0, end) until the store is known to hold this session's ids of
		// [0, base): after a seed P stored, a reseed's base, a new target
		job.idsFrom0 = !ss.idsPushed
	}
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
	if job.end >= ss.committed {
		// the forced push carried the newest commit; a commit that came while it ran keeps
		// the force, so its tail goes out too (an idle flush fires only once)
		ss.forcePush = false
	}
	if err == nil && !ss.gone && ss.target == job.target {
		ss.lastPushed = seqlen
		ss.retagFrom = 0              // the store's entry is this generation's now
		ss.idsPushed = job.ids != nil // the entry holds the ids of [0, seqlen) now, or none
	}
	if err != nil {
		ss.failedLen = job.end // dropped: the old snapshot stays valid for what it covers
	}
	s.pushLandedLocked(err == nil)
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
	retag     uint64 // ≠ 0: base is the store's snapshot of this generation (re-tag on append)
	pages     []int64
	ids       []int32 // the token ids of [0, end), or nil: each attempt sends those of its range
	idsFrom0  bool    // an append sends the ids of [0, end), not only of [base, end)
}

// doPush sends [base, end) (or everything, after a base mismatch), retrying a failure once. When
// it returns, no transfer of the push reads the pages any more.
func (s *Sidecar) doPush(ctx context.Context, pool *kvxfer.Pool, job pushJob) (int64, error) {
	fullTried := job.base == 0
	for attempt := 1; ; {
		start := time.Now()
		var ph sidecar.PushPhases
		seqlen, moved, err := s.pushOnce(ctx, pool, job, &ph)
		ev := sidecar.Event{Session: job.session, Generation: job.gen, BaseLen: job.base, Tokens: job.end - job.base,
			Bytes: int64(moved), DurationMs: sidecar.Ms(time.Since(start)), Peer: job.target.GetPrefillWorkerId(), Attempt: attempt,
			RetagFrom: job.retag}
		if err == nil {
			ev.Event, ev.Seqlen, ev.Phases = sidecar.EvPushSent, seqlen, &ph
			s.ev.Emit(ev)
			return seqlen, nil
		}
		ev.Reason = err.Error()
		if ctx.Err() != nil || errors.Is(err, kvxfer.ErrAborted) {
			ev.Event = sidecar.EvPushAborted
			if c := context.Cause(ctx); c != nil {
				ev.Reason = c.Error()
			}
			s.ev.Emit(ev)
			return 0, err
		}
		ev.Event = sidecar.EvPushFailed
		s.ev.Emit(ev)
		// The retry decision reads the store's typed refusal (kvxfer.PeerError in the status
		// details), never its message.
		switch err = kvxfer.TypedPeerError(err); {
		case errors.Is(err, kvxfer.ErrBaseMismatch) && !fullTried:
			job.base, job.retag, fullTried = 0, 0, true // the store lost track: send everything
			continue
		case errors.Is(err, kvxfer.ErrGenerationStale):
			return 0, err // the store holds a newer residency of the session: this one is stale
		}
		if attempt >= 2 {
			return 0, err
		}
		attempt++
	}
}

// pendingAborts tracks AbortSnapshot calls that run in the background (after a push cut off by
// a release or shutdown, so that the release does not wait for an RPC), so that a later
// reservation for the same session waits until the store has dropped the old one instead of
// being refused with "already has ingest N in flight". The zero value is ready.
type pendingAborts struct {
	mu sync.Mutex
	m  map[string]chan struct{}
}

// start registers an abort for session and returns the function that marks it finished.
func (p *pendingAborts) start(session string) func() {
	done := make(chan struct{})
	p.mu.Lock()
	if p.m == nil {
		p.m = map[string]chan struct{}{}
	}
	prev := p.m[session]
	p.m[session] = done
	p.mu.Unlock()
	return func() {
		if prev != nil {
			<-prev // keep the order: a later abort finishes after an earlier one
		}
		p.mu.Lock()
		if p.m[session] == done {
			delete(p.m, session)
		}
		p.mu.Unlock()
		close(done)
	}
}

// wait blocks until no abort of session is running or ctx ends.
func (p *pendingAborts) wait(ctx context.Context, session string) error {
	p.mu.Lock()
	done := p.m[session]
	p.mu.Unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// readyEventer is an engine that can mark every copy submitted so far with an event another
// process waits on (rdma.CUDAEngine): the push then commits while the copy runs.
type readyEventer interface {
	ReadyEvent(batches ...rdma.BatchID) ([]byte, func(), error)
}

type commitResult struct {
	res *kvcv1.CommitSnapshotResponse
	err error
}

// transferRun is one TokenPlan transfer of a push, run by startTransfer: done closes when it
// returned; early, when not nil, receives the result of the commit sent with its ready event.
type transferRun struct {
	done   chan struct{}
	moved  uint64
	err    error
	early  chan commitResult
	t2, t3 time.Time
}

// startTransfer runs plan into seg in a goroutine. With an engine that has ready events (cuda),
// the commit of ingest goes out right after the last submission, carrying the event.
func (s *Sidecar) startTransfer(ctx, rpcCtx context.Context, c kvcv1.TransferPeerServiceClient, plan *kvxfer.TokenPlan, seg rdma.SegmentID, ingest uint64, session string) *transferRun {
	r := &transferRun{done: make(chan struct{}), t2: time.Now()}
	go func() {
		defer close(r.done)
		r.moved, r.err = plan.TransferThen(ctx, s.eng, seg, func(batches []rdma.BatchID) {
			re, ok := s.eng.(readyEventer)
			if !ok {
				return
			}
			h, release, err := re.ReadyEvent(batches...)
			if err != nil {
				s.log.Debug().Err(err).Str("session", session).Msg("no ready event: commit after the copy")
				return
			}
			r.early = make(chan commitResult, 1)
			go func() {
				res, err := c.CommitSnapshot(rpcCtx, &kvcv1.CommitSnapshotRequest{IngestId: ingest, ReadyEvent: h})
				release() // the store has answered: it no longer waits on the event
				r.early <- commitResult{res, err}
			}()
		})
		r.t3 = time.Now()
	}()
	return r
}

// abortTimeout bounds one AbortSnapshot call.
const abortTimeout = 5 * time.Second

// pushOnce runs one attempt; ph receives the durations of its steps.
func (s *Sidecar) pushOnce(ctx context.Context, pool *kvxfer.Pool, job pushJob, ph *sidecar.PushPhases) (int64, uint64, error) {
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
	// A reservation of an earlier attempt being aborted in the background must be gone first.
	if err := s.aborts.wait(rpcCtx, job.session); err != nil {
		return 0, 0, fmt.Errorf("reserve: waiting for the previous reservation's abort: %w", err)
	}
	addr := job.target.GetPeerAddr()
	ps := int64(pool.PageSize)
	req := &kvcv1.ReserveSnapshotRequest{SessionId: job.session, Generation: job.gen, BaseLen: job.base, RetagFromGeneration: job.retag,
		Tokens: job.end - job.base, SourceWorkerId: s.cfg.WorkerID, SourceLayout: pool.Layout(),
		// binds the reservation to this engine: the store's write guard refuses other writers
		SourceTransferEndpoint: s.eng.SegmentName(),
		// keep a standing credit at the store, so that the next full push starts copying at once
		CreditPages: max(s.cfg.SnapshotCreditPages, 0)}
	if job.ids != nil {
		from := job.base
		if job.idsFrom0 {
			from = 0
		}
		req.TokenIds = job.ids[from:job.end] // the store keeps them with the entry (SnapshotTokens)
	}
	// A full push with store credit copies its first tokens into the credit pages while its
	// reservation is on the way (credit.go).
	var cr *peerCredit
	if job.base == 0 && s.cfg.SnapshotCreditPages > 0 {
		if cr = s.credits.claim(addr, time.Now()); cr != nil {
			// the credit belongs to the segment it came with: a re-opened segment (a restarted
			// store, or one forgotten after a failure) drops it
			if seg, err := s.segs.Open(ctx, cr.endpoint); err != nil || seg != cr.seg {
				s.credits.settle(addr, nil)
				cr = nil
			}
		}
	}
	t0 := time.Now()
	var res *kvcv1.ReserveSnapshotResponse
	var creditTokens int64
	var creditMoved uint64
	var creditErr error
	var plan *kvxfer.TokenPlan // the rest's plan, made while the credit copy runs
	var planErr error
	var rest *transferRun   // the rest's transfer, started behind the credit copy
	var creditEnd time.Time // when the credit copy was done (the rest may have started before)
	if cr != nil {
		k := min(int64(len(cr.pages)), (job.end+ps-1)/ps)
		creditTokens = min(k*ps, job.end)
		req.UseCreditPages, req.CreditId = k, cr.id
		type reply struct {
			res *kvcv1.ReserveSnapshotResponse
			err error
			at  time.Time
		}
		rc := make(chan reply, 1)
		go func() {
			r, err := c.ReserveSnapshot(kvxfer.WithTP(rpcCtx, pool), req)
			rc <- reply{r, err, time.Now()}
		}()
		// Tokens [0, creditTokens) into the credit pages. Once they are submitted, the hook
		// waits for the reservation and plans the rest while they copy; this copy is waited for
		// here, so the commit's ready event (if any) needs to cover only the rest.
		var rep reply
		got := false
		await := func(creditBatches []rdma.BatchID) {
			rep, got = <-rc, true
			if rep.err != nil {
				return
			}
			tp := time.Now()
			plan, planErr = kvxfer.PlanRuns(kvxfer.PageMap{Layout: pool.Layout(), Pages: job.pages},
				kvxfer.PageMap{Layout: rep.res.GetStoreLayout(), Pages: rep.res.GetPages()}, creditTokens, job.end)
			ph.PlanMs = sidecar.Ms(time.Since(tp))
			if planErr != nil || creditBatches == nil || ctx.Err() != nil {
				return
			}
			ep := rep.res.GetStoreTransferEndpoint()
			if ep == "" {
				ep = job.target.GetTransferEndpoint()
			}
			if checkCreditUse(rep.res, cr, ep, int(k)) != nil {
				return // handled below, after the credit copy
			}
			if re, ok := s.eng.(readyEventer); ok {
				// the rest's ready event will cover the credit copy too: none of its tasks
				// may have been refused (ReadyEvent checks)
				if _, release, err := re.ReadyEvent(creditBatches...); err != nil {
					return
				} else {
					release()
				}
			}
			// Submit the rest now, behind the credit copy on the same stream, so the GPU does
			// not drain between the two; its ready event and commit follow its submission.
			rest = s.startTransfer(ctx, rpcCtx, c, plan, cr.seg, rep.res.GetIngestId(), job.session)
		}
		cplan, err := kvxfer.PlanRuns(kvxfer.PageMap{Layout: pool.Layout(), Pages: job.pages},
			kvxfer.PageMap{Layout: cr.layout, Pages: cr.pages[:k]}, 0, creditTokens)
		if err == nil {
			creditMoved, err = cplan.TransferThen(ctx, s.eng, cr.seg, await)
		}
		creditErr = err
		creditEnd = time.Now()
		ph.CreditMs, ph.CreditTokens, ph.ReserveOverlapped = sidecar.Ms(creditEnd.Sub(t0)), creditTokens, true
		if !got { // the hook did not run (the copy failed to start)
			await(nil)
		}
		if rest != nil && (err != nil || rep.err != nil) {
			// the rest must stop reading the pages before anything is aborted
			cancel()
			<-rest.done
		}
		ph.ReserveMs = sidecar.Ms(rep.at.Sub(t0))
		if rep.err != nil {
			s.credits.settle(addr, nil)
			if creditErr != nil && !errors.Is(creditErr, kvxfer.ErrAborted) {
				s.segs.Forget(cr.endpoint)
			}
			return 0, creditMoved, fmt.Errorf("reserve (with %d credit pages): %w", k, rep.err)
		}
		res = rep.res
	} else {
		res, err = c.ReserveSnapshot(kvxfer.WithTP(rpcCtx, pool), req)
		if err != nil {
			return 0, 0, fmt.Errorf("reserve: %w", err)
		}
		ph.ReserveMs = sidecar.Ms(time.Since(t0))
	}
	abort := func(reason string) {
		actx, acancel := context.WithTimeout(context.Background(), abortTimeout)
		defer acancel()
		if _, err := c.AbortSnapshot(actx, &kvcv1.AbortSnapshotRequest{IngestId: res.GetIngestId(), Reason: reason}); err != nil {
			s.log.Warn().Err(err).Str("session", job.session).Msg("abort snapshot ingest")
		}
	}
	// abortAsync aborts in the background (the push was cut off: its caller, a release, must
	// not wait for an RPC); the next reservation of the session waits for it.
	abortAsync := func(reason string) {
		finished := s.aborts.start(job.session)
		go func() {
			defer finished()
			abort(reason)
		}()
	}
	ep := res.GetStoreTransferEndpoint()
	if ep == "" {
		ep = job.target.GetTransferEndpoint()
	}
	if cr != nil {
		if creditErr == nil {
			creditErr = checkCreditUse(res, cr, ep, int(req.GetUseCreditPages()))
		}
		if creditErr != nil {
			s.credits.settle(addr, nil)
			if errors.Is(creditErr, kvxfer.ErrAborted) {
				abortAsync(creditErr.Error())
				return 0, creditMoved, creditErr
			}
			s.segs.Forget(cr.endpoint)
			abort(creditErr.Error())
			return 0, creditMoved, fmt.Errorf("credit: %w", creditErr)
		}
		s.credits.settle(addr, creditFrom(res, ep, cr.seg, time.Now()))
	}
	// With the rest already copying into this reservation (started behind the credit copy, to
	// the credit's segment), its outcome decides below, as for a transfer started there.
	if rest == nil && ctx.Err() != nil {
		abortAsync(context.Cause(ctx).Error())
		return 0, creditMoved, fmt.Errorf("%w: %v", kvxfer.ErrAborted, context.Cause(ctx))
	}
	var seg rdma.SegmentID
	if rest == nil {
		if seg, err = s.segs.Open(ctx, ep); err != nil {
			abort(err.Error())
			return 0, creditMoved, err
		}
	} else {
		seg = cr.seg
	}
	if cr == nil && s.cfg.SnapshotCreditPages > 0 {
		s.credits.offer(addr, creditFrom(res, ep, seg, time.Now()))
	}
	// The runs are checked against both page maps before any byte moves; the requests are then
	// laid out a few buffers at a time while the engine copies the previous ones. With credit,
	// tokens [0, creditTokens) are already in the reservation's first pages and the rest was
	// planned during their copy.
	if cr == nil {
		t1 := time.Now()
		plan, planErr = kvxfer.PlanRuns(kvxfer.PageMap{Layout: pool.Layout(), Pages: job.pages},
			kvxfer.PageMap{Layout: res.GetStoreLayout(), Pages: res.GetPages(), First: job.base / ps}, job.base, job.end)
		ph.PlanMs = sidecar.Ms(time.Since(t1))
	}
	if planErr != nil {
		abort(planErr.Error())
		return 0, creditMoved, fmt.Errorf("plan: %w", planErr)
	}
	// With an engine that can mark its copies with an interprocess event (cuda), the commit
	// goes out right after the last submission, carrying the event: the store waits for the
	// event before it commits, so the answer still means every byte landed, while the RPC's
	// round trip overlaps the copy instead of following it.
	if rest == nil {
		rest = s.startTransfer(ctx, rpcCtx, c, plan, seg, res.GetIngestId(), job.session)
	}
	<-rest.done
	moved, err, early, t3 := rest.moved, rest.err, rest.early, rest.t3
	// The rest's time on the critical path: from its start, or, when it was started behind
	// the credit copy, from the end of that copy (CreditMs covers what came before).
	ph.TransferMs = sidecar.Ms(t3.Sub(rest.t2))
	if rest.t2.Before(creditEnd) {
		ph.TransferMs = sidecar.Ms(max(0, t3.Sub(creditEnd)))
		if t3.Before(creditEnd) { // the rest ended first (or was empty): the commit follows both
			t3 = creditEnd
		}
	}
	if early != nil {
		cr := <-early
		ph.CommitMs = sidecar.Ms(time.Since(t3)) // what the commit added after the copy
		switch {
		case cr.err == nil:
			// The store saw the event complete: every copy before it ran (a copy cut off by a
			// release still runs to the end on the GPU, and a refused one makes ReadyEvent
			// fail), so the snapshot it committed is whole even if the local Wait failed.
			if err != nil {
				s.log.Warn().Err(err).Str("session", job.session).Msg("push: local wait failed after the store committed on the ready event")
			}
			return cr.res.GetSeqlen(), creditMoved + plan.Bytes(), nil
		case err == nil:
			abort(cr.err.Error()) // no-op when the store already dropped the ingest
			return 0, creditMoved + moved, fmt.Errorf("commit: %w", cr.err)
		}
		// both failed: handled as a failed transfer below (abort, forget the segment)
	}
	if err != nil {
		if !errors.Is(err, kvxfer.ErrAborted) {
			s.segs.Forget(ep)
			// A retry may follow at once: the store must have dropped this reservation first.
			abort(err.Error())
		} else {
			abortAsync(err.Error())
		}
		return 0, creditMoved + moved, err
	}
	cres, err := c.CommitSnapshot(rpcCtx, &kvcv1.CommitSnapshotRequest{IngestId: res.GetIngestId()})
	ph.CommitMs = sidecar.Ms(time.Since(t3))
	if err != nil {
		return 0, creditMoved + moved, fmt.Errorf("commit: %w", err)
	}
	return cres.GetSeqlen(), creditMoved + moved, nil
}

// checkCreditUse checks that a reservation made with use credit pages starts with exactly the
// credit pages the push copied into, at the store (endpoint and layout) they came from.
func checkCreditUse(res *kvcv1.ReserveSnapshotResponse, cr *peerCredit, ep string, use int) error {
	switch {
	case ep != cr.endpoint:
		return fmt.Errorf("the store answered from endpoint %s, the credit is at %s", ep, cr.endpoint)
	case !slices.Equal(res.GetStoreLayout().GetBufferAddrs(), cr.layout.GetBufferAddrs()):
		return errors.New("the store's layout changed since the credit was granted")
	case len(res.GetPages()) < use || !slices.Equal(res.GetPages()[:use], cr.pages[:use]):
		return fmt.Errorf("the reservation's %d pages do not start with the %d credit pages used", len(res.GetPages()), use)
	}
	return nil
}
