package fakecp

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Decider answers one query: a decision, an error, or nil for "never answer".
type Decider func(q *kvcv1.RouteQuery) *kvcv1.RouteResponse

// Server is a fake control plane replica.
type Server struct {
	kvcv1.UnimplementedRouterServiceServer
	kvcv1.UnimplementedAdminServiceServer

	Addr     string
	Outcomes chan *kvcv1.RouteOutcome
	Queries  chan *kvcv1.RouteQuery
	// Streams counts the Route streams opened (refused ones included).
	Streams atomic.Int64

	mu      sync.Mutex
	decide  Decider
	hint    *kvcv1.LeaderHint
	workers []*kvcv1.Worker
	srv     *grpcx.Server
}

// Start serves a fake control plane on 127.0.0.1:0 until the test ends; opts are extra server
// options (grpcx.WithTLS for a mutual-TLS control plane).
func Start(t testing.TB, decide Decider, opts ...grpcx.Option) *Server {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{Addr: lis.Addr().String(), decide: decide, Outcomes: make(chan *kvcv1.RouteOutcome, 1024), Queries: make(chan *kvcv1.RouteQuery, 1024)}
	s.srv = grpcx.NewServer(zerolog.Nop(), append([]grpcx.Option{grpcx.WithCallLogging(false)}, opts...)...)
	kvcv1.RegisterRouterServiceServer(s.srv, s)
	kvcv1.RegisterAdminServiceServer(s.srv, s)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = s.srv.Serve(ctx, lis, time.Second); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return s
}

// Stop stops serving now (a crashed control plane).
func (s *Server) Stop() { s.srv.Stop() }

// SetStandby makes Route fail with UNAVAILABLE and a hint naming leaderAddr.
func (s *Server) SetStandby(leaderAddr string) {
	s.mu.Lock()
	s.hint = &kvcv1.LeaderHint{LeaderId: "leader", LeaderAddr: leaderAddr}
	s.mu.Unlock()
}

// SetWorkers sets what ListWorkers answers.
func (s *Server) SetWorkers(ws []*kvcv1.Worker) {
	s.mu.Lock()
	s.workers = ws
	s.mu.Unlock()
}

// Route implements RouterService.
func (s *Server) Route(stream grpc.BidiStreamingServer[kvcv1.RouteRequest, kvcv1.RouteResponse]) error {
	s.Streams.Add(1)
	s.mu.Lock()
	hint := s.hint
	s.mu.Unlock()
	if hint != nil {
		return cpclient.NotLeaderError(hint)
	}
	var sendMu sync.Mutex
	send := func(r *kvcv1.RouteResponse) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return stream.Send(r)
	}
	for {
		req, err := stream.Recv()
		if err != nil {
			return nil
		}
		switch k := req.GetKind().(type) {
		case *kvcv1.RouteRequest_Query:
			select {
			case s.Queries <- k.Query:
			default:
			}
			s.mu.Lock()
			d := s.decide
			s.mu.Unlock()
			resp := d(k.Query)
			if resp == nil {
				continue
			}
			if err := send(resp); err != nil {
				return err
			}
		case *kvcv1.RouteRequest_Outcome:
			select {
			case s.Outcomes <- k.Outcome:
			default:
			}
			if err := send(&kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_OutcomeAck{OutcomeAck: &kvcv1.OutcomeAck{DecisionId: k.Outcome.GetDecisionId()}}}); err != nil {
				return err
			}
		}
	}
}

// ListWorkers implements AdminService.
func (s *Server) ListWorkers(_ context.Context, r *kvcv1.ListWorkersRequest) (*kvcv1.ListWorkersResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*kvcv1.Worker
	for _, w := range s.workers {
		if r.GetRole() == kvcv1.WorkerRole_WORKER_ROLE_UNSPECIFIED || r.GetRole() == w.GetRole() {
			out = append(out, w)
		}
	}
	return &kvcv1.ListWorkersResponse{Workers: out}, nil
}

// Decision builds a decision response for q with Exec's plan.
func Decision(q *kvcv1.RouteQuery, mode kvcv1.RouteMode, reason kvcv1.RouteReason, p, d *kvcv1.WorkerRef) *kvcv1.RouteResponse {
	return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Decision{Decision: &kvcv1.RouteDecision{
		RequestId: q.GetRequestId(), DecisionId: "d-" + q.GetRequestId(), Mode: mode, Reason: reason,
		Prefill: p, Decode: d, BootstrapRoom: 4242, Execution: Exec(mode, reason, p != nil, d != nil),
		PrefillPriority: PrefillPriority(mode, reason),
	}}}
}

// PrefillPriority is the prefill priority the control plane's policy gives a decision of this
// mode and reason (docs/routing.md, "Prefill priority"), copied here for the gateway's tests:
// 100 (low) when the session is or stays resident on D after a prefill, 0 otherwise.
func PrefillPriority(mode kvcv1.RouteMode, reason kvcv1.RouteReason) int32 {
	switch {
	case mode == kvcv1.RouteMode_ROUTE_MODE_SEED, mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL,
		mode == kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK && reason == kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND:
		return 100
	}
	return 0
}

// Exec is the execution plan the control plane's policy gives a decision of this mode and
// reason (controlplane/internal/policy, execution.go), copied here for the gateway's tests: the
// gateway module does not link the control plane.
func Exec(mode kvcv1.RouteMode, reason kvcv1.RouteReason, prefill, decode bool) *kvcv1.RouteExecution {
	e := &kvcv1.RouteExecution{
		CallDecode:       decode,
		Transfer:         kvcv1.TransferKind_TRANSFER_KIND_SEED,
		OnDecodeRefused:  kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D,
		OnTransferFailed: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED,
		RetryAllowed:     true,
	}
	switch mode {
	case kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D:
		e.Transfer, e.KeepSession = kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED, true
	case kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL:
		e.CallPrefill, e.KeepSession, e.OpenSession = prefill, true, true
	case kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT:
		e.KeepSession, e.OpenSession = true, true
		e.Transfer = kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT
		e.OnTransferFailed = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED
	case kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK:
		e.CallPrefill = prefill
		e.KeepSession = reason == kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND
	}
	if !decode {
		e.KeepSession, e.OpenSession = false, false
	}
	return e
}
