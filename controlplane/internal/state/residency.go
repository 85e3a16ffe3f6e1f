package state

import (
	"strings"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Reconcile applies a residency report (already validated). A decode worker's sessions
// follow its report (decode_worker, kv_committed_len, generation); with full_sync, sessions
// the table believed resident there but not listed become not resident. A prefill worker's
// snapshots set session.snapshot; with full_sync, its snapshots not listed are cleared. A report
// carrying a generation never issued is refused whole with a *ClaimError (claims.go).
func (s *State) Reconcile(st *Stream, rs *kvcv1.ResidentSessions) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.workers[st.WorkerID]
	if !ok || e.stream != st || s.term == nil {
		return ErrNoStream
	}
	w := st.WorkerID
	now := time.Now().UnixMilli()
	switch st.Role {
	case kvcv1.WorkerRole_WORKER_ROLE_DECODE:
		if u := s.unitLocked(w); u != w {
			// A rank of a tensor-parallel group other than its rank 0, whose reports drive the
			// group's residency: a session it does not hold is lost for the group.
			if rs.GetFullSync() {
				st.synced = true
				s.rankResyncLocked(w, u, rs)
				s.resyncAttachedLocked(w)
			}
			return nil
		}
		for _, r := range rs.GetSessions() {
			if err := s.checkClaimLocked(w, r.GetSessionId(), r.GetGeneration(), true); err != nil {
				return err // nothing of the report applied (claims.go)
			}
		}
		seen := make(map[string]struct{}, len(rs.GetSessions()))
		var stale []string
		for _, r := range rs.GetSessions() {
			seen[r.GetSessionId()] = struct{}{}
			rec := s.getOrCreateLocked(r.GetSessionId())
			oldD, oldP := rec.GetDecodeWorker(), rec.GetSnapshot().GetPrefillWorker()
			if oldD == w && rec.GetKvCommittedLen() == r.GetKvCommittedLen() &&
				(r.GetGeneration() == 0 || r.GetGeneration() == rec.GetGeneration()) {
				continue
			}
			if s.staleCopyLocked(rec, r.GetGeneration(), oldD, w) {
				// The record is newer than the reported copy: the session moved (or was dropped)
				// while this worker was away. The record stands, and the stale KV is released
				// on the reporting worker (the sidecar has the worker free it).
				stale = append(stale, r.GetSessionId())
				continue
			}
			if oldD != w && oldD != "" {
				rec.PreviousDecodeWorker = oldD
				// The report is newer: the copy the record named is the stale one now.
				if s.unitConnectedLocked(oldD) {
					s.releaseStaleLocked(oldD, []string{r.GetSessionId()})
				}
			}
			rec.DecodeWorker = w
			rec.KvCommittedLen = r.GetKvCommittedLen()
			if r.GetGeneration() != 0 {
				rec.Generation = r.GetGeneration()
			}
			s.changedLocked(rec, oldD, oldP)
		}
		if rs.GetFullSync() {
			for _, sid := range keys(s.byDecode[w]) {
				if _, ok := seen[sid]; ok {
					continue
				}
				rec := s.sessions[sid].rec
				rec.PreviousDecodeWorker = w
				rec.DecodeWorker = ""
				s.changedLocked(rec, w, rec.GetSnapshot().GetPrefillWorker())
			}
		}
		s.releaseStaleLocked(w, stale)
		if rs.GetFullSync() {
			st.synced = true
			s.resyncAttachedLocked(w)
		}
		s.kickDrainLocked(w)
	case kvcv1.WorkerRole_WORKER_ROLE_PREFILL:
		for _, sn := range rs.GetSnapshots() {
			if err := s.checkClaimLocked(w, sn.GetSessionId(), sn.GetGeneration(), false); err != nil {
				return err
			}
		}
		if grouped(e.w) {
			// A rank of a tensor-parallel group: its shards; the group's snapshot of a session
			// is what every rank holds (tp.go).
			shards := make(map[string]*tpShard, len(rs.GetSnapshots()))
			for _, sn := range rs.GetSnapshots() {
				upd := sn.GetUpdatedUnixMs()
				if upd == 0 {
					upd = now
				}
				shards[sn.GetSessionId()] = &tpShard{seqlen: sn.GetSeqlen(), gen: sn.GetGeneration(), bytes: sn.GetBytes(), updated: upd}
			}
			s.applyShardsLocked(w, shards, rs.GetFullSync())
			return nil
		}
		seen := make(map[string]struct{}, len(rs.GetSnapshots()))
		for _, sn := range rs.GetSnapshots() {
			seen[sn.GetSessionId()] = struct{}{}
			rec := s.getOrCreateLocked(sn.GetSessionId())
			oldD, oldP := rec.GetDecodeWorker(), rec.GetSnapshot().GetPrefillWorker()
			upd := sn.GetUpdatedUnixMs()
			if upd == 0 {
				upd = now
			}
			rec.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: w, Seqlen: sn.GetSeqlen(), Generation: sn.GetGeneration(),
				UpdatedUnixMs: upd, Bytes: sn.GetBytes()}
			s.changedLocked(rec, oldD, oldP)
		}
		if rs.GetFullSync() {
			for _, sid := range keys(s.bySnap[w]) {
				if _, ok := seen[sid]; ok {
					continue
				}
				rec := s.sessions[sid].rec
				rec.Snapshot = nil
				s.changedLocked(rec, rec.GetDecodeWorker(), w)
			}
		}
	}
	return nil
}

