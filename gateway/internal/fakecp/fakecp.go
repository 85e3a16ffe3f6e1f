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
			if k.Outcome.GetNoAck() {
				continue // as the control plane: no acknowledgement asked
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

// Canned is a decision's execution plan and prefill priority as a gateway test gives them. The
// gateway carries out what the control plane decides; which plan the policy gives a mode and
// reason is the policy's rule (controlplane/internal/policy, execution.go), tested there and
// not copied here: a test names the plan it wants the gateway to carry out.
type Canned struct {
	Exec            *kvcv1.RouteExecution
	PrefillPriority int32
}

func plan(e *kvcv1.RouteExecution) *kvcv1.RouteExecution {
	e.CallDecode = true
	e.OnDecodeRefused = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D
	if e.OnTransferFailed == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_UNSPECIFIED {
		e.OnTransferFailed = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED
	}
	e.RetryAllowed = true
	return e
}

// Direct is a turn on the session's own decode worker, which keeps it (DIRECT_TO_D).
func Direct() Canned { return Canned{Exec: plan(&kvcv1.RouteExecution{KeepSession: true})} }

// Seed is a prefill on P sent to D, which opens the session and keeps it (SEED, RESEED_PREFILL),
// at low prefill priority.
func Seed() Canned {
	return Canned{Exec: plan(&kvcv1.RouteExecution{CallPrefill: true, KeepSession: true, OpenSession: true,
		Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED}), PrefillPriority: 100}
}

// ReseedSnapshot is D opening the session from its snapshot in a prefill store (RESEED_SNAPSHOT).
func ReseedSnapshot() Canned {
	return Canned{Exec: plan(&kvcv1.RouteExecution{KeepSession: true, OpenSession: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT,
		OnTransferFailed: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED})}
}

// Fallback is plain P/D: P prefills, D decodes and keeps nothing (PD_FALLBACK).
func Fallback() Canned {
	return Canned{Exec: plan(&kvcv1.RouteExecution{CallPrefill: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED})}
}

// LargeAppend is plain P/D into the session's own D, which keeps it (PD_FALLBACK with reason
// REAL_LARGE_APPEND), at low prefill priority.
func LargeAppend() Canned {
	return Canned{Exec: plan(&kvcv1.RouteExecution{CallPrefill: true, KeepSession: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED}),
		PrefillPriority: 100}
}

// DecodeOnly is a decision that calls D alone and keeps nothing (a PD_FALLBACK without a prefill
// worker).
func DecodeOnly() Canned { return Canned{Exec: plan(&kvcv1.RouteExecution{})} }

// Decision builds a decision response for q with the canned plan c.
func Decision(q *kvcv1.RouteQuery, mode kvcv1.RouteMode, reason kvcv1.RouteReason, p, d *kvcv1.WorkerRef, c Canned) *kvcv1.RouteResponse {
	return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Decision{Decision: &kvcv1.RouteDecision{
		RequestId: q.GetRequestId(), DecisionId: "d-" + q.GetRequestId(), Mode: mode, Reason: reason,
		Prefill: p, Decode: d, BootstrapRoom: 4242, Execution: c.Exec, PrefillPriority: c.PrefillPriority,
	}}}
}
