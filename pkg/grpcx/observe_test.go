package grpcx

import (
	"context"
	"net"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// TestObserveCrossesProcessBoundary: a call from a client dialled with ClientOptions to a
// NewServer server over real loopback gRPC carries the caller's trace (W3C traceparent
// metadata): the server's span is in the caller's trace, child of the client's span; and
// both sides count the call per method.
func TestObserveCrossesProcessBoundary(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev) })

	reg := prometheus.NewRegistry()
	if err := RegisterMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if err := RegisterMetrics(reg); err != nil {
		t.Fatalf("second registration: %v", err)
	}
	srv := NewServer(zerolog.Nop())
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx, lis, time.Second) }()
	defer func() { cancel(); <-done }()

	conn, err := grpc.NewClient(lis.Addr().String(), append(ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cctx, root := tp.Tracer("test").Start(t.Context(), "request")
	if _, err := healthpb.NewHealthClient(conn).Check(cctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	root.End()
	want := root.SpanContext().TraceID()

	var client, server sdktrace.ReadOnlySpan
	deadline := time.Now().Add(5 * time.Second)
	for server == nil || client == nil {
		for _, s := range rec.Ended() {
			switch {
			case s.SpanKind() == trace.SpanKindServer && s.Name() == "grpc.health.v1.Health/Check":
				server = s
			case s.SpanKind() == trace.SpanKindClient && s.Name() == "grpc.health.v1.Health/Check":
				client = s
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("spans: client %v server %v of %d", client != nil, server != nil, len(rec.Ended()))
		}
		time.Sleep(5 * time.Millisecond) // the server span ends after the client has its answer
	}
	if client.SpanContext().TraceID() != want || server.SpanContext().TraceID() != want {
		t.Fatalf("trace ids: request %s client %s server %s", want, client.SpanContext().TraceID(), server.SpanContext().TraceID())
	}
	if server.Parent().SpanID() != client.SpanContext().SpanID() || !server.Parent().IsRemote() {
		t.Fatalf("server span's parent %v, want the client span %v (remote)", server.Parent(), client.SpanContext())
	}

	rr := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rr, httptest.NewRequest("GET", "/metrics", nil))
	text := rr.Body.String()
	for _, want := range []string{
		`grpc_server_handled_total{grpc_code="OK",grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} `,
		`grpc_client_handled_total{grpc_code="OK",grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} `,
		`grpc_server_handling_seconds_count{grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} `,
		`grpc_client_handling_seconds_count{grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} `,
		// pre-registered at 0 by Serve: a method never called is listed
		`grpc_server_started_total{grpc_method="Watch",grpc_service="grpc.health.v1.Health",grpc_type="server_stream"} `,
	} {
		if !strings.Contains(text, want) {
			t.Errorf("metric %s missing", want)
		}
	}
}
