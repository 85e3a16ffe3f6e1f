package app

import (
	"testing"

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