// staleCopyLocked: a decode worker w reports a session in KV generation gen (0: unknown, e.g.
// its sidecar restarted) that the record (resident on oldD, or on none) says is older than
// what was acknowledged since. The record wins when it names another decode worker and the
// report is not of a newer generation (a reseed elsewhere bumped the generation while w was
// unreachable; a copy of unknown generation on w predates it, since w could not be chosen
// while the record pointed elsewhere), and when the session is resident nowhere but the report
// is of a known, older generation (moved away, then released or evicted there) or of unknown
// generation while the session's last residency was on another worker (movedAway).
func (s *State) staleCopyLocked(rec *kvcv1.SessionRecord, gen uint64, oldD, w string) bool {
	switch {
	case oldD == w:
		return false
	case oldD != "":
		return gen == 0 || gen <= rec.GetGeneration()
	case gen == 0:
		return movedAway(rec, w)
	default:
		return gen < rec.GetGeneration()
	}
}

// movedAway: the session is resident nowhere and its last residency was on another worker than
// w (previous_decode_worker: every change that clears decode_worker names the worker it leaves).
// A copy of unknown generation on w then predates that residency — w held the session before
// it moved there, e.g. a seed onto w whose snapshot target (w's only source of the generation)
// never reached w's sidecar, cut off from the control planes, while the session was reseeded
// elsewhere, committed and evicted there (half-open-sidecar-link): adopting the copy would make
// w's older KV current at the record's newer generation. A seed onto w ahead of its outcome is
// the one honest such copy; its outcome lands within the decision's round trip, long before a
// cut-off sidecar reconnects and resyncs.
func movedAway(rec *kvcv1.SessionRecord, w string) bool {
	p := rec.GetPreviousDecodeWorker()
	return rec.GetDecodeWorker() == "" && p != "" && p != w
}

// releaseStaleLocked commands unit's sidecar (every rank's, for a tensor-parallel group) to
// release the stale copies ids (the sidecar has its worker free them through WatchCommands).
// Best effort: a full queue leaves them to the next resync.
func (s *State) releaseStaleLocked(unit string, ids []string) {
	for _, id := range ids {
		s.m.staleCopies.Inc()
		cmd := &kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{
			SessionId: id, Reason: "stale copy: the session's newer residency is elsewhere"}}}
		if err := s.sendUnitLocked(unit, cmd); err != nil {
			s.log.Warn().Err(err).Str("worker", unit).Str("session", id).Msg("release of a stale copy not sent")
			continue
		}
		s.log.Info().Str("worker", unit).Str("session", id).Msg("resync reported a stale copy: released there")
	}
}

