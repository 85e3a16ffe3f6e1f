package state

import (
	"fmt"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// maxPendingAcks bounds the commands tracked per stream while waiting for their acks.
const maxPendingAcks = 4096

// Stream is a live sidecar stream as the state sees it: an outgoing command queue and the
// commands awaiting acks.
type Stream struct {
	WorkerID string
	Role     kvcv1.WorkerRole

	q         chan *kvcv1.ConnectResponse
	done      chan struct{}
	closeOnce sync.Once

	mu      sync.Mutex
	pending map[uint64]time.Time

	// synced is set (under State.mu) once the stream's first full resync is applied: a
	// decode sidecar sends the events it raised while disconnected before it (residency.go).
	synced bool
}

// Queue is the stream's outgoing messages, for its send loop.
func (st *Stream) Queue() <-chan *kvcv1.ConnectResponse { return st.q }

// Done is closed when the state closes the stream (leadership ended).
func (st *Stream) Done() <-chan struct{} { return st.done }

func (st *Stream) close() { st.closeOnce.Do(func() { close(st.done) }) }

// Attach registers a sidecar's stream after its hello (already validated). It refuses a
// second live stream for the same worker id (ErrDuplicate) and a hello that has seen a newer
// epoch than ours (ErrStaleLeader).
func (s *State) Attach(h *kvcv1.Hello) (*Stream, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.term.acting() {
		return nil, ErrNotLeader
	}
	if h.GetLastEpochSeen() > s.epoch.Load() {
		return nil, ErrStaleLeader
	}
	id := h.GetWorkerId()
	e, ok := s.workers[id]
	if ok && e.stream != nil {
		return nil, ErrDuplicate
	}
	if err := s.checkTPLocked(h); err != nil {
		return nil, err // a TPError (tp.go)
	}
	now := time.Now().UnixMilli()
	if !ok {
		e = &workerEntry{w: &kvcv1.Worker{WorkerId: id, RegisteredUnixMs: now}}
		s.workers[id] = e
	}
	if e.grace != nil {
		e.grace.Stop()
		e.grace = nil
	}
	if old := e.w.GetRole(); old != kvcv1.WorkerRole_WORKER_ROLE_UNSPECIFIED && (old != h.GetRole() || shapeOf(e.w) != helloShape(h)) {
		// The worker changed role, or its tensor-parallel group, rank or size (it is another
		// unit now): what it held before is gone.
		s.dropResidencyLocked(id)
	}
	e.gen++
	st := &Stream{
		WorkerID: id, Role: h.GetRole(),
		q:       make(chan *kvcv1.ConnectResponse, s.cfg.CommandQueue),
		done:    make(chan struct{}),
		pending: make(map[uint64]time.Time),
	}
	e.stream = st
	s.setWorkerLocked(e, true, func(w *kvcv1.Worker) {
		w.Role = h.GetRole()
		w.Node = h.GetNode()
		w.GpuIndex = h.GetGpuIndex()
		w.WorkerUrl = h.GetWorkerUrl()
		w.TransferEndpoint = h.GetTransferEndpoint()
		w.Transport = h.GetTransport()
		w.KvCapacityTokens = h.GetKvCapacityTokens()
		w.KvBytesPerToken = h.GetKvBytesPerToken()
		w.PeerAddr = h.GetPeerAddr()
		w.TpGroup, w.TpRank, w.TpSize = h.GetTpGroup(), h.GetTpRank(), h.GetTpSize()
		w.State = kvcv1.WorkerState_WORKER_STATE_READY
		if w.GetDraining() {
			w.State = kvcv1.WorkerState_WORKER_STATE_DRAINING
		}
		w.UnreachableSinceUnixMs = 0
		w.LastHeartbeatUnixMs = now
		w.ConnectedTo = s.cfg.NodeID
		if w.RegisteredUnixMs == 0 {
			w.RegisteredUnixMs = now
		}
		setWorkerDown(w, h.GetWorkerDown(), h.GetWorkerDownReason(), now)
	})
	ev := s.log.Info().Str("worker", id).Str("role", h.GetRole().String())
	if h.GetTpGroup() != "" || h.GetTpSize() > 1 {
		ev = ev.Str("tp_group", h.GetTpGroup()).Int32("tp_rank", h.GetTpRank()).Int32("tp_size", h.GetTpSize()).Str("unit", s.unitLocked(id))
	}
	ev.Msg("sidecar connected")
	s.kickDrainLocked(id)
	if h.GetWorkerDown() {
		s.workerDownLocked(e, h.GetWorkerDownReason())
	}
	return st, nil
}

// Detach marks the stream's worker UNREACHABLE at once and starts its grace timer: unless it
// reconnects, its residency is dropped when the grace period ends.
func (s *State) Detach(st *Stream) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st.close()
	e, ok := s.workers[st.WorkerID]
	if !ok || e.stream != st {
		return
	}
	e.stream = nil
	e.gen++
	if s.term == nil {
		return
	}
	s.setWorkerLocked(e, true, func(w *kvcv1.Worker) {
		w.State = kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
		w.UnreachableSinceUnixMs = time.Now().UnixMilli()
		w.ConnectedTo = ""
	})
	s.startGraceLocked(e)
	s.log.Warn().Str("worker", st.WorkerID).Msg("sidecar stream dropped: worker unreachable")
}

