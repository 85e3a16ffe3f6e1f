package state

import (
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// ResendTargets names the snapshot target again for the sessions a decode sidecar's full
// resync lists without one (has_snapshot_target false: a restarted sidecar keeps targets only
// in memory, and the router names them only at a seed or reseed outcome), so re-committed
// sessions push D→P snapshots again. Call it after Reconcile; only sessions the table holds
// resident on that worker, in the reported generation (when known), are named. When the
// target's store holds the session's snapshot of the same generation, the command carries it
// as the valid base (that worker pushed it, policy.ResyncBase), so the first push after the
// restart is an append; the session's agent hints follow on their own command. It returns how
// many targets were sent.
func (s *State) ResendTargets(st *Stream, rs *kvcv1.ResidentSessions) (int, error) {
	if st.Role != kvcv1.WorkerRole_WORKER_ROLE_DECODE || !rs.GetFullSync() {
		return 0, nil
	}
	if !s.Policy().GetSnapshotsEnabled() {
		return 0, nil
	}
	ws := *s.snapshot.Load()
	now := time.Now().UnixMilli()
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.workers[st.WorkerID]
	if !ok || e.stream != st || s.term == nil {
		return 0, ErrNoStream
	}
	// A rank of a tensor-parallel group names the prefill group's rank of its own index
	// (tp.go); the sessions are the group's.
	unit, rank, size := s.unitLocked(st.WorkerID), s.rankLocked(st.WorkerID), int32(1)
	if ids, ok := s.view.ranks[unit]; ok {
		size = int32(len(ids))
	}
	if unit == "" {
		return 0, nil
	}
	sent := 0
	var err error
	for _, r := range rs.GetSessions() {
		if r.GetHasSnapshotTarget() {
			continue
		}
		x, ok := s.sessions[r.GetSessionId()]
		if !ok || x.rec == nil {
			continue
		}
		rec := x.rec
		if rec.GetDecodeWorker() != unit || (r.GetGeneration() != 0 && r.GetGeneration() != rec.GetGeneration()) {
			continue
		}
		t, _ := policy.TargetCommand(ws, policy.Target{Session: rec.GetSessionId(), Generation: rec.GetGeneration(),
			Current: rec.GetSnapshot().GetPrefillWorker(), TP: size, Base: policy.ResyncBase(rec, r.GetKvCommittedLen())})
		if t == nil {
			continue
		}
		cmds := [2]*kvcv1.Command{{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: t}}}
		// The restarted sidecar lost the session's agent hints with its target (router/hints.go).
		if h := policy.HintsCommand(rec.GetSessionId(), rec.GetPinnedUntilUnixMs(), rec.GetLowPriority(), now, false); h != nil {
			cmds[1] = &kvcv1.Command{Action: &kvcv1.Command_SetSessionHints{SetSessionHints: h}}
		}
		for _, cmd := range cmds {
			if cmd == nil {
				continue
			}
			if s.view.unit != nil {
				if cmd, err = s.rankCommandLocked(cmd, rank, size, false); err != nil {
					return sent, err
				}
			}
			if err := s.sendLocked(st, cmd); err != nil {
				return sent, err
			}
		}
		sent++
	}
	return sent, nil
}
