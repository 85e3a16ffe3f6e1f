package router

import (
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// roomSeq is the sequence number of the decision whose transfer room is room (room's inverse;
// false for a value room never returns).
func (s *Service) roomSeq(room int64) (uint64, bool) {
	if room <= 0 || room > maxRoom+1 {
		return 0, false
	}
	seq := (uint64(room-1) - s.roomBase) & maxRoom
	return seq, seq != 0 && s.room(seq) == room
}

// TransferLanded is the state's delivery of a decode sidecar's TRANSFER_DONE (ok) event:
// the KV of the seed or reseed whose bootstrap room is ev.room has landed on decode worker
// worker. The transfer ends now, not at the decision's outcome after the turn has decoded: it
// no longer keeps the worker's LOCAL_LARGE_APPEND path shut ("no transfer into D in flight":
// Reserved.Landed) nor counts against max_concurrent_transfers (its store-transfer slot). Its
// tokens, and its count in the queue score's Transfers and in Seeds (its turn still decodes
// there), stay until the outcome. An event of no pending transfer (its outcome came first,
// another term's room, a store load's room) changes nothing. Called outside the state's lock.
func (s *Service) TransferLanded(worker string, ev *kvcv1.SessionEvent) {
	seq, ok := s.roomSeq(ev.GetRoom())
	if !ok {
		s.m.landed.WithLabelValues("unknown").Inc()
		return
	}
	s.mu.Lock()
	released := s.led.landed(seq, worker, ev.GetSessionId())
	s.mu.Unlock()
	if released {
		s.m.landed.WithLabelValues("released").Inc()
		return
	}
	s.m.landed.WithLabelValues("unknown").Inc()
}

func newLandedMetric() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvc_router_transfers_landed_total",
		Help: "Decode sidecars' TRANSFER_DONE events of seeds and reseeds, by result: released (the decision's transfer ended when its KV landed, before its outcome: its store-transfer slot given back, no longer a transfer into the worker for the local large append), unknown (no pending transfer of that room, session and worker: its outcome came first, or another term's).",
	}, []string{"result"})
}
