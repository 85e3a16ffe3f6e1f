package state

import (
	"context"
	"errors"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// DefaultDrainSnapshotWait is the default Config.DrainSnapshotWait.
const DefaultDrainSnapshotWait = 10 * time.Second

// ErrWorkerConnected refuses ForgetWorker of a worker whose sidecar is connected (without force).
var ErrWorkerConnected = errors.New("state: worker's sidecar is connected")

// drainOp is one worker's drain: a goroutine of the term that moves the worker's resident
// sessions off, and its progress. Every field is guarded by State.mu.
type drainOp struct {
	status *kvcv1.DrainStatus
	cancel context.CancelFunc
	// kick wakes the mover when something it waits for may have changed (a snapshot
	// ingested, a session committed or released); buffered 1, never blocks the sender.
	kick chan struct{}
	// waiting: sessions whose snapshot is not usable yet, since when the mover waits for it.
	waiting map[string]time.Time
	// targeted: sessions the mover named a snapshot target for (once per session).
	targeted map[string]struct{}
}

func (op *drainOp) wake() {
	select {
	case op.kick <- struct{}{}:
	default:
	}
}

// startDrainLocked starts (or keeps) the drain of worker e under the current term.
func (s *State) startDrainLocked(e *workerEntry) *drainOp {
	id := e.w.GetWorkerId()
	if op, ok := s.drains[id]; ok && op.status.GetActive() {
		return op
	}
	t := s.term
	ctx, cancel := context.WithCancel(t.ctx)
	op := &drainOp{
		status: &kvcv1.DrainStatus{WorkerId: id, Active: true, StartedUnixMs: time.Now().UnixMilli(),
			SessionsAtStart: int64(len(s.byDecode[id])), SessionsLeft: int64(len(s.byDecode[id]))},
		cancel: cancel, kick: make(chan struct{}, 1),
		waiting: map[string]time.Time{}, targeted: map[string]struct{}{},
	}
	s.drains[id] = op
	s.m.drains.WithLabelValues("started").Inc()
	t.drainWG.Add(1)
	go func() {
		defer t.drainWG.Done()
		s.runDrain(ctx, id, op)
	}()
	s.log.Info().Str("worker", id).Int64("sessions", op.status.SessionsAtStart).Msg("drain started: moving resident sessions off")
	return op
}

// stopDrainLocked cancels a running drain (undrain, forget).
func (s *State) stopDrainLocked(id string) {
	op, ok := s.drains[id]
	if !ok || !op.status.GetActive() {
		return
	}
	op.cancel()
	op.status.Active = false
	op.status.Cancelled = true
	op.status.FinishedUnixMs = time.Now().UnixMilli()
	op.status.WaitingForSnapshot = 0
	s.m.drains.WithLabelValues("cancelled").Inc()
}

// kickDrainLocked wakes the drain of worker w, if one runs.
func (s *State) kickDrainLocked(w string) {
	if w == "" || len(s.drains) == 0 {
		return
	}
	if w = s.unitLocked(w); w == "" { // a rank of a group: its group's drain
		return
	}
	if op, ok := s.drains[w]; ok && op.status.GetActive() {
		op.wake()
	}
}

// DrainStatus returns the progress of worker id's drain (ok false when it never drained under
// this term).
func (s *State) DrainStatus(id string) (*kvcv1.DrainStatus, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.term == nil {
		return nil, false, ErrNotLeader
	}
	op, ok := s.drains[id]
	if !ok {
		return nil, false, nil
	}
	st := proto.Clone(op.status).(*kvcv1.DrainStatus)
	if st.Active {
		st.SessionsLeft = int64(len(s.byDecode[id]))
	}
	return st, true, nil
}

// runDrain moves worker id's resident sessions off until none is left or ctx ends. A session
// is released (ReleaseSession to the worker's sidecar, residency cleared here, so its next turn
// reseeds on another decode worker) as soon as its snapshot is usable for a reseed, or
// DrainSnapshotWait after the mover first saw it without one (the next turn then re-prefills).
// A session with no snapshot at all is first given a snapshot target so its sidecar pushes one.
func (s *State) runDrain(ctx context.Context, id string, op *drainOp) {
	wait := s.cfg.DrainSnapshotWait
	for {
		next := s.drainPass(id, op, wait)
		if next < 0 {
			return
		}
		var tc <-chan time.Time
		var t *time.Timer
		if next > 0 {
			t = time.NewTimer(next)
			tc = t.C
		}
		select {
		case <-ctx.Done():
		case <-op.kick:
		case <-tc:
		}
		if t != nil {
			t.Stop()
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// drainPass releases what can be released now. It returns how long until a waiting session's
// wait runs out (0: nothing to time; wait for a kick), or -1 when the drain is over.
func (s *State) drainPass(id string, op *drainOp, wait time.Duration) time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.term.acting() || s.drains[id] != op || !op.status.GetActive() {
		return -1
	}
	e, ok := s.workers[id]
	if !ok {
		return -1
	}
	if !s.unitConnectedLocked(id) && len(s.byDecode[id]) > 0 {
		// Not connected (a new leader has not seen its sidecar yet, or the link dropped): the
		// worker cannot be told to release. Wait for its sidecar (Attach wakes the mover) or
		// the unreachable grace, which drops its residency and so finishes the drain.
		op.status.SessionsLeft = int64(len(s.byDecode[id]))
		return 0
	}
	ids := keys(s.byDecode[id])
	slices.Sort(ids)
	if len(ids) == 0 {
		s.finishDrainLocked(id, op)
		return -1
	}
	pol := s.Policy()
	ws := *s.snapshot.Load()
	now := time.Now()
	var next time.Duration
	waiting := 0
	var moved []string
	defer func() { s.lostLocked(id, moved) }() // re-homed elsewhere (router/rehome.go)
	for _, sid := range ids {
		rec := s.sessions[sid].rec
		usable := !pol.GetSnapshotsEnabled() || snapshotUsable(rec, ws, pol.GetTailToleranceTokens())
		if !usable {
			since, seen := op.waiting[sid]
			if !seen {
				since = now
				op.waiting[sid] = now
				s.targetSnapshotLocked(e, rec, op, ws)
			}
			if left := wait - now.Sub(since); left > 0 {
				waiting++
				if next == 0 || left < next {
					next = left
				}
				continue
			}
		}
		{
			cmd := &kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{
				SessionId: sid, Reason: "drain"}}}
			if err := s.sendUnitLocked(id, cmd); err != nil {
				op.status.Failed++
				s.m.drainMoves.WithLabelValues("failed").Inc()
				if next == 0 || time.Second < next {
					next = time.Second // the queue drains at the stream's pace: retry soon
				}
				continue
			}
		}
		delete(op.waiting, sid)
		rec.PreviousDecodeWorker = id
		rec.DecodeWorker = ""
		s.changedLocked(rec, id, rec.GetSnapshot().GetPrefillWorker())
		moved = append(moved, sid)
		if usable && pol.GetSnapshotsEnabled() {
			op.status.MovedWithSnapshot++
			s.m.drainMoves.WithLabelValues("with_snapshot").Inc()
		} else {
			op.status.MovedWithoutSnapshot++
			s.m.drainMoves.WithLabelValues("without_snapshot").Inc()
		}
	}
	op.status.SessionsLeft = int64(len(s.byDecode[id]))
	op.status.WaitingForSnapshot = int64(waiting)
	if op.status.SessionsLeft == 0 {
		s.finishDrainLocked(id, op)
		return -1
	}
	return next
}

// finishDrainLocked marks op finished: nothing is resident on worker id any more. The worker
// stays draining (not routable for new sessions) until undrained or forgotten.
func (s *State) finishDrainLocked(id string, op *drainOp) {
	op.status.Active = false
	op.status.SessionsLeft = 0
	op.status.WaitingForSnapshot = 0
	op.status.FinishedUnixMs = time.Now().UnixMilli()
	clear(op.waiting)
	s.m.drains.WithLabelValues("finished").Inc()
	s.log.Info().Str("worker", id).Int64("with_snapshot", op.status.MovedWithSnapshot).
		Int64("without_snapshot", op.status.MovedWithoutSnapshot).Int64("failed", op.status.Failed).
		Dur("took", time.Since(time.UnixMilli(op.status.StartedUnixMs))).Msg("drain finished: no session resident")
}

// snapshotUsable reports whether rec's snapshot can reseed the session's next turn on another
// decode worker: held by a prefill worker whose sidecar is connected, and within the tail
// tolerance of the committed length (the router's RESEED_SNAPSHOT rule for a prompt of
// kv_committed_len tokens).
func snapshotUsable(rec *kvcv1.SessionRecord, ws []*kvcv1.Worker, tail int64) bool {
	sn := rec.GetSnapshot()
	if sn == nil || sn.GetPrefillWorker() == "" || sn.GetSeqlen() <= 0 {
		return false
	}
	if sn.GetSeqlen() < rec.GetKvCommittedLen()-tail || (sn.GetGeneration() != 0 && rec.GetGeneration() != 0 && sn.GetGeneration() != rec.GetGeneration()) {
		return false
	}
	for _, w := range ws {
		if w.GetWorkerId() == sn.GetPrefillWorker() {
			st := w.GetState()
			return st != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE && st != kvcv1.WorkerState_WORKER_STATE_UNSPECIFIED
		}
	}
	return false
}

// targetSnapshotLocked names a snapshot target for a session that has no snapshot (or one on a
// prefill worker that is gone), so its decode sidecar pushes one the drain can release it
// with. Once per session and drain.
func (s *State) targetSnapshotLocked(e *workerEntry, rec *kvcv1.SessionRecord, op *drainOp, ws []*kvcv1.Worker) {
	sid := rec.GetSessionId()
	id := e.w.GetWorkerId()
	if _, done := op.targeted[sid]; done || !s.unitConnectedLocked(id) {
		return
	}
	op.targeted[sid] = struct{}{}
	cur := rec.GetSnapshot().GetPrefillWorker()
	t, p := policy.TargetCommand(ws, policy.Target{Session: sid, Generation: rec.GetGeneration(), Current: cur, TP: tpSize(e.w)})
	if p == nil || p.GetWorkerId() == cur {
		return // the sidecar already pushes there; its next push catches up (or the wait runs out)
	}
	// The session's agent hints are the sidecar's apart from its target: a new target keeps
	// its pin (SetSessionHintsCommand).
	cmd := &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: t}}
	if err := s.sendUnitLocked(id, cmd); err != nil {
		s.log.Warn().Err(err).Str("session", sid).Str("worker", id).Msg("drain: snapshot target not sent")
	}
}

