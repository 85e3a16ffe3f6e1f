package obs

import (
	"context"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

func TestSetupTracing(t *testing.T) {
	prevTP, prevProp := otel.GetTracerProvider(), otel.GetTextMapPropagator()
	t.Cleanup(func() { otel.SetTracerProvider(prevTP); otel.SetTextMapPropagator(prevProp) })
	if _, err := SetupTracing(t.Context(), Tracing{Service: "x", SampleRatio: 2}); err == nil {
		t.Fatal("ratio 2 accepted")
	}

	// No exporter: ids made and propagated, new traces not sampled, a sampled caller followed.
	stop, err := SetupTracing(t.Context(), Tracing{Service: "x"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = stop(context.Background()) }()
	_, root := otel.Tracer("t").Start(t.Context(), "root")
	if sc := root.SpanContext(); !sc.HasTraceID() || sc.IsSampled() || root.IsRecording() {
		t.Fatalf("root without exporter: %v recording %v", sc, root.IsRecording())
	}
	carrier := propagation.MapCarrier{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	ctx := otel.GetTextMapPropagator().Extract(t.Context(), carrier)
	_, child := otel.Tracer("t").Start(ctx, "child")
	if sc := child.SpanContext(); sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || !sc.IsSampled() {
		t.Fatalf("child of a sampled caller: %v", sc)
	}

	// An exporter: new traces sampled and exported.
	exp := tracetest.NewInMemoryExporter()
	stop2, err := SetupTracing(t.Context(), Tracing{Service: "x", Exporter: exp})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = stop2(context.Background()) }()
	_, s := otel.Tracer("t").Start(t.Context(), "exported", trace.WithSpanKind(trace.SpanKindServer))
	s.End()
	if got := exp.GetSpans(); len(got) != 1 || got[0].Name != "exported" {
		t.Fatalf("exported %v", got)
	}
	if got := exp.GetSpans()[0].Resource.Attributes(); len(got) == 0 || got[0].Value.AsString() != "x" {
		t.Fatalf("resource %v", got)
	}
}
