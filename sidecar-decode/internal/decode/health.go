package decode

import (
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// WorkerHealth is called by the runtime (sidecar.WorkerListener) when the worker process goes
// down or comes back. A dead worker took every session's KV with it: each session is dropped
// (its push aborted and waited out), reported EVICTED with detail "worker down: <reason>" so
// the control plane stops routing direct-to-D here and reseeds the session elsewhere (from its
// snapshot when one is usable), and rooms waiting for a transfer are failed. Sessions are also
// remembered as dropped, so a worker that was only slow and later releases one gets OK, not
// NOT_FOUND. Its last demand report is forgotten (demand.forget): no release pass, load report
// or gauge counts its waiting requests once it is seen down. Coming back needs nothing: the
// worker commits again (or re-registers its pool) and reports its demand again.
func (s *Sidecar) WorkerHealth(down bool, reason string) {
	if !down {
		s.log.Info().Str("reason", reason).Msg("worker up: accepting sessions again (no demand counted until it reports)")
		return
	}
	s.mu.Lock()
	old, had := s.demand.forget() // its requests and sessions died with it; a worker back up reports again
	s.mu.Unlock()
	if had {
		s.log.Warn().Int32("waiting_requests", old.requests).Int64("waiting_tokens", old.tokens).Int64("free_tokens", old.free).
			Int32("running_requests", old.running).Int64("unevictable_tokens", old.unevictable).Str("reason", reason).
			Msg("worker down: its last demand report is forgotten (nothing waits here until the worker reports again)")
	}
	n := s.dropAll("worker down: " + reason)
	s.log.Warn().Int("sessions_dropped", n).Str("reason", reason).Msg("worker down: its sessions are lost")
}

// dropAll drops every session and fails every open room; it returns the sessions dropped.
func (s *Sidecar) dropAll(detail string) int {
	s.mu.Lock()
	ids := make([]string, 0, len(s.sessions))
	for id := range s.sessions {
		ids = append(ids, id)
	}
	clear(s.targets)
	clear(s.hints)
	for id, r := range s.rooms {
		if r.res == nil {
			r.res = &kvcv1.TransferDoneRequest{Room: id, Error: detail}
			close(r.done)
		}
		delete(s.rooms, id)
	}
	s.mu.Unlock()
	n := 0
	for _, id := range ids {
		ss, _, ok := s.drop(id)
		if !ok {
			continue // released meanwhile (and reported by its release)
		}
		n++
		s.mu.Lock()
		if len(s.dropped) >= maxPendingTargets {
			s.dropped = map[string]struct{}{}
		}
		s.dropped[id] = struct{}{}
		s.mu.Unlock()
		s.ev.Emit(sidecar.Event{Event: sidecar.EvSessionRelease, Session: ss.id, Generation: ss.gen, Seqlen: ss.committed, Reason: detail})
		s.rep.Report(&kvcv1.SessionEvent{SessionId: ss.id, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED,
			KvLen: ss.committed, Generation: ss.gen, Detail: detail})
	}
	return n
}