// ForgetWorker removes a worker and its residency: sessions resident on it become not
// resident, snapshots on it are cleared, its record is deleted from etcd (write-behind; call
// Flush to wait). It refuses a worker whose sidecar is connected unless force is set; then the
// stream is ended. It returns how many sessions it unbound and how many snapshots it dropped.
func (s *State) ForgetWorker(id string, force bool) (unbound, snaps int, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.term.acting() {
		return 0, 0, ErrNotLeader
	}
	e, ok := s.workers[id]
	if !ok {
		return 0, 0, ErrUnknownWorker
	}
	if e.stream != nil && !force {
		return 0, 0, ErrWorkerConnected
	}
	if u := s.unitLocked(id); u != "" { // a rank's: its group's (tp.go)
		unbound, snaps = len(s.byDecode[u]), len(s.bySnap[u])
	}
	s.dropResidencyLocked(id)
	s.stopDrainLocked(id)
	delete(s.drains, id)
	if e.grace != nil {
		e.grace.Stop()
		e.grace = nil
	}
	if e.stream != nil {
		e.stream.close()
		e.stream = nil
	}
	e.gen++
	delete(s.workers, id)
	s.publishWorkersLocked()
	if err := s.term.batcher.Delete(s.cfg.Store.WorkerKey(id)); err != nil {
		s.m.writeFailures.Inc()
	}
	s.m.forgotten.Inc()
	s.log.Warn().Str("worker", id).Bool("force", force).Int("sessions_unbound", unbound).Int("snapshots_dropped", snaps).Msg("worker forgotten")
	return unbound, snaps, nil
}
