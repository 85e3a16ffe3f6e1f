package router

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// serve starts the standard gRPC server with the router on a port-0 loopback listener and
// returns a connected client.
func serve(t *testing.T, s *Service) *grpc.ClientConn {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpcx.NewServer(zerolog.Nop())
	s.Register(srv)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis, time.Second) }()
	conn, err := grpc.NewClient(lis.Addr().String(), append(grpcx.ClientOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return conn
}

// openRoute serves s (serve) and opens one Route stream on it, ended with the test.
func openRoute(t *testing.T, s *Service) kvcv1.RouterService_RouteClient {
	t.Helper()
	conn := serve(t, s)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	st, err := kvcv1.NewRouterServiceClient(conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestRouteStreamOverGRPC(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	conn := serve(t, f.s)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("health: %v", err)
	}
	st, err := kvcv1.NewRouterServiceClient(conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	roundTrip := func(req *kvcv1.RouteRequest) *kvcv1.RouteResponse {
		t.Helper()
		if err := st.Send(req); err != nil {
			t.Fatalf("send: %v", err)
		}
		resp, err := st.Recv()
		if err != nil {
			t.Fatalf("recv: %v", err)
		}
		return resp
	}
	// Bad input first: errors name the request, the stream stays up.
	bad := roundTrip(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{RequestId: "bad-1", SessionId: "", InputTokens: 5}}})
	if bad.GetError().GetCode() != int32(codes.InvalidArgument) || bad.GetError().GetRequestId() != "bad-1" {
		t.Fatalf("bad query: %v", bad)
	}
	if e := roundTrip(&kvcv1.RouteRequest{}).GetError(); e.GetCode() != int32(codes.InvalidArgument) {
		t.Fatalf("empty request: %v", e)
	}
	if e := roundTrip(outcome("nope", true, okKind, 0)).GetError(); e.GetCode() != int32(codes.NotFound) {
		t.Fatalf("unknown outcome: %v", e)
	}
	d := roundTrip(query("s", 0, 3000, 100)).GetDecision()
	if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED || d.GetRequestId() != "r-s-0" {
		t.Fatalf("decision: %v", d)
	}
	if a := roundTrip(outcome(d.DecisionId, true, okKind, 3100)).GetOutcomeAck(); a.GetDecisionId() != d.DecisionId {
		t.Fatalf("ack: %v", a)
	}
	if e := roundTrip(outcome(d.DecisionId, true, okKind, 3100)).GetError(); e.GetCode() != int32(codes.FailedPrecondition) {
		t.Fatalf("duplicate outcome: %v", e)
	}
	if d2 := roundTrip(query("s", 1, 3500, 100)).GetDecision(); d2.GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
		t.Fatalf("second turn: %v", d2)
	}
	// Pipelined: answers come back in request order.
	const n = 200
	go func() {
		for i := range n {
			if err := st.Send(query("p", int32(i), 1000+int64(i), 10)); err != nil {
				return
			}
		}
	}()
	for i := range n {
		resp, err := st.Recv()
		if err != nil {
			t.Fatalf("recv %d: %v", i, err)
		}
		if got := resp.GetDecision().GetRequestId(); got != query("p", int32(i), 0, 0).GetQuery().RequestId {
			t.Fatalf("answer %d for %q", i, got)
		}
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("after CloseSend: %v", err)
	}
}

// TestRouteOutcomeNoAck: an outcome marked no_ack is applied without an answer (the next
// answer on the stream is the next query's decision), while one the router refuses — unknown,
// or reported twice — is still answered with its error.
func TestRouteOutcomeNoAck(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	st := openRoute(t, f.s)
	send := func(req *kvcv1.RouteRequest) {
		t.Helper()
		if err := st.Send(req); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	recv := func() *kvcv1.RouteResponse {
		t.Helper()
		resp, err := st.Recv()
		if err != nil {
			t.Fatalf("recv: %v", err)
		}
		return resp
	}
	noAck := func(req *kvcv1.RouteRequest) *kvcv1.RouteRequest {
		req.GetOutcome().NoAck = true
		return req
	}
	send(query("s", 0, 3000, 100))
	d := recv().GetDecision()
	if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("decision: %v", d)
	}
	send(noAck(outcome(d.DecisionId, true, okKind, 3100)))
	send(query("s", 1, 3500, 100))
	if got := recv(); got.GetDecision().GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
		t.Fatalf("after a no_ack outcome the next answer is %v, want the next turn's direct-to-D decision (the outcome applied, unanswered)", got)
	}
	send(noAck(outcome(d.DecisionId, true, okKind, 3100)))
	if e := recv().GetError(); e.GetCode() != int32(codes.FailedPrecondition) || e.GetDecisionId() != d.DecisionId {
		t.Fatalf("duplicate no_ack outcome: %v, want its FailedPrecondition", e)
	}
	send(noAck(outcome("nope", true, okKind, 0)))
	if e := recv().GetError(); e.GetCode() != int32(codes.NotFound) {
		t.Fatalf("unknown no_ack outcome: %v, want NotFound", e)
	}
	if err := st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("after CloseSend: %v", err)
	}
}
