package decode

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Hello describes this sidecar.
func (s *Sidecar) Hello() *kvcv1.Hello {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := &kvcv1.Hello{WorkerId: s.cfg.WorkerID, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, Node: s.cfg.Node, GpuIndex: s.cfg.GPUIndex,
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

// Resync lists the sessions the worker holds.
func (s *Sidecar) Resync() *kvcv1.ResidentSessions {
	rs := &kvcv1.ResidentSessions{}
	for _, si := range s.Sessions() {
		rs.Sessions = append(rs.Sessions, &kvcv1.ResidentSession{SessionId: si.SessionID, KvCommittedLen: si.CommittedLen, Generation: si.Generation,
			HasSnapshotTarget: si.PrefillWorker != ""})
	}
	return rs
}

// Load reports used tokens (sum of committed lengths; those of sessions no push pins are
// evictable), the worker's unevictable tokens, running requests and prealloc queue as it last
// reported them (ReportDemand), rooms waiting for their transfer and snapshot pushes running or queued.
func (s *Sidecar) Load() *kvcv1.WorkerLoad {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := &kvcv1.WorkerLoad{ResidentSessions: int32(len(s.sessions)), InflightPushes: int32(s.inflight)}
	now := time.Now()
	for _, ss := range s.sessions {
		l.UsedTokens += ss.committed
		switch {
		case s.rel.enabled():
			// What the capacity release can free: sessions whose snapshot is or can be made
			// current (release.go); a worker that never evicts frees nothing else.
			// a pinned session stays; so does one the worker would not release just now (in use),
			// and one committed or loaded less than the release's minimum idle time ago (its conversation
			// is going on: the release will not take it, so it is not room a plan can count on)
			if s.releasableLocked(ss) && !pinnedAt(ss, now) && !inUseAt(ss, now) && !s.recentLocked(ss, now) {
				l.EvictableTokens += ss.committed
			}
		case ss.push == nil:
			l.EvictableTokens += ss.committed // the worker's LRU may evict it; a push pins it
		}
	}
	l.TransferQueueDepth = s.waitingRoomsLocked()
	// pushes running plus queued
	l.InflightPushes += int32(len(s.queue))
	// The worker's prealloc queue as it last reported it (ReportDemand; a worker that does not
	// report shows 0, and so does one seen down until it reports again: demand.forget): the policy's queue score then sends a reseed to a D where nothing waits
	// for pages rather than behind the waiting requests of a full one (issue 20). The worker's
	// retracted queue is not visible here.
	l.PreallocQueueDepth = s.demand.requests
	// The worker's requests as it last reported them (ReportDemand; 0 from a worker that sends
	// none): those holding their pages run, those in the prealloc queue wait.
	l.RunningRequests, l.WaitingRequests = s.demand.running, s.demand.requests
	// The worker's own count of what it cannot free (its sessions in use), part of used: the
	// control plane takes the larger of it and used − evictable as pinned.
	l.UnevictableTokens = min(s.demand.unevictable, l.UsedTokens)
	return l
}

// Policy applies snapshot_delta_tokens and snapshots_enabled.
func (s *Sidecar) Policy(p *kvcv1.Policy) {
	if p == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if p.SnapshotDeltaTokens != nil && p.GetSnapshotDeltaTokens() > 0 {
		s.delta = p.GetSnapshotDeltaTokens()
	}
	if p.SnapshotsEnabled != nil {
		s.enabled = p.GetSnapshotsEnabled()
	}
}

// Apply carries out SetSnapshotTarget, SetSessionHints, ReleaseSession, Drain and LoadSession
// commands.
func (s *Sidecar) Apply(ctx context.Context, cmd *kvcv1.Command) error {
	switch a := cmd.GetAction().(type) {
	case *kvcv1.Command_SetSnapshotTarget:
		return s.setTarget(a.SetSnapshotTarget)
	case *kvcv1.Command_SetSessionHints:
		return s.setHints(a.SetSessionHints)
	case *kvcv1.Command_ReleaseSession:
		id := a.ReleaseSession.GetSessionId()
		if id == "" {
			return fmt.Errorf("release_session without session_id")
		}
		s.mu.Lock()
		if len(s.dropped) >= maxPendingTargets {
			s.dropped = map[string]struct{}{}
		}
		s.dropped[id] = struct{}{}
		s.mu.Unlock()
		// Both wait (an in-flight push, the worker's ack): they must not block the command
		// stream, and they outlive it (a stream that ends still leaves the release done).
		go s.releaseForControlPlane(context.WithoutCancel(ctx), id, a.ReleaseSession.GetReason())
		return nil
	case *kvcv1.Command_Drain:
		if a.Drain.GetDraining() { // undrain: nothing to undo (pushes go back to the delta rule)
			s.drainFlush() // drain.go
		}
		return nil
	case *kvcv1.Command_LoadSession:
		return s.startLoad(ctx, a.LoadSession) // load.go: acked at once, LOADED / LOAD_FAILED at the end
	default:
		return fmt.Errorf("command %T is not for a decode sidecar", a)
	}
}

const maxPendingTargets = 65536

// releaseForControlPlane carries out the control plane's ReleaseSessionCommand: the sidecar
// stops tracking the session (waiting out an in-flight push), then has the worker free its KV
// (WorkerReleaseCommand, reason CONTROL_PLANE, through WatchCommands: the worker calls
// ReleaseSession and frees the pages). Without it a session moved away (a stale copy found at a
// resync, a drain, a migration) would stay in the worker's pool: a leak and a second copy. A
// worker that does not hold the session, or refuses (a request uses it), is logged.
func (s *Sidecar) releaseForControlPlane(ctx context.Context, id, why string) {
	s.drop(id)
	actx, cancel := context.WithTimeout(ctx, s.rel.cfg.AckTimeout)
	defer cancel()
	ack, err := s.att.Send(actx, &kvcv1.WatchCommandsResponse{Reason: kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CONTROL_PLANE,
		Command: &kvcv1.WatchCommandsResponse_Release{Release: &kvcv1.WorkerReleaseCommand{SessionId: id}}})
	if err == nil && !ack.GetOk() {
		err = fmt.Errorf("worker refused: %s", ack.GetError())
	}
	if err != nil {
		s.log.Warn().Str("session", id).Str("why", why).Str("error", status.Convert(err).Message()).Msg("control plane's release not carried out on the worker")
		return
	}
	s.log.Info().Str("session", id).Str("why", why).Int64("freed_tokens", ack.GetFreedTokens()).Msg("session released on the control plane's command")
}

func (s *Sidecar) setTarget(t *kvcv1.SetSnapshotTargetCommand) error {
	if err := kvcv1.ValidateID("session_id", t.GetSessionId()); err != nil {
		return err
	}
	if t.GetPrefillWorkerId() != "" && (t.GetPeerAddr() == "" || t.GetTransferEndpoint() == "") {
		return fmt.Errorf("set_snapshot_target for %s names %s without peer_addr and transfer_endpoint", t.GetSessionId(), t.GetPrefillWorkerId())
	}
	id := t.GetSessionId()
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := (hints{untilMs: t.GetPinnedUntilUnixMs(), low: t.GetLowPriority()}); h != (hints{}) {
		// An earlier control plane's hints, carried on the target (hints.go): zero values
		// leave the session's hints as they are.
		if err := s.setHintsLocked(id, h); err != nil {
			return err
		}
	}
	ss, ok := s.sessions[id]
	if t.GetPrefillWorkerId() == "" { // stop pushes
		delete(s.targets, id)
		if ok {
			ss.target = nil
		}
		return nil
	}
	if !ok {
		if len(s.targets) >= maxPendingTargets {
			return fmt.Errorf("too many targets for sessions not committed yet")
		}
		s.targets[id] = t
		return nil
	}
	old := ss.target
	newTarget := old == nil || old.GetGeneration() != t.GetGeneration() || old.GetPrefillWorkerId() != t.GetPrefillWorkerId()
	ss.target, ss.gen = t, t.GetGeneration()
	if newTarget {
		ss.lastPushed, ss.retagFrom, ss.idsPushed = 0, 0, false
		ss.validBaseLocked(t)
	}
	ss.failedLen = 0 // a new target deserves a new attempt
	s.maybeEnqueueLocked(ss)
	return nil
}

// validBaseLocked applies a new target's valid base (SetSnapshotTargetCommand.valid_base_len):
// tokens [0, valid_base_len) of the session here are the target store's snapshot of
// base_generation, so they count as pushed, and the next push is an append — re-tagging the
// store's entry when base_generation is an older generation (a snapshot reseed). A base longer
// than what the worker committed is ignored (a full push then, as without one).
func (ss *session) validBaseLocked(t *kvcv1.SetSnapshotTargetCommand) {
	b, from := t.GetValidBaseLen(), t.GetBaseGeneration()
	if b <= 0 || from == 0 || from > t.GetGeneration() || b > ss.committed {
		return
	}
	ss.lastPushed = b
	if from != t.GetGeneration() {
		ss.retagFrom = from
	}
}
