package router

import (
	"cmp"
	"context"
	"slices"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// Re-homing (issue 20 item 3, docs/routing.md §3): when a decode worker leaves READY (its
// worker died, it drains, or it stayed unreachable past its grace), the state drops its
// sessions' residency and tells the router (SessionsLost). The router then reseeds each of
// them that has a usable snapshot onto another decode worker in the background — a
// RESEED_SNAPSHOT decided by the same policy as a turn's (policy.Decide: the reseed profile's
// headroom scoring, the capacity rule with reservations, the transfer budget) with reason
// REHOME — by PushSnapshotCommand to the snapshot's holder and LoadSessionCommand to the new
// decode worker's sidecar, which has its worker create the session from the snapshot without a
// client request. The session becomes resident there when the worker commits the KV (its
// COMMITTED event); the sidecar's LOADED event is the re-home's outcome (a new generation and a
// snapshot target with the snapshot as valid base, as after a turn's reseed). A turn of a
// session being re-homed waits for it (Route), then finds the session resident: no reseed on
// its critical path and never two reseeds of one session.

// maxRehomeQueue bounds the sessions waiting to be re-homed; beyond it they are left to their
// next turn (counted as result "queue_full").
const maxRehomeQueue = 65536

// rehomeRetry is how long a session that found no decode worker with room or transfer budget
// waits before it is tried again (a finished re-home or outcome also wakes the queue).
const rehomeRetry = 100 * time.Millisecond

// DefaultRehomeFill is the share of a decode worker's kv_capacity_tokens a re-home may fill it
// to (kvc-controlplane --rehome-fill): the decode sidecar's default release low watermark
// (--release-low-watermark 0.8), so a re-home never lifts its target above the release's high
// watermark (any above 0.8) and the capacity release never has to make room for it.
const DefaultRehomeFill = 0.8

// rehomeRoom reports whether decode worker w has free room for a re-home that needs need
// tokens: its used KV as last reported (idle sessions included: a re-home is no reason to
// release them), the outcomes' KV its report does not show yet (Settling) and the decisions in
// flight there (Tokens), plus need, at most fill × its capacity. The capacity rule of a turn
// (policy.fits) counts idle sessions as room the worker frees on demand; a background re-home
// must not make the target release them: the released sessions' next turns would reseed and
// wait for pages (issue 20: the re-homed sessions were the ones released, their turns waited
// 8.5 s). Re-homing into room the release makes was tried and measured (branch p33-release,
// docs/benchmark.md "Recovery after a decode worker's death: request by request"): it moved
// the cost to the survivors' own sessions and to re-homed sessions' turns waiting for pages.
func rehomeRoom(w *kvcv1.Worker, res policy.Reserved, need int64, fill float64) bool {
	capacity := w.GetKvCapacityTokens()
	if capacity <= 0 || fill <= 0 {
		return false
	}
	l := w.GetLoad()
	used := max(0, l.GetUsedTokens(), l.GetUnevictableTokens())
	return used+max(0, res.Settling)+max(0, res.Tokens)+need <= int64(fill*float64(capacity))
}

// rehomeItem is a session waiting to be re-homed.
type rehomeItem struct {
	session string
	from    string    // the decode worker it left
	since   time.Time // when it lost its residency
	// From the session record, read once by the first pass (orderRehomes): its last turn's
	// arrival (last_seen_unix_ms) and its usual gap between turns in ms (0: unknown).
	read          bool
	lastSeen, gap int64
}

// rehomeOp is a re-home in flight (Service.rehomes, guarded by Service.mu).
type rehomeOp struct {
	seq    uint64
	from   string
	decode string
	room   int64
	since  time.Time
	done   chan struct{} // closed when it ended, whatever the result
}

// rehomeQueue holds the sessions waiting; its own lock, so that SessionsLost (called under
// the state's lock) never waits for the router.
type rehomeQueue struct {
	items []rehomeItem
	kick  chan struct{}
}

func (s *Service) wakeRehome() {
	select {
	case s.rq.kick <- struct{}{}:
	default:
	}
}

// SessionsLost is the state's note that sessions lost their residency on decode worker from
// (it left READY). It only queues them; it must stay quick (the caller holds the state lock).
func (s *Service) SessionsLost(from string, sessions []string) {
	if len(sessions) == 0 {
		return
	}
	now := s.clock()
	s.rqMu.Lock()
	for _, id := range sessions {
		if len(s.rq.items) >= maxRehomeQueue {
			s.m.rehomes.WithLabelValues("queue_full").Inc()
			continue
		}
		s.rq.items = append(s.rq.items, rehomeItem{session: id, from: from, since: now})
	}
	s.rqMu.Unlock()
	s.wakeRehome()
}

// SessionLoaded is the state's delivery of a decode sidecar's LOADED or LOAD_FAILED event
// (worker is the reporting decode worker). Called under the state lock: it hands the event to
// a goroutine of its own.
func (s *Service) SessionLoaded(worker string, ev *kvcv1.SessionEvent) {
	s.rehomeWG.Add(1)
	go func() {
		defer s.rehomeWG.Done()
		s.finishRehome(worker, ev)
	}()
}

// runRehome starts re-homes until ctx is done.
func (s *Service) runRehome(ctx context.Context) {
	t := time.NewTicker(rehomeRetry)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.rq.kick:
		case <-t.C:
		}
		s.rehomePass()
	}
}

