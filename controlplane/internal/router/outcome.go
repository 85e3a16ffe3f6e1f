package router

import (
	"sync"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/grpc/codes"
)

// outcome applies o; the answer is in m (nil for a RouteError).
func (s *Service) outcome(o *kvcv1.RouteOutcome, pooled bool) (_ *kvcv1.RouteResponse, m *ackMsg) {
	seq, ok := s.parseID(o.DecisionId)
	if err := validateOutcome(o, ok); err != nil {
		return s.errResp("", o.DecisionId, codes.InvalidArgument, err.Error()), nil
	}
	if !ok {
		return s.errResp("", o.DecisionId, codes.NotFound, "unknown decision id (not issued by this leader)"), nil
	}
	nowMs := s.clock().UnixMilli()
	s.mu.Lock()
	r, ok := s.led.remove(seq)
	if ok && o.Success && r.holdsDecode() {
		s.led.settleOn(r.dacct, r.tokens, nowMs)
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
		return outcomeAck(o.DecisionId, seq, pooled, r.ack)
	}
	if !ok {
		if issued {
			return s.errResp("", o.DecisionId, codes.FailedPrecondition, "decision already completed"), nil
		}
		return s.errResp("", o.DecisionId, codes.NotFound, "unknown decision id"), nil
	}
	s.apply(r, o, nowMs)
	into := r.ack
	// r is this outcome's alone: removed from the ledger above, never in the late book, and
	// nothing apply started keeps it.
	out := r.out
	*r = reservation{}
	r.out = out // serves its next decision's outcome
	s.freeReservation(r)
	return outcomeAck(o.DecisionId, seq, pooled, into)
}

// ackMsg is an outcome's acknowledgement with the messages it points to, allocated together.
type ackMsg struct {
	seq  uint64 // the decision's sequence number
	resp kvcv1.RouteResponse
	kind kvcv1.RouteResponse_OutcomeAck
	ack  kvcv1.OutcomeAck
}

// outcomeAck is the answer to an applied outcome, in one block: from the pool for a Route
// stream, else into (the block its decision's answer reserved for it, when Handle answered the
// decision) or a new one.
func outcomeAck(decisionID string, seq uint64, pooled bool, into *ackMsg) (*kvcv1.RouteResponse, *ackMsg) {
	var m *ackMsg
	switch {
	case pooled:
		m = ackPool.Get().(*ackMsg)
	case into != nil:
		m = into
	default:
		m = new(ackMsg)
	}
	m.seq = seq
	m.ack.DecisionId = decisionID
	m.kind.OutcomeAck = &m.ack
	m.resp.Kind = &m.kind
	return &m.resp, m
}

// ackPool recycles ackMsg blocks a Route stream has sent (recycle).
var ackPool = sync.Pool{New: func() any { return new(ackMsg) }}

// recycle hands m back once its answer is sent.
func (m *ackMsg) recycle() {
	*m = ackMsg{}
	ackPool.Put(m)
}

// turn is r as the policy's outcome rules see it.
func (r *reservation) turn() policy.Turn {
	return policy.Turn{Session: r.session, Mode: r.mode, Decode: r.decode, Prefill: r.prefill, From: r.from,
		Opens: r.opens, Keeps: r.keep, Truncate: r.truncate, Input: r.input, SessionGen: r.sessGen,
		SnapshotGen: r.snapGen, SnapshotLen: r.snapLen, StoreGen: r.storeGen}
}

// apply carries out an outcome's effects (policy.OutcomeEffect, Effect.Edit, ResidentCommands);
// r's reservation is already released.
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
	t := r.turn()
	switch e := policy.OutcomeEffect(&t, o); e {
	case policy.EffectResident, policy.EffectTruncated:
		if e == policy.EffectTruncated {
			s.m.truncations.Inc()
		}
		s.resident(r, &t, e, o, nowMs)
	case policy.EffectExtended:
		x := s.updateSession(r, &t, e, o, nowMs)
		here := x.ed.Here
		x.release()
		if here {
			s.sendHints(r, s.grantHints(r, nowMs))
		}
	case policy.EffectRejected, policy.EffectNotResident, policy.EffectSnapshotFailed:
		s.updateSession(r, &t, e, nil, nowMs).release()
		switch e {
		case policy.EffectRejected:
			s.m.rejected.WithLabelValues(r.decode, "d").Inc()
		case policy.EffectNotResident:
			s.m.rejected.WithLabelValues(r.decode, "not_resident").Inc()
		}
	}
}

// outcomeCtx carries an outcome's effect on its session record into Cluster.UpdateSession
// without a closure allocation per outcome: it is its reservation's (reservation.out, made
// once per pooled reservation; the outcome's alone once removed from the ledger), with its
// callback bound once.
type outcomeCtx struct {
	r      *reservation
	t      policy.Turn // r as the policy sees it (a value: no allocation per outcome)
	s      *Service
	o      *kvcv1.RouteOutcome // a successful turn's outcome: learn its content (nil: nothing to learn)
	effect policy.Effect
	nowMs  int64
	// term: the leader's generation term, read before UpdateSession (fn must not call the
	// Cluster): a new residency's generation is in its range.
	term uint64
	ed   policy.Edited                  // what the effect did
	fn   func(rec *kvcv1.SessionRecord) // x.apply, bound once per pooled outcomeCtx
}

