package router

import (
	"context"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Traces of decisions (issue 15 item 8). The Route stream is long-lived, so a request's trace
// cannot travel in its gRPC metadata: the gateway puts its request span's context in the query
// (RouteQuery.traceparent). Each decision is a span, "kvc-controlplane route", child of that
// context when it is a valid W3C traceparent (else the root of a trace of its own), with the
// decision as attributes (kvc.decision_id, kvc.mode, kvc.reason, kvc.session_id,
// kvc.decode_worker, kvc.prefill_worker). The commands the control plane sends for the decision
// — push_snapshot with it, release_session and set_snapshot_target after its outcome — carry the
// decision span's context (Command.traceparent), so a sidecar's span per command joins the
// request's trace. The tracer is the global TracerProvider's (obs.SetupTracing; a no-op one
// without it still propagates the query's trace id).

const tracerName = "github.com/kvcentric/kvcentric/controlplane/router"

// maxTraceparent bounds the query's traceparent (55 characters in version 00; later versions
// may append fields): a longer one is ignored, not refused.
const maxTraceparent = 256

var w3c = propagation.TraceContext{}

// noSpan is the span of a query without a traceparent.
var noSpan = trace.SpanFromContext(context.Background())

// startDecision starts q's decision span and returns it with its W3C traceparent ("" when
// the span context is not valid). A query without a traceparent gets no span: the gateway
// always sends one (its request span has a valid context even when nothing is exported), so
// only other callers (kvc-bench's policy runs, tests) skip it, and they skip its cost (about
// 0.7 µs and 3 allocations per decision with no tracer provider: BenchmarkHandle).
func startDecision(q *kvcv1.RouteQuery) (trace.Span, string) {
	tp := q.GetTraceparent()
	if tp == "" {
		return noSpan, ""
	}
	ctx := context.Background()
	if len(tp) <= maxTraceparent {
		ctx = w3c.Extract(ctx, propagation.MapCarrier{"traceparent": tp})
	}
	_, span := otel.Tracer(tracerName).Start(ctx, "kvc-controlplane route")
	sc := span.SpanContext()
	if !sc.IsValid() {
		return span, ""
	}
	return span, "00-" + sc.TraceID().String() + "-" + sc.SpanID().String() + "-" + sc.TraceFlags().String()
}

// endDecision records the decision on its span and ends it.
func endDecision(span trace.Span, q *kvcv1.RouteQuery, d *kvcv1.RouteDecision) {
	if span.IsRecording() {
		span.SetAttributes(
			// A copy: the id's bytes live in the answer's block, which a Route stream recycles.
			attribute.String("kvc.decision_id", strings.Clone(d.GetDecisionId())),
			attribute.String("kvc.mode", ModeName(d.GetMode())),
			attribute.String("kvc.reason", ReasonName(d.GetReason())),
			attribute.String("kvc.session_id", q.GetSessionId()),
			attribute.String("kvc.decode_worker", d.GetDecode().GetWorkerId()),
			attribute.String("kvc.prefill_worker", d.GetPrefill().GetWorkerId()),
		)
	}
	span.End()
}
