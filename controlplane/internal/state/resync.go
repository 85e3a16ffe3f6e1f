package state

import "time"

// The resync window of a new term. A new leader loads residency from etcd, which may lag what
// the previous leader acknowledged (writes it could not persist: an etcd outage, a cut-off
// leader). The truth is on the decode sidecars, which report it when they attach. Until every
// decode worker loaded at the start of the term has sent its resync (or the unreachable grace has
// passed), a session the leader holds no residency for may still be resident on one of them:
// seeding or reseeding it elsewhere then would forget an acknowledged residency (issue 16:
// etcd-restart, a seed acked just before the outage decided SEED again on another worker).
// The router asks Resyncing and answers such sessions with a plain fallback meanwhile.

// Resyncing reports whether decode workers loaded at the start of this term have not all
// resynced yet (bounded by the unreachable grace from the term's start). Lock-free.
func (s *State) Resyncing() bool {
	until := s.resyncUntil.Load()
	return until != 0 && time.Now().UnixMilli() < until
}

// startResyncLocked opens the window when decode workers wait for their sidecars.
func (s *State) startResyncLocked(nowMs int64) {
	if len(s.resyncPending) == 0 {
		s.resyncUntil.Store(0)
		return
	}
	s.resyncUntil.Store(nowMs + s.Policy().GetUnreachableGraceMs())
}

// resyncAttachedLocked: decode worker id sent its full resync; the window closes with the last
// pending decode worker.
func (s *State) resyncAttachedLocked(id string) {
	if _, ok := s.resyncPending[id]; !ok {
		return
	}
	delete(s.resyncPending, id)
	if len(s.resyncPending) == 0 {
		s.resyncUntil.Store(0)
	}
}