// rehomePass tries to start a re-home of every queued session; those that found no room or
// budget stay queued for the next pass.
func (s *Service) rehomePass() {
	s.rqMu.Lock()
	items := s.rq.items
	s.rq.items = nil
	s.rqMu.Unlock()
	if len(items) == 0 {
		return
	}
	s.orderRehomes(items, s.clock())
	var again []rehomeItem
	for _, it := range items {
		if s.startRehome(it) {
			again = append(again, it)
		}
	}
	if len(again) > 0 {
		s.rqMu.Lock()
		s.rq.items = append(again, s.rq.items...)
		s.rqMu.Unlock()
	}
}

// orderRehomes sorts the queue soonest due first, so that room and transfer slots go first to
// the sessions whose next turns are likeliest to come before they could be re-homed. A
// session's usual gap between turns is its record's (last_seen − created) / turn; its next
// turn is due at last_seen + that gap. One idle more than twice its usual gap has paused (a
// slow tool, a human) and goes after every session still in conversation, as does one with a
// single turn (no gap to go by), most recently used first among them. Measured on issue 20's
// demo (18 kills, E4): the sessions whose turns came first after the kill were those idle
// 4-9 s, not the most recently used, and the longest idle (15-17 s, in a long pause) came last;
// this order put the first-due session first in 8 of 18 kills (most recently used first: 1).
func (s *Service) orderRehomes(items []rehomeItem, now time.Time) {
	for i := range items {
		it := &items[i]
		if !it.read {
			it.read = true
			if rec, ok := s.c.Session(it.session); ok {
				it.lastSeen = rec.GetLastSeenUnixMs()
				if t, c := rec.GetTurn(), rec.GetCreatedUnixMs(); t > 0 && c > 0 && it.lastSeen > c {
					it.gap = (it.lastSeen - c) / int64(t)
				}
			}
		}
	}
	nowMs := now.UnixMilli()
	key := func(it *rehomeItem) (class int, at int64) {
		switch {
		case it.gap <= 0:
			return 2, -it.lastSeen // one turn, or no record: no gap to go by
		case nowMs-it.lastSeen > 2*it.gap:
			return 1, -it.lastSeen // paused
		}
		return 0, it.lastSeen + it.gap
	}
	slices.SortStableFunc(items, func(a, b rehomeItem) int {
		ca, ta := key(&a)
		cb, tb := key(&b)
		return cmp.Or(cmp.Compare(ca, cb), cmp.Compare(ta, tb))
	})
}

// retryable: the decision found no decode worker with room or a free transfer slot now.
func retryable(r kvcv1.RouteReason) bool {
	switch r {
	case kvcv1.RouteReason_ROUTE_REASON_TRANSFER_BUDGET, kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY,
		kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_INFLIGHT:
		return true
	}
	return false
}