func (s *State) startGraceLocked(e *workerEntry) {
	grace := time.Duration(s.Policy().GetUnreachableGraceMs()) * time.Millisecond
	id, gen, term := e.w.GetWorkerId(), e.gen, s.term
	e.grace = time.AfterFunc(grace, func() { s.graceExpired(term, id, gen) })
}

func (s *State) graceExpired(term *Term, id string, gen uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.term != term || term == nil {
		return
	}
	e, ok := s.workers[id]
	if !ok || e.gen != gen || e.stream != nil {
		return
	}
	n := s.dropResidencyLocked(id)
	s.log.Warn().Str("worker", id).Int("sessions", n).Msg("unreachable grace over: residency dropped")
}

// dropResidencyLocked clears every session's residency and snapshot on worker id — on its
// tensor-parallel group when it is a rank of one (a rank's loss is the group's; tp.go).
func (s *State) dropResidencyLocked(id string) int {
	for _, sid := range keys(s.tpSnapBy[id]) {
		s.setShardLocked(sid, id, nil) // the rank's shards of its group's snapshots
	}
	if id = s.unitLocked(id); id == "" {
		return 0
	}
	n := 0
	lost := keys(s.byDecode[id])
	for _, sid := range lost {
		rec := s.sessions[sid].rec
		oldP := rec.GetSnapshot().GetPrefillWorker()
		rec.PreviousDecodeWorker = id
		rec.DecodeWorker = ""
		s.changedLocked(rec, id, oldP)
		n++
	}
	s.lostLocked(id, lost) // re-homed elsewhere from their snapshots (router/rehome.go)
	for _, sid := range keys(s.bySnap[id]) {
		rec := s.sessions[sid].rec
		rec.Snapshot = nil
		s.changedLocked(rec, rec.GetDecodeWorker(), id)
		n++
	}
	s.m.dropped.Add(float64(n))
	s.kickDrainLocked(id)
	return n
}

func keys(m map[string]struct{}) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// ApplyLoad records a load report in memory; the worker record (with its load) is written
// to etcd at most every loadPersistEvery.
func (s *State) ApplyLoad(st *Stream, load *kvcv1.WorkerLoad) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.workers[st.WorkerID]
	if !ok || e.stream != st {
		return ErrNoStream
	}
	down, reason := load.GetWorkerDown(), load.GetWorkerDownReason()
	changed := down != (e.w.GetState() == kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN)
	s.setWorkerLocked(e, changed || time.Since(e.saved) >= loadPersistEvery, func(w *kvcv1.Worker) {
		w.Load = proto.Clone(load).(*kvcv1.WorkerLoad)
		w.LastHeartbeatUnixMs = time.Now().UnixMilli()
		if changed {
			setWorkerDown(w, down, reason, w.LastHeartbeatUnixMs)
		}
	})
	switch {
	case changed && down:
		s.workerDownLocked(e, reason)
	case changed:
		s.log.Info().Str("worker", st.WorkerID).Msg("sidecar reports its worker up again: routable")
	}
	return nil
}

