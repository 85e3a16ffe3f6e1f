package router

import (
	"sync"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/grpc/codes"
)

// extendsSession: the decision's decode worker serves the session where it is resident and
// keeps it (DIRECT_TO_D, or a REAL_LARGE_APPEND fallback onto the session's own D): the
// execution plan keeps the session without opening it.
func (r *reservation) extendsSession() bool { return r.decode != "" && r.keep && !r.opens }

func (s *Service) outcome(o *kvcv1.RouteOutcome) *kvcv1.RouteResponse {
	if err := validateOutcome(o); err != nil {
		return s.errResp("", o.DecisionId, codes.InvalidArgument, err.Error())
	}
	seq, ok := s.parseID(o.DecisionId)
	if !ok {
		return s.errResp("", o.DecisionId, codes.NotFound, "unknown decision id (not issued by this leader)")
	}
	nowMs := s.clock().UnixMilli()
	s.mu.Lock()
	r, ok := s.led.remove(seq)
	if ok && o.Success && r.holdsDecode() {
		s.led.settle(r.decode, r.tokens, nowMs)
	}
	issued := seq <= s.nextSeq
	late := false
	if !ok {
		r, late = s.late.take(seq)
	}
	s.mu.Unlock()
	if late {
		// The reservation expired (its tokens are released); what the turn did still counts.
		s.m.lateOutcomes.Inc()
		s.apply(r, o, nowMs)
		return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_OutcomeAck{OutcomeAck: &kvcv1.OutcomeAck{DecisionId: o.DecisionId}}}
	}
	if !ok {
		if issued {
			return s.errResp("", o.DecisionId, codes.FailedPrecondition, "decision already completed")
		}
		return s.errResp("", o.DecisionId, codes.NotFound, "unknown decision id")
	}
	s.apply(r, o, nowMs)
	return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_OutcomeAck{OutcomeAck: &kvcv1.OutcomeAck{DecisionId: o.DecisionId}}}
}

// apply carries out an outcome's effects; r's reservation is already released.
func (s *Service) apply(r *reservation, o *kvcv1.RouteOutcome, nowMs int64) {
	kind := o.ErrorKind
	if o.Success {
		kind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE
	}
	s.m.outcome(r.mode, kind)
	exec := o.ExecutedMode
	if exec == kvcv1.RouteMode_ROUTE_MODE_UNSPECIFIED {
		exec = r.mode
	}
	if o.Success && o.TtftUs > 0 {
		s.m.observeTTFT(exec, float64(o.TtftUs)/1e6)
	}
	// kv_committed_len has one writer: the decode worker's commit, reported by its sidecar
	// (COMMITTED) and by the worker's own kv_len_after in the outcome. Without it the outcome
	// only guarantees the input is committed (a floor; input + max_output would overstate
	// after an early stop).
	kvLen := o.KvLenAfter
	switch {
	case o.Success && exec == r.mode && r.opens && r.decode != "":
		s.resident(r, o, kvLen, nowMs)
	case o.Success && exec == r.mode && r.extendsSession() && (r.truncate > 0 || o.TruncatedTo > 0):
		// D rewrote the session from a token on (released it on its sidecar and committed it
		// anew): a new KV generation, with a new snapshot target, as after a reseed.
		s.m.truncations.Inc()
		s.resident(r, o, kvLen, nowMs)
	case o.Success && exec == r.mode && r.extendsSession():
		x := s.updateSession(r, o, kvLen, nowMs, (*outcomeCtx).extended)
		kept := x.kept
		x.release()
		if kept {
			s.sendHints(r, s.grantHints(r, nowMs))
		}
	case !o.Success && kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D && r.decode != "" && r.keep:
		s.updateSession(r, nil, kvLen, nowMs, (*outcomeCtx).rejected).release()
		s.m.rejected.WithLabelValues(r.decode, "d").Inc()
	case !o.Success && kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT && r.decode != "":
		// D says it does not hold the session (it evicted it; its EVICTED event may still be on
		// the way): drop the residency now, so that the retry reseeds instead of coming back.
		s.updateSession(r, nil, kvLen, nowMs, (*outcomeCtx).notResident).release()
		s.m.rejected.WithLabelValues(r.decode, "not_resident").Inc()
	case !o.Success && kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED &&
		r.mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT:
		// A failed snapshot is not trusted again: the next reseed re-prefills.
		s.updateSession(r, nil, kvLen, nowMs, (*outcomeCtx).snapshotFailed).release()
	}
}