// startRehome decides one session's re-home and, when it is a RESEED_SNAPSHOT, sends its two
// commands. It reports whether the session should be tried again later.
func (s *Service) startRehome(it rehomeItem) (retry bool) {
	epoch := s.c.Epoch()
	if epoch == 0 {
		s.m.rehomes.WithLabelValues("not_leading").Inc()
		return false
	}
	now := s.clock()
	k := s.policyKnobs()
	if !k.SnapshotsEnabled {
		s.m.rehomes.WithLabelValues("snapshots_disabled").Inc()
		return false
	}
	if now.Sub(it.since) > k.ReservationTimeout {
		s.m.rehomes.WithLabelValues("gave_up").Inc() // no room or budget for that long: its next turn decides
		return false
	}
	in := policy.Input{
		Knobs:          k,
		Workers:        s.c.Workers(),
		NowMs:          now.UnixMilli(),
		Exclude:        []string{it.from},
		Resyncing:      s.resyncing(),
		GenerationTerm: s.c.GenerationTerm(),
	}
	var (
		d  policy.Decision
		r  *reservation
		op *rehomeOp
	)
	result := "not_leading" // the state refused the update: this replica is not leading
	s.c.UpdateSession(it.session, func(rec *kvcv1.SessionRecord) {
		switch {
		case rec.GetDecodeWorker() != "":
			result = "resident" // a turn (or the worker's return) made it resident meanwhile
			return
		case rec.GetSnapshot() == nil || rec.GetSnapshot().GetSeqlen() <= 0:
			result = "no_snapshot" // lost as before: its next turn re-prefills
			return
		}
		seqlen := min(rec.GetSnapshot().GetSeqlen(), policy.MaxInputTokens)
		if kv := rec.GetKvCommittedLen(); kv > 0 && kv < seqlen {
			seqlen = kv
		}
		in.Query = policy.Query{SessionID: it.session, Turn: max(rec.GetTurn(), 1), InputTokens: seqlen,
			LowPriority: rec.GetLowPriority()}
		in.Session = rec
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.rehomes[it.session] != nil {
			result = "in_flight"
			return
		}
		s.led.prune(in.Workers)
		in.Ledger = s.led
		// The policy's best target first (the reseed profile: capacity, the store-transfer
		// budget and headroom as scores); one the capacity rule does not admit now, without a
		// free store-transfer slot (max_concurrent_transfers) or without free room for it is
		// left out and the next best tried, so that the session does not wait behind the best
		// while another target has room.
		admitted := false
		for range len(in.Workers) + 1 {
			d = policy.Decide(&in)
			if !d.LoadsSnapshot() || d.Decode == nil || d.Prefill == nil {
				result = "not_snapshot"
				if retryable(d.Reason) || len(in.Exclude) > 1 {
					s.logRehomeWait(it.session, &d, "not_admitted")
					result = "retry"
				}
				return
			}
			id := d.Decode.GetWorkerId()
			why := d.Admission.String()
			if d.Admission == policy.AdmitFits {
				if rehomeRoom(d.Decode, s.led.Reserved(id), d.ReservedTokens, s.rehomeFill) {
					admitted = true
					break
				}
				why = "no_free_room"
			}
			// A turn's reseed would wait in the target's prealloc queue; a background
			// re-home waits in this queue instead (rate-limited by the budget), or takes
			// another target.
			s.logRehomeWait(it.session, &d, why)
			in.Exclude = append(in.Exclude, id)
		}
		if !admitted {
			// Wait for free room (another target, a release or an outcome) or give up after
			// the reservation timeout — lost as before, its next turn reseeds.
			s.m.rehomeNoRoom.Inc()
			result = "retry"
			return
		}
		if len(d.Decode.GetTpRanks()) > 0 || len(d.Prefill.GetTpRanks()) > 0 {
			result = "tensor_parallel" // not re-homed: LoadSessionCommand names one peer
			return
		}
		d.Reason = kvcv1.RouteReason_ROUTE_REASON_REHOME
		r, _ = s.record(&in, &d, now)
		op = &rehomeOp{seq: r.seq, from: it.from, decode: d.Decode.GetWorkerId(), room: s.room(r.seq),
			since: it.since, done: make(chan struct{})}
		s.rehomes[it.session] = op
		s.nRehomes.Store(int64(len(s.rehomes)))
	})
	if op == nil {
		if result == "retry" {
			return true
		}
		s.m.rehomes.WithLabelValues(result).Inc()
		return false
	}
	s.m.decision(d.Mode, d.Reason)
	s.m.admit(op.decode)
	err := s.pushSnapshot(it.session, &d, op.seq, "")
	if err == nil {
		err = s.send(op.decode, "load_session", &kvcv1.Command{Action: &kvcv1.Command_LoadSession{LoadSession: &kvcv1.LoadSessionCommand{
			SessionId: it.session, SnapshotGeneration: d.SnapshotGeneration, Seqlen: d.SnapshotSeqlen,
			PrefillWorkerId: d.Prefill.GetWorkerId(), PrefillPeerAddr: d.Prefill.GetPeerAddr(),
			Room: op.room, DecisionId: s.id(op.seq), TimeoutMs: k.ReservationTimeout.Milliseconds(),
		}}})
	}
	if err != nil {
		s.log.Warn().Err(err).Str("session", it.session).Str("decode", op.decode).Msg("re-home not started: a command could not be sent")
		s.endRehome(it.session, op, "send_failed", true)
		return false
	}
	s.log.Debug().Str("session", it.session).Str("from", it.from).Str("decode", op.decode).
		Str("prefill", d.Prefill.GetWorkerId()).Int64("seqlen", d.SnapshotSeqlen).Msg("re-home started")
	return false
}

