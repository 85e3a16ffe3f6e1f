package state

import (
	"fmt"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// SendCommand queues a command on the worker's sidecar stream; command_id (monotonic) and
// epoch are filled in. It fails when the worker has no live stream or its queue is full. A
// tensor-parallel group (named by its rank 0's worker id) gets it on every rank's stream, each
// copy naming the peer group's rank of the same index (tp.go); it fails, sending nothing, when
// a rank has no stream.
func (s *State) SendCommand(workerID string, cmd *kvcv1.Command) error {
	if cmd == nil {
		return fmt.Errorf("state: nil command")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.term.acting() {
		s.m.cmdNoStream.Inc()
		return fmt.Errorf("%w: renew deadline passed or term ended", ErrNotLeader)
	}
	return s.sendUnitLocked(workerID, cmd)
}

func (s *State) sendLocked(st *Stream, cmd *kvcv1.Command) error {
	cmd.CommandId = s.nextCmdID.Add(1)
	cmd.Epoch = s.epoch.Load()
	select {
	case st.q <- &kvcv1.ConnectResponse{Msg: &kvcv1.ConnectResponse_Command{Command: cmd}}:
	default:
		s.m.cmdQueueFull.Inc()
		return fmt.Errorf("%w: %s", ErrQueueFull, st.WorkerID)
	}
	st.mu.Lock()
	if len(st.pending) < maxPendingAcks {
		st.pending[cmd.CommandId] = time.Now()
	}
	st.mu.Unlock()
	s.m.cmdSent.Inc()
	return nil
}

// Ack records a sidecar's ack of a command. It reports false for an ack of a command this
// stream was never sent (or already acked).
func (s *State) Ack(st *Stream, a *kvcv1.CommandAck) bool {
	st.mu.Lock()
	_, ok := st.pending[a.GetCommandId()]
	delete(st.pending, a.GetCommandId())
	st.mu.Unlock()
	if !ok {
		return false
	}
	if a.GetOk() {
		s.m.cmdAcked.Inc()
	} else {
		s.m.cmdFailed.Inc()
		s.log.Warn().Str("worker", st.WorkerID).Uint64("command_id", a.GetCommandId()).Str("error", a.GetError()).Msg("command failed on sidecar")
	}
	return true
}