// rankResyncLocked applies the full resync of rank worker w of the decode group unit (not its
// rank 0): every session resident on the group that w does not list is lost for the group (that
// rank's part of its KV is gone), as when the worker releases it. What w lists is not made
// resident here: rank 0's reports decide that.
func (s *State) rankResyncLocked(w, unit string, rs *kvcv1.ResidentSessions) {
	if unit == "" {
		return
	}
	seen := make(map[string]struct{}, len(rs.GetSessions()))
	for _, r := range rs.GetSessions() {
		seen[r.GetSessionId()] = struct{}{}
	}
	n := 0
	for _, sid := range keys(s.byDecode[unit]) {
		if _, ok := seen[sid]; ok {
			continue
		}
		rec := s.sessions[sid].rec
		rec.PreviousDecodeWorker = unit
		rec.DecodeWorker = ""
		s.changedLocked(rec, unit, rec.GetSnapshot().GetPrefillWorker())
		n++
	}
	if n > 0 {
		s.log.Warn().Str("worker", w).Str("unit", unit).Int("sessions", n).Msg("a rank of a tensor-parallel group does not hold sessions resident on the group: their residency is dropped")
		s.kickDrainLocked(unit)
	}
}

// workerDownDetail starts the detail of the EVICTED events a decode sidecar reports for the
// sessions its dead worker process took with it (sidecar-decode/internal/decode/health.go).
const workerDownDetail = "worker down: "