// logRehomeWait logs (debug) why a session's re-home was put back: its best target and what
// that target holds.
func (s *Service) logRehomeWait(session string, d *policy.Decision, why string) {
	e := s.log.Debug()
	if !e.Enabled() {
		return
	}
	if d.Decode != nil {
		l := d.Decode.GetLoad()
		res := s.led.Reserved(d.Decode.GetWorkerId())
		e = e.Str("decode", d.Decode.GetWorkerId()).Int64("capacity", d.Decode.GetKvCapacityTokens()).
			Int64("used", l.GetUsedTokens()).Int64("evictable", l.GetEvictableTokens()).
			Int64("unevictable", l.GetUnevictableTokens()).Int64("reserved", res.Tokens).
			Int64("settling", res.Settling).Int32("store_transfers", res.StoreTransfers)
	}
	e.Str("session", session).Str("why", why).Str("reason", ReasonName(d.Reason)).
		Int64("need", d.ReservedTokens).Msg("re-home waits")
}

// endRehome removes op (when it is still the session's) and, with release, its reservation;
// it closes op.done and counts the result.
func (s *Service) endRehome(session string, op *rehomeOp, result string, release bool) bool {
	s.mu.Lock()
	mine := s.rehomes[session] == op
	if mine {
		delete(s.rehomes, session)
		s.nRehomes.Store(int64(len(s.rehomes)))
		if release {
			s.led.remove(op.seq)
		}
	}
	s.mu.Unlock()
	if !mine {
		return false
	}
	close(op.done)
	s.m.rehomes.WithLabelValues(result).Inc()
	s.wakeRehome() // a transfer slot is free again
	return true
}

