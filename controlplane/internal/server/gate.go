package server

import (
	"context"
	"strings"
	"sync"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// LeaderOnlyServices are gated: served only by the leader.
var LeaderOnlyServices = []string{
	kvcv1.SidecarService_ServiceDesc.ServiceName,
	kvcv1.RouterService_ServiceDesc.ServiceName,
}

// HealthSetter is the part of the gRPC health server the gate drives.
type HealthSetter interface {
	SetServingStatus(service string, status healthpb.HealthCheckResponse_ServingStatus)
}

// Gate opens leader-only services while this replica leads.
type Gate struct {
	notLeader func() error
	health    HealthSetter

	mu sync.RWMutex
	// term is the leadership's context (nil when not leading): its Err is the admission
	// check (for the election's Term it checks the renew deadline on every call). open
	// derives from it and is cancelled by Close, so admitted calls end at once when the term
	// ends or the gate closes, whichever is first.
	term  context.Context
	open  context.Context
	close context.CancelFunc
}

// NewGate returns a closed gate. notLeader builds the error for calls on a standby.
func NewGate(notLeader func() error, health HealthSetter) *Gate {
	g := &Gate{notLeader: notLeader, health: health}
	g.setHealth(false)
	return g
}

// Open opens the gate for a term; calls and streams admitted meanwhile are cancelled when the
// term ends or the gate closes.
func (g *Gate) Open(term context.Context) {
	open, cancel := context.WithCancel(term)
	g.mu.Lock()
	if g.close != nil {
		g.close()
	}
	g.term, g.open, g.close = term, open, cancel
	g.mu.Unlock()
	g.setHealth(true)
}

// Close closes the gate (health NOT_SERVING for the gated services) and ends the calls and
// streams it admitted.
func (g *Gate) Close() {
	g.mu.Lock()
	if g.close != nil {
		g.close()
	}
	g.term, g.open, g.close = nil, nil, nil
	g.mu.Unlock()
	g.setHealth(false)
}

func (g *Gate) setHealth(serving bool) {
	if g.health == nil {
		return
	}
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if serving {
		st = healthpb.HealthCheckResponse_SERVING
	}
	for _, s := range LeaderOnlyServices {
		g.health.SetServingStatus(s, st)
	}
}

func gated(method string) bool {
	for _, s := range LeaderOnlyServices {
		if strings.HasPrefix(method, "/"+s+"/") {
			return true
		}
	}
	return false
}

// current returns the term's context, for the admission check, and the gate's, which ends
// admitted calls.
func (g *Gate) current() (term, open context.Context) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	return g.term, g.open
}

// Unary is the unary interceptor.
func (g *Gate) Unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if !gated(info.FullMethod) {
		return h(ctx, req)
	}
	term, open := g.current()
	if term == nil || term.Err() != nil {
		return nil, g.notLeader()
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(open, cancel)
	defer stop()
	return h(ctx, req)
}

// Stream is the stream interceptor.
func (g *Gate) Stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if !gated(info.FullMethod) {
		return h(srv, ss)
	}
	term, open := g.current()
	if term == nil || term.Err() != nil {
		return g.notLeader()
	}
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	stop := context.AfterFunc(open, cancel)
	defer stop()
	return h(srv, &ctxStream{ServerStream: ss, ctx: ctx})
}

type ctxStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *ctxStream) Context() context.Context { return s.ctx }

// SetHealth attaches the health server (the gated services start NOT_SERVING).
func (g *Gate) SetHealth(h HealthSetter) {
	g.mu.Lock()
	g.health = h
	serving := g.term != nil
	g.mu.Unlock()
	g.setHealth(serving)
}