// outcomeCtx carries an outcome's effect on its session record into Cluster.UpdateSession
// without a closure allocation per outcome: pooled, with its callback bound once.
type outcomeCtx struct {
	r      *reservation
	s      *Service
	o      *kvcv1.RouteOutcome // a successful turn's outcome: learn its content (nil: nothing to learn)
	learn  bool                // the effect left the session resident on r.decode: learn o's content
	kvLen  int64
	nowMs  int64
	effect func(x *outcomeCtx, rec *kvcv1.SessionRecord)
	// results of resident
	gen   uint64
	moved bool
	// stale: another decode worker the record named when the seed or reseed landed (one that
	// re-reported the session meanwhile, e.g. after its sidecar restarted): its copy is stale.
	stale string
	kept  bool // extended: the session was still on the outcome's D
	snapP string
	// becameResident: the session's agent hints, for its new D's snapshot target
	until int64
	low   bool
	// term: the leader's generation term, read before UpdateSession (fn must not call the
	// Cluster): becameResident's new generation is in its range.
	term uint64
	fn   func(rec *kvcv1.SessionRecord) // x.apply, bound once per pooled outcomeCtx
}

var outcomePool = sync.Pool{New: func() any {
	x := new(outcomeCtx)
	x.fn = x.apply
	return x
}}

func (x *outcomeCtx) apply(rec *kvcv1.SessionRecord) {
	x.effect(x, rec)
	if x.learn && x.o != nil {
		x.learnContent(rec)
	}
}

// learnContent records the session's content after a successful turn that left it resident on
// r.decode (content.go) and persists its compact chain in the record, in the same update as
// the committed length it describes (contentrecord.go). Without hashes in the query, or
// without the KV length, the control plane forgets what it knew: the KV changed in a way it
// cannot see.
func (x *outcomeCtx) learnContent(rec *kvcv1.SessionRecord) {
	r, o := x.r, x.o
	var e *contentEntry
	switch {
	case r.reason == kvcv1.RouteReason_ROUTE_REASON_REHOME && r.pageSize == 0:
		// A re-home has no query: what the new decode worker loaded is the snapshot, whose
		// pages the session's entry knows (content.go, rehomed).
		e = x.s.content.rehomed(r.session, r.decode, o.KvLenAfter, r.snapGen, rec.Generation)
	case r.pageSize > 0 && o.KvLenAfter > 0:
		e = x.s.content.record(r.session, r.decode, r.pageSize, r.prompt, o.KvPages, o.KvLenAfter, rec.Generation)
	default:
		x.s.content.forget(r.session)
	}
	if e == nil {
		rec.ContentChain = nil
		return
	}
	rec.ContentChain = encodeChain(e)
}

// updateSession runs effect on r's session record inside Cluster.UpdateSession (which calls
// it synchronously and keeps no reference to it) and returns the context for its results;
// the caller hands it back with release.
func (s *Service) updateSession(r *reservation, o *kvcv1.RouteOutcome, kvLen, nowMs int64, effect func(*outcomeCtx, *kvcv1.SessionRecord)) *outcomeCtx {
	x := outcomePool.Get().(*outcomeCtx)
	fn := x.fn
	*x = outcomeCtx{r: r, s: s, o: o, kvLen: kvLen, nowMs: nowMs, effect: effect, fn: fn, term: s.c.GenerationTerm()}
	s.c.UpdateSession(r.session, fn)
	return x
}

func (x *outcomeCtx) release() {
	fn := x.fn
	*x = outcomeCtx{fn: fn} // drop references before reuse
	outcomePool.Put(x)
}

// extended: a DIRECT_TO_D turn (or a large append onto the session's own D) succeeded.
func (x *outcomeCtx) extended(rec *kvcv1.SessionRecord) {
	if rec.DecodeWorker != x.r.decode {
		return // moved meanwhile; this outcome is about an old residency
	}
	x.kept, x.gen, x.learn = true, rec.Generation, true
	rec.KvCommittedLen = x.committed(rec.KvCommittedLen)
	rec.DRejects = nil
	rec.LastSeenUnixMs = x.nowMs
}

// committed is the session's kv_committed_len after a successful turn on its D, given what the
// record holds for that D: the worker's own kv_len_after when reported, else at least the
// input (committed by the turn; the sidecar's COMMITTED event brings the exact length).
func (x *outcomeCtx) committed(have int64) int64 {
	if x.kvLen > 0 {
		return x.kvLen
	}
	return max(have, x.r.input)
}

// rejected: the session's D rejected the request.
func (x *outcomeCtx) rejected(rec *kvcv1.SessionRecord) {
	if rec.DRejects == nil {
		rec.DRejects = make(map[string]int32, 1)
	}
	if rec.DRejects[x.r.decode] < 1<<30 {
		rec.DRejects[x.r.decode]++
	}
}

// notResident: the decision's D does not hold the session; its residency there is dropped if
// it is still the one the decision saw (same D, same generation: a reseed since then stands).
func (x *outcomeCtx) notResident(rec *kvcv1.SessionRecord) {
	if rec.DecodeWorker == x.r.decode && rec.Generation == x.r.sessGen {
		rec.PreviousDecodeWorker = rec.DecodeWorker
		rec.DecodeWorker = ""
	}
}