// finishRehome applies a decode sidecar's LOADED / LOAD_FAILED event to its re-home.
func (s *Service) finishRehome(worker string, ev *kvcv1.SessionEvent) {
	id := ev.GetSessionId()
	s.mu.Lock()
	op := s.rehomes[id]
	s.mu.Unlock()
	if op == nil || op.decode != worker || op.room != ev.GetRoom() {
		s.m.rehomes.WithLabelValues("stale_event").Inc()
		return
	}
	if ev.GetKind() != kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED {
		s.log.Warn().Str("session", id).Str("decode", worker).Str("detail", ev.GetDetail()).Msg("re-home failed: the session's next turn reseeds")
		s.endRehome(id, op, "load_failed", true)
		return
	}
	now := s.clock()
	// The re-home's outcome: resident on the new decode worker with a new generation and the
	// snapshot as its valid base (outcome.go), exactly as a turn's RESEED_SNAPSHOT.
	s.outcome(&kvcv1.RouteOutcome{DecisionId: s.id(op.seq), Success: true, KvLenAfter: ev.GetKvLen(),
		ExecutedMode: kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, LatencyUs: now.Sub(op.since).Microseconds(),
		Detail: "rehome"}, false)
	if s.endRehome(id, op, "loaded", false) {
		s.m.rehomeSeconds.Observe(now.Sub(op.since).Seconds())
		s.log.Info().Str("session", id).Str("from", op.from).Str("decode", worker).Int64("kv_len", ev.GetKvLen()).
			Dur("time_to_resident", now.Sub(op.since)).Int64("unix_ms", now.UnixMilli()).Msg("session re-homed")
	}
}

// expiredRehome ends the re-home of an expired reservation r (no LOADED within the
// reservation timeout).
func (s *Service) expiredRehome(r *reservation) {
	if r.reason != kvcv1.RouteReason_ROUTE_REASON_REHOME {
		return
	}
	s.mu.Lock()
	op := s.rehomes[r.session]
	s.mu.Unlock()
	if op != nil && op.seq == r.seq {
		s.endRehome(r.session, op, "timeout", false)
	}
}

// rehomeWait returns the done channel of the session's re-home in flight, nil when none.
func (s *Service) rehomeWait(session string) <-chan struct{} {
	if s.nRehomes.Load() == 0 {
		return nil // the usual case: no lock trip for a turn's look
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if op := s.rehomes[session]; op != nil {
		return op.done
	}
	return nil
}

// waitRehome waits (at most the reservation timeout, or until ctx is done) for the session's
// re-home in flight to end, so the turn decides on what it left. It reports whether it waited.
func (s *Service) waitRehome(ctx context.Context, session string) bool {
	done := s.rehomeWait(session)
	if done == nil {
		return false
	}
	s.m.rehomeWaits.Inc()
	t := time.NewTimer(s.policyKnobs().ReservationTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-ctx.Done():
	case <-t.C:
	}
	return true
}

// resetRehomesLocked ends every re-home of the term (leadership changed): their reservations are
// gone with the ledger; a waiting turn decides on what the state says.
func (s *Service) resetRehomesLocked() []*rehomeOp {
	ops := make([]*rehomeOp, 0, len(s.rehomes))
	for _, op := range s.rehomes {
		ops = append(ops, op)
	}
	clear(s.rehomes)
	s.nRehomes.Store(0)
	return ops
}

func newRehomeMetrics(m *metrics) []prometheus.Collector {
	m.rehomes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvc_router_rehomes_total",
		Help: "Sessions of a decode worker that left READY, by what their re-home did: loaded (resident elsewhere), load_failed, timeout, send_failed, no_snapshot (lost as before), resident (back before it started), not_snapshot (the policy chose no RESEED_SNAPSHOT), gave_up (no room or budget within the reservation timeout), in_flight, tensor_parallel, stale_event, not_leading, snapshots_disabled, queue_full.",
	}, []string{"result"})
	m.rehomeSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "kvc_router_rehome_seconds",
		Help:    "Time from a session losing its residency (its decode worker left READY) until it is resident on another decode worker by re-homing.",
		Buckets: prometheus.ExponentialBuckets(0.01, 2, 14),
	})
	m.rehomeWaits = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_rehome_waits_total",
		Help: "Turns that arrived while their session was being re-homed and waited for it before being decided.",
	})
	m.rehomeNoRoom = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvc_router_rehome_no_room_total",
		Help: "Re-home attempts put back because no decode worker had free room below --rehome-fill of its capacity for them (idle sessions count as used: a re-home never makes a worker release them), a free store-transfer slot and the capacity rule's admission; retried until the reservation timeout (then gave_up).",
	})
	return []prometheus.Collector{m.rehomes, m.rehomeSeconds, m.rehomeWaits, m.rehomeNoRoom}
}
