package app

import (
	"fmt"

	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// leaseHolder is the part of the election the guard needs.
type leaseHolder interface{ IsLeader() bool }

// leaderGuard is the router's view of the state, checked against the election on every
// call. The election's IsLeader also checks the renew deadline on the monotonic clock, so a
// replica whose lease may have lapsed (resumed after SIGSTOP, cut off from etcd) decides as
// if no leader were known (epoch 0: control-plane-unavailable fallback) and sends no command,
// even before its term's goroutines have noticed and closed the term.
type leaderGuard struct {
	*state.State
	lead leaseHolder
}

// Epoch is the term's epoch, or 0 when this replica may not act as leader.
func (g leaderGuard) Epoch() int64 {
	if !g.lead.IsLeader() {
		return 0
	}
	return g.State.Epoch()
}

// UpdateSession applies fn only while this replica may act as leader (the router then
// decides without session state).
func (g leaderGuard) UpdateSession(id string, fn func(rec *kvcv1.SessionRecord)) {
	if g.lead.IsLeader() {
		g.State.UpdateSession(id, fn)
	}
}

// SendCommand queues a command only while this replica may act as leader.
func (g leaderGuard) SendCommand(workerID string, cmd *kvcv1.Command) error {
	if !g.lead.IsLeader() {
		return fmt.Errorf("%w: renew deadline passed or term ended", state.ErrNotLeader)
	}
	return g.State.SendCommand(workerID, cmd)
}