// setWorkerDown sets a connected worker's state from its sidecar's worker_down report:
// WORKER_DOWN (since the first report) or back to READY / DRAINING.
func setWorkerDown(w *kvcv1.Worker, down bool, reason string, nowMs int64) {
	if down {
		if w.GetWorkerDownSinceUnixMs() == 0 {
			w.WorkerDownSinceUnixMs = nowMs
		}
		w.WorkerDownReason = reason
		w.State = kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN
		return
	}
	w.WorkerDownSinceUnixMs, w.WorkerDownReason = 0, ""
	w.State = kvcv1.WorkerState_WORKER_STATE_READY
	if w.GetDraining() {
		w.State = kvcv1.WorkerState_WORKER_STATE_DRAINING
	}
}

// workerDownLocked acts on a worker whose sidecar reports the worker process down: it takes
// no new work (state WORKER_DOWN: not routable). A decode worker's sessions died with it: their
// residency is dropped now (the sidecar reports them evicted too), so their next turn reseeds
// on another decode worker — from the snapshot when usable. A prefill worker keeps its
// snapshots: they live in the sidecar's store, which still serves RESEED_SNAPSHOT.
func (s *State) workerDownLocked(e *workerEntry, reason string) {
	id := s.unitLocked(e.w.GetWorkerId()) // a rank's worker down takes its group down (tp.go)
	s.m.workerDown.Inc()
	n := 0
	if e.w.GetRole() == kvcv1.WorkerRole_WORKER_ROLE_DECODE && id != "" {
		lost := keys(s.byDecode[id])
		for _, sid := range lost {
			rec := s.sessions[sid].rec
			rec.PreviousDecodeWorker = id
			rec.DecodeWorker = ""
			s.changedLocked(rec, id, rec.GetSnapshot().GetPrefillWorker())
			n++
		}
		s.lostLocked(id, lost) // re-homed elsewhere from their snapshots (router/rehome.go)
	}
	s.log.Warn().Str("worker", e.w.GetWorkerId()).Str("unit", id).Str("role", e.w.GetRole().String()).Str("reason", reason).Int("sessions_dropped", n).
		Msg("sidecar reports its worker down: not routable")
}

// Drain sets (or clears) a worker's draining flag, persists it and, when a decode worker is
// connected, sends it a DrainCommand. Setting it starts the drain's mover (drain.go), which
// moves the worker's resident sessions off; clearing it stops the mover.
func (s *State) Drain(id string, draining bool) (*kvcv1.Worker, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.term.acting() {
		return nil, ErrNotLeader
	}
	e, ok := s.workers[id]
	if !ok {
		return nil, ErrUnknownWorker
	}
	if grouped(e.w) && s.unitLocked(id) != id {
		return nil, fmt.Errorf("%w (%s is rank %d of group %q)", ErrTPMember, id, e.w.GetTpRank(), e.w.GetTpGroup())
	}
	s.setWorkerLocked(e, true, func(w *kvcv1.Worker) {
		w.Draining = draining
		if st := w.GetState(); st != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE && st != kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN {
			w.State = kvcv1.WorkerState_WORKER_STATE_READY
			if draining {
				w.State = kvcv1.WorkerState_WORKER_STATE_DRAINING
			}
		}
	})
	// A decode sidecar pushes every session's unpushed tail on it (the mover waits for those
	// snapshots); a prefill worker's drain only stops new work going to it: its sidecar is not told.
	if e.w.GetRole() == kvcv1.WorkerRole_WORKER_ROLE_DECODE {
		for _, st := range s.rankStreamsLocked(id) { // every connected rank of a group
			if err := s.sendLocked(st, &kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{Draining: draining}}}); err != nil {
				s.log.Warn().Err(err).Str("worker", st.WorkerID).Msg("drain command not sent")
			}
		}
	}
	if draining {
		s.startDrainLocked(e) // drain.go: moves its resident sessions off
	} else {
		s.stopDrainLocked(id)
	}
	return s.listedLocked(id), nil
}