// ApplyEvent applies a session event (already validated) from the stream's worker. A commit or
// a snapshot ingest of a generation never issued is refused with a *ClaimError (claims.go).
func (s *State) ApplyEvent(st *Stream, ev *kvcv1.SessionEvent) error {
	s.m.events.WithLabelValues(ev.GetKind().String()).Inc()
	switch ev.GetKind() {
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_DONE:
		s.m.transfers.WithLabelValues("done").Inc()
		s.log.Debug().Str("worker", st.WorkerID).Str("session", ev.GetSessionId()).Int64("room", ev.GetRoom()).Int64("bytes", ev.GetBytes()).Msg("transfer done")
		// The KV of a seed or reseed has landed on this decode worker: the router ends the
		// decision's transfer slot now rather than at its outcome (router/landed.go). A rank of
		// a tensor-parallel group is one part of the KV: the group keeps its slot until the
		// outcome.
		if hk := s.landed.Load(); hk != nil {
			s.mu.Lock()
			we, ok := s.workers[st.WorkerID]
			cur := ok && we.stream == st && s.term != nil && we.w.GetRole() == kvcv1.WorkerRole_WORKER_ROLE_DECODE && !grouped(we.w)
			s.mu.Unlock()
			if cur {
				hk.h.TransferLanded(st.WorkerID, ev)
			}
		}
		return nil
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_FAILED:
		s.m.transfers.WithLabelValues("failed").Inc()
		s.log.Warn().Str("worker", st.WorkerID).Str("session", ev.GetSessionId()).Int64("room", ev.GetRoom()).Str("detail", ev.GetDetail()).Msg("transfer failed")
		return nil
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED, kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED:
		// The end of a LoadSessionCommand: the router's re-home (its COMMITTED, applied before
		// this on the same stream, already made the session resident when it loaded).
		s.mu.Lock()
		defer s.mu.Unlock()
		if we, ok := s.workers[st.WorkerID]; !ok || we.stream != st || s.term == nil {
			return ErrNoStream
		}
		if hk := s.rehome.Load(); hk != nil {
			hk.h.SessionLoaded(st.WorkerID, ev)
		}
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	we, ok := s.workers[st.WorkerID]
	if !ok || we.stream != st || s.term == nil {
		return ErrNoStream
	}
	w := st.WorkerID
	id := ev.GetSessionId()
	switch ev.GetKind() {
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED:
		// A commit is a residency claim of the unit (a group's rank 0; other ranks' commits
		// are ignored below, but their generations are bounded all the same).
		if err := s.checkClaimLocked(w, id, ev.GetGeneration(), s.unitLocked(w) == w); err != nil {
			return err
		}
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED:
		if err := s.checkClaimLocked(w, id, ev.GetGeneration(), false); err != nil {
			return err
		}
	}
	if grouped(we.w) {
		// A rank of a tensor-parallel group (tp.go): rank 0's commits drive the group's
		// residency; a release or eviction on any rank loses the session for the group; a
		// prefill rank's snapshot events update its shard.
		switch ev.GetKind() {
		case kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED:
			if s.unitLocked(w) != w {
				return nil
			}
		case kvcv1.SessionEventKind_SESSION_EVENT_KIND_RELEASED, kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED:
			if w = s.unitLocked(w); w == "" {
				return nil
			}
		case kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED:
			at := ev.GetUnixMs()
			if at == 0 {
				at = time.Now().UnixMilli()
			}
			s.applyShardsLocked(w, map[string]*tpShard{id: {seqlen: ev.GetKvLen(), gen: ev.GetGeneration(), bytes: ev.GetBytes(), updated: at}}, false)
			return nil
		case kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED:
			if sh, held := s.tpSnap[id][w]; held && (ev.GetGeneration() == 0 || sh.gen == ev.GetGeneration()) {
				s.applyShardsLocked(w, map[string]*tpShard{id: nil}, false)
			}
			return nil
		}
	}
	e, exists := s.sessions[id]
	rec := e.rec
	switch ev.GetKind() {
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED:
		if !exists {
			e = s.createLocked(id)
			rec = e.rec
		}
		before := durableOf(rec)
		if ev.GetGeneration() == 0 && !st.synced && movedAway(rec, w) {
			// A commit raised while w's sidecar was cut off, replayed before its resync, of a
			// session that has since lived on another worker: the copy may predate that
			// residency (movedAway). The resync that follows decides (and releases it there).
			return nil
		}
		if g := ev.GetGeneration(); before.decode != "" && before.decode != w && g != 0 && g < rec.GetGeneration() {
			// A commit of an older residency of the session on w — its worker re-committed its
			// sessions after a sidecar restart while the session was reseeded elsewhere (issue
			// 16, all-sidecars-restart): the record stands and w's stale copy is released, as
			// a resync's would be. (A commit of unknown generation, or a newer one, is left
			// alone: a seed's commit may reach us before the decision's outcome.)
			s.releaseStaleLocked(w, []string{id})
			return nil
		}
		if before.decode == "" {
			rec.DecodeWorker = w
		}
		if rec.GetDecodeWorker() == w {
			rec.KvCommittedLen = ev.GetKvLen()
			if ev.GetGeneration() != 0 {
				rec.Generation = ev.GetGeneration()
			}
			s.dropCommitAwayLocked(id)
		} else {
			// A seed's commit before the decision's outcome: the record's once the outcome makes
			// w the session's decode worker (commits.go).
			s.noteCommitAwayLocked(id, w, ev.GetKvLen(), ev.GetGeneration())
		}
		rec.LastSeenUnixMs = time.Now().UnixMilli()
		s.updatedLocked(e, &before, !exists)
		s.kickDrainLocked(w)
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_RELEASED, kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED:
		if !exists || rec.GetDecodeWorker() != w {
			return nil
		}
		oldP := rec.GetSnapshot().GetPrefillWorker()
		rec.PreviousDecodeWorker = w
		rec.DecodeWorker = ""
		s.changedLocked(rec, w, oldP)
		if strings.HasPrefix(ev.GetDetail(), workerDownDetail) {
			// The decode sidecar drops every session when its worker process dies, before its
			// load report says so (sidecar-decode health.go): the worker left READY.
			s.lostLocked(w, []string{id})
		}
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED:
		if !exists {
			rec = s.getOrCreateLocked(id)
		}
		oldD, oldP := rec.GetDecodeWorker(), rec.GetSnapshot().GetPrefillWorker()
		at := ev.GetUnixMs()
		if at == 0 {
			at = time.Now().UnixMilli()
		}
		rec.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: w, Seqlen: ev.GetKvLen(), Generation: ev.GetGeneration(),
			UpdatedUnixMs: at, Bytes: ev.GetBytes()}
		s.changedLocked(rec, oldD, oldP)
		s.kickDrainLocked(oldD)
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED:
		if !exists || rec.GetSnapshot().GetPrefillWorker() != w {
			return nil
		}
		if ev.GetGeneration() != 0 && rec.GetSnapshot().GetGeneration() != ev.GetGeneration() {
			return nil // an older generation was evicted; the current snapshot stays
		}
		rec.Snapshot = nil
		s.changedLocked(rec, rec.GetDecodeWorker(), w)
	}
	return nil
}
