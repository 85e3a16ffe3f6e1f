package app

import (
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestTraceCrossesIntoControlPlane: a call made the way the gateway dials the control plane
// (grpcx.DialOptions) inside a traced request reaches the control plane in the same trace —
// W3C traceparent in the gRPC metadata — and the control plane records its server span in
// its exporter (here in memory; --otlp-endpoint in production).
func TestTraceCrossesIntoControlPlane(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a", func(o *Options) { o.traceExporter = exp })
	c.waitLeader(t)

	conn, err := grpc.NewClient(c.grpcAddr, grpcx.DialOptions(nil)...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, req := otel.Tracer("kvc-gateway").Start(t.Context(), "POST /generate")
	if _, err := kvcv1.NewAdminServiceClient(conn).ListWorkers(ctx, &kvcv1.ListWorkersRequest{}); err != nil {
		t.Fatal(err)
	}
	req.End()
	want := req.SpanContext().TraceID()
	waitFor(t, "control plane server span in the request's trace", func() bool {
		for _, s := range exp.GetSpans() {
			if s.SpanKind == trace.SpanKindServer && s.Name == "kvc.v1.AdminService/ListWorkers" {
				if s.SpanContext.TraceID() != want || !s.Parent.IsRemote() {
					t.Fatalf("server span trace %s (remote parent %v), want %s", s.SpanContext.TraceID(), s.Parent.IsRemote(), want)
				}
				return true
			}
		}
		return false
	})
}

// TestDecisionTraceEndToEnd (issue 15 item 8): on a real control plane (etcd, gRPC), a query
// sent over the Route stream with a request span's traceparent — what the gateway sends — is
// decided in a span of that trace, child of the request span, exported with the decision id;
// and the command the decision causes on the decode sidecar's Connect stream (the turn's agent
// hints, SetSessionHintsCommand) carries the decision span's context.
func TestDecisionTraceEndToEnd(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a", func(o *Options) { o.traceExporter = exp })
	c.waitLeader(t)
	ctx := t.Context()
	if _, _, err := open(t, c, &kvcv1.Hello{WorkerId: "p0", Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Node: "n1",
		KvCapacityTokens: 100000, WorkerUrl: "http://p0", PeerAddr: "127.0.0.1:1", TransferEndpoint: "p0-seg"}); err != nil {
		t.Fatal(err)
	}
	d0, _, err := open(t, c, decodeHello("d0"))
	if err != nil {
		t.Fatal(err)
	}
	traced := make(chan *kvcv1.Command, 16)
	go func() {
		for {
			m, err := d0.stream.Recv()
			if err != nil {
				return
			}
			cmd := m.GetCommand()
			if cmd == nil {
				continue
			}
			if cmd.GetTraceparent() != "" {
				traced <- cmd
			}
			_ = d0.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Ack{Ack: &kvcv1.CommandAck{CommandId: cmd.GetCommandId(), Ok: true}}})
		}
	}()
	if err := d0.send(resident(true, "tr-1")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "session resident", func() bool {
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "tr-1"})
		return err == nil && r.GetSession().GetDecodeWorker() == "d0"
	})

	_, req := otel.Tracer("kvc-gateway").Start(ctx, "POST /generate") // the gateway's request span
	rsc := req.SpanContext()
	req.End()
	rs, err := kvcv1.NewRouterServiceClient(c.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "r1", SessionId: "tr-1", Turn: 1, InputTokens: 500, MaxOutputTokens: 64, PinMs: 30_000,
		Traceparent: "00-" + rsc.TraceID().String() + "-" + rsc.SpanID().String() + "-01",
	}}}); err != nil {
		t.Fatal(err)
	}
	resp, err := rs.Recv()
	if err != nil {
		t.Fatal(err)
	}
	d := resp.GetDecision()
	if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
		t.Fatalf("decision %v", resp)
	}
	var decision trace.SpanContext
	waitFor(t, "the decision span in the request's trace", func() bool {
		for _, s := range exp.GetSpans() {
			if s.Name != "kvc-controlplane route" {
				continue
			}
			for _, a := range s.Attributes {
				if a.Key == "kvc.decision_id" && a.Value.AsString() == d.GetDecisionId() {
					if s.SpanContext.TraceID() != rsc.TraceID() || s.Parent.SpanID() != rsc.SpanID() {
						t.Fatalf("decision span trace %s parent %s, want %s / %s", s.SpanContext.TraceID(), s.Parent.SpanID(), rsc.TraceID(), rsc.SpanID())
					}
					decision = s.SpanContext
					return true
				}
			}
		}
		return false
	})
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
		DecisionId: d.GetDecisionId(), Success: true, KvLenAfter: 564, ExecutedMode: d.GetMode(),
	}}}); err != nil {
		t.Fatal(err)
	}
	if resp, err := rs.Recv(); err != nil || resp.GetOutcomeAck() == nil {
		t.Fatalf("outcome answer %v %v", resp, err)
	}
	want := "00-" + decision.TraceID().String() + "-" + decision.SpanID().String() + "-01"
	select {
	case cmd := <-traced:
		if cmd.GetSetSessionHints().GetSessionId() != "tr-1" || cmd.GetTraceparent() != want {
			t.Fatalf("command %v, want the hints of tr-1 with traceparent %s", cmd, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no command carried the decision's trace")
	}
}