func (x *outcomeCtx) apply(rec *kvcv1.SessionRecord) {
	x.ed = x.effect.Edit(&x.t, rec, x.nowMs, x.term)
	if x.ed.Here && x.o != nil && (x.effect == policy.EffectExtended || x.o.KvLenAfter > 0 || !x.r.learnsAtLength()) {
		// A new residency's committed length is its D's commit, which the state applies after
		// this edit: without the worker's own kv_len_after, content that needs it is learnt
		// after it (resident); content that does not (no hashes: forgotten) is settled here.
		x.learnContent(rec)
	}
}

// learnsAtLength: what learnContent records for r depends on the session's committed length
// (the query's page hashes, or a re-home's snapshot pages); else it only forgets.
func (r *reservation) learnsAtLength() bool {
	return r.pageSize > 0 || r.reason == kvcv1.RouteReason_ROUTE_REASON_REHOME
}

// learnContent records the session's content after a successful turn that left it resident on
// r.decode (content.go) and persists its compact chain in the record, in the same update as
// the committed length it describes (contentrecord.go). The length is the worker's own
// kv_len_after when it reported one, else the record's kv_committed_len — its decode sidecar's
// commit — once that covers the turn's input (the turn's commit arrived first). Without hashes
// in the query, or without a length, the control plane forgets what it knew: the KV changed in
// a way it cannot see.
func (x *outcomeCtx) learnContent(rec *kvcv1.SessionRecord) {
	r, o := x.r, x.o
	kvLen := o.KvLenAfter
	if kvLen <= 0 && rec.DecodeWorker == r.decode && rec.KvCommittedLen >= r.input {
		kvLen = rec.KvCommittedLen
	}
	var e *contentEntry
	switch {
	case r.reason == kvcv1.RouteReason_ROUTE_REASON_REHOME && r.pageSize == 0:
		// A re-home has no query: what the new decode worker loaded is the snapshot, whose
		// pages the session's entry knows (content.go, rehomed).
		e = x.s.content.rehomed(r.session, r.decode, kvLen, r.snapGen, rec.Generation)
	case r.pageSize > 0 && kvLen > 0:
		e = x.s.content.record(r.session, r.decode, r.pageSize, r.prompt, o.KvPages, kvLen, rec.Generation)
	default:
		x.s.content.forget(r.session)
	}
	if e == nil {
		rec.ContentChain = nil
		return
	}
	rec.ContentChain = encodeChain(e)
}

// learnOnly is resident's second edit: the content alone, if the session is still r's.
func (x *outcomeCtx) learnOnly(rec *kvcv1.SessionRecord) {
	if rec.DecodeWorker == x.r.decode && rec.Generation == x.ed.Generation {
		x.learnContent(rec)
	}
}

// updateSession runs effect e of turn t on r's session record inside Cluster.UpdateSession
// (which calls it synchronously and keeps no reference to it) and returns the context for its
// results; the caller hands it back with release.
func (s *Service) updateSession(r *reservation, t *policy.Turn, e policy.Effect, o *kvcv1.RouteOutcome, nowMs int64) *outcomeCtx {
	x := r.out
	if x == nil {
		x = new(outcomeCtx) // once per reservation: the pool's reservations keep it (record, outcome)
		x.fn = x.apply
		r.out = x
	}
	fn := x.fn
	*x = outcomeCtx{r: r, t: *t, s: s, o: o, effect: e, nowMs: nowMs, fn: fn, term: s.c.GenerationTerm()}
	s.c.UpdateSession(r.session, fn)
	return x
}

func (x *outcomeCtx) release() {
	fn := x.fn
	*x = outcomeCtx{fn: fn} // drop references (the outcome, its turn's strings)
}

// resident makes the session resident on r.decode after a successful seed or reseed (or a
// truncation), then carries out the policy's commands: the release on the D it left, the
// snapshot target and the agent hints on the new D.
func (s *Service) resident(r *reservation, t *policy.Turn, e policy.Effect, o *kvcv1.RouteOutcome, nowMs int64) {
	x := s.updateSession(r, t, e, o, nowMs)
	ed := x.ed
	if o.KvLenAfter <= 0 && ed.Here && r.learnsAtLength() {
		// The state gave the new residency its D's last commit after the edit: learn on it
		// (a second trip through the state lock, only for content that needs the length).
		s.c.UpdateSession(r.session, func(rec *kvcv1.SessionRecord) { x.learnOnly(rec) })
	}
	x.release()
	until, low := ed.PinnedUntilMs, ed.Low
	if h := s.grantHints(r, nowMs); h.here {
		until, low = h.until, h.low // this turn's hints (hints.go)
	}
	if ed.Moved {
		s.m.migrations.Inc()
	}
	var buf [4]policy.Send
	cmds, noTarget := policy.ResidentCommands(buf[:0], s.policyKnobs(), s.c.Workers(), t, ed, until, low, nowMs, r.trace)
	if noTarget {
		s.log.Warn().Str("session", r.session).Msg("no live prefill worker to keep the snapshot")
	}
	for _, c := range cmds {
		if err := s.send(c.Worker, c.Name, c.Cmd); err != nil {
			ev := s.log.Warn()
			if c.Name == "release_session" {
				ev = s.log.Debug() // the worker left behind is often the one that is gone
			}
			ev.Err(err).Str("session", r.session).Str("worker", c.Worker).Msg(c.Name + " not sent")
		}
	}
}