// snapshotFailed: the snapshot a reseed used failed; it is dropped if still the same.
func (x *outcomeCtx) snapshotFailed(rec *kvcv1.SessionRecord) {
	if sn := rec.Snapshot; sn != nil && sn.PrefillWorker == x.r.prefill && sn.Generation == x.r.snapGen {
		rec.Snapshot = nil
	}
}

// becameResident: a seed or reseed succeeded; the session now lives on r.decode.
func (x *outcomeCtx) becameResident(rec *kvcv1.SessionRecord) {
	r := x.r
	have := int64(0)
	if rec.DecodeWorker == r.decode {
		have = rec.KvCommittedLen // the new D's commit arrived first
	}
	if d := rec.DecodeWorker; d != "" && d != r.decode && d != r.from {
		x.stale = d
	}
	rec.DecodeWorker = r.decode
	rec.KvCommittedLen = x.committed(have)
	rec.Generation = policy.NextGeneration(rec.Generation, x.term)
	x.gen = rec.Generation
	x.learn = true
	if r.from != "" && r.from != r.decode {
		rec.Migrations++
		rec.PreviousDecodeWorker = r.from
		x.moved = true
	}
	rec.DRejects = nil
	rec.LastSeenUnixMs = x.nowMs
	if rec.Snapshot != nil {
		x.snapP = rec.Snapshot.PrefillWorker
	}
	x.until, x.low = rec.PinnedUntilUnixMs, rec.LowPriority
}

// resident makes the session resident on r.decode after a successful seed or reseed, then
// names its snapshot target and releases it on the D it left.
func (s *Service) resident(r *reservation, o *kvcv1.RouteOutcome, kvLen, nowMs int64) (gen uint64) {
	x := s.updateSession(r, o, kvLen, nowMs, (*outcomeCtx).becameResident)
	gen, moved, snapP, stale := x.gen, x.moved, x.snapP, x.stale
	until, low := x.until, x.low
	x.release()
	if h := s.grantHints(r, nowMs); h.here {
		until, low = h.until, h.low // this turn's hints (hints.go)
	}
	var left [2]string // the decode workers whose copy is left behind
	if moved {
		s.m.migrations.Inc()
		left[0] = r.from
	}
	left[1] = stale
	for _, w := range left {
		if w == "" {
			continue
		}
		// The session lives on r.decode now: the copy on w is released there (its sidecar has
		// the worker free it; issue 16 finding 1).
		cmd := &kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{
			SessionId: r.session, Reason: "moved to " + r.decode,
		}}, Traceparent: r.trace}
		if err := s.send(w, "release_session", cmd); err != nil {
			s.log.Debug().Err(err).Str("session", r.session).Str("worker", w).Msg("release_session not sent")
		}
	}
	if !s.policyKnobs().SnapshotsEnabled {
		return gen
	}
	cur := snapP
	if r.storeGen != 0 {
		cur = r.prefill // a seed through the prefill store: that store holds the session's snapshot
	}
	ws := s.c.Workers()
	p := policy.SnapshotTargetTP(ws, cur, policy.FindTP(ws, r.decode))
	if p == nil {
		s.log.Warn().Str("session", r.session).Msg("no live prefill worker to keep the snapshot")
		return gen
	}
	t := &kvcv1.SetSnapshotTargetCommand{
		SessionId: r.session, PrefillWorkerId: p.WorkerId, PeerAddr: p.PeerAddr,
		TransferEndpoint: p.TransferEndpoint, Generation: gen, PinnedUntilUnixMs: until, LowPriority: low,
	}
	// No full re-push after a reseed: the new D holds exactly [0, snapLen) of the target's
	// snapshot (it was written from there), so its next push appends and re-tags the entry.
	if r.mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT && p.WorkerId == r.prefill && r.snapLen > 0 && r.snapGen != 0 && r.snapGen < gen {
		t.ValidBaseLen, t.BaseGeneration = r.snapLen, r.snapGen
	}
	// A seed through the prefill store: D loaded the prompt from the store's snapshot
	// [0, input) of generation storeGen (and prefilled the rest of its last page itself); its
	// first push appends onto that snapshot (re-tagging it if the generation moved on).
	if r.storeGen != 0 && p.WorkerId == r.prefill && r.storeGen <= gen {
		t.ValidBaseLen, t.BaseGeneration = r.input, r.storeGen
	}
	cmd := &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: t}, Traceparent: r.trace}
	if err := s.send(r.decode, "set_snapshot_target", cmd); err != nil {
		s.log.Warn().Err(err).Str("session", r.session).Str("worker", r.decode).Msg("set_snapshot_target not sent")
	} else {
		s.noteTarget(r.session, p.WorkerId)
	}
	return gen
}
