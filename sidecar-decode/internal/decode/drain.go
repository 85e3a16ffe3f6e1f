package decode

import (
	"github.com/kvcentric/kvcentric/pkg/sidecar"
)

// evDrainFlush is the event of a drain flush that queued a push (counted in
// kvc_sidecar_events_total{event="snapshot_drain_flush"}).
const evDrainFlush = "snapshot_drain_flush"

// drainFlush carries out the control plane's DrainCommand{draining: true}. The control plane's
// drain mover releases each session of this worker once its D→P snapshot can reseed it, and
// releases it without one (its next turn re-prefills) when the snapshot does not catch up
// within --drain-snapshot-wait. Regular pushes go out only every snapshot_delta_tokens, so
// the unpushed tail of every session with a snapshot target is pushed now, whatever its size
// (as the idle flush does for one idle session). It returns how many sessions it queued.
func (s *Sidecar) drainFlush() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, ss := range s.sessions {
		if ss.gone || ss.target == nil || ss.committed <= ss.lastPushed {
			continue
		}
		prev, pending := ss.forcePush, ss.queued
		ss.forcePush = true // a push running now re-queues the tail it does not carry (pushSession)
		if !s.maybeEnqueueLocked(ss) {
			ss.forcePush = prev // nowhere to push (snapshots off, its push just failed)
			continue
		}
		n++
		if !pending {
			s.ev.Emit(sidecar.Event{Event: evDrainFlush, Session: ss.id, Generation: ss.target.GetGeneration(), BaseLen: ss.lastPushed,
				Tokens: ss.committed - ss.lastPushed, Peer: ss.target.GetPrefillWorkerId(), Reason: "drain"})
		}
	}
	if n > 0 {
		s.log.Info().Int("sessions", n).Msg("drain: pushing every session's unpushed tail")
	}
	return n
}
