package app

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/controlplane/internal/server"
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

// leaseCheck refuses new calls to the leader-only services (server.LeaderOnlyServices) while
// the election says this replica may not act as leader, before the gate, whose term context
// is cancelled only when the watchdog ends the term: no stream attaches in between.
type leaseCheck struct {
	lead      leaseHolder
	notLeader func() error
}

func leaderOnly(method string) bool {
	for _, s := range server.LeaderOnlyServices {
		if strings.HasPrefix(method, "/"+s+"/") {
			return true
		}
	}
	return false
}

// Unary is the unary interceptor.
func (c leaseCheck) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if leaderOnly(info.FullMethod) && !c.lead.IsLeader() {
		return nil, c.notLeader()
	}
	return h(ctx, req)
}

// Stream is the stream interceptor.
func (c leaseCheck) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if leaderOnly(info.FullMethod) && !c.lead.IsLeader() {
		return c.notLeader()
	}
	return h(srv, ss)
}
