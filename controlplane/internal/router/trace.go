package router

import (
	"context"
	"encoding/hex"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvcentric/kvcentric/pkg/obs"
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

// traceparentCarrier is the query's traceparent as the one header a TextMapCarrier holds:
// Extract reads it without the map a propagation.MapCarrier would allocate per decision.
type traceparentCarrier string

func (c traceparentCarrier) Get(key string) string {
	if key == "traceparent" {
		return string(c)
	}
	return ""
}
func (traceparentCarrier) Set(string, string) {}
func (traceparentCarrier) Keys() []string     { return []string{"traceparent"} }

// noSpan is the span of a query without a traceparent.
var noSpan = trace.SpanFromContext(context.Background())

// startDecision starts q's decision span and returns it with the W3C traceparent its commands
// carry ("" when the span context is not valid). The gateway always sends a traceparent (its
// request span has a valid context even when nothing is exported). A query without one gets no
// span (other callers: tests); one whose trace is not sampled gets none either while the
// installed sampler follows the parent (obs.SamplesUnsampledParents), and its commands carry
// the query's traceparent itself — the common case of a cluster that exports no traces, where
// the span cost about 1.6 µs and 7 allocations per decision (BenchmarkDecisionSpanProduction).
func startDecision(q *kvcv1.RouteQuery) (trace.Span, string) {
	tp := q.GetTraceparent()
	if tp == "" {
		return noSpan, ""
	}
	if unsampledTraceparent(tp) && !obs.SamplesUnsampledParents() {
		// The request's trace is not sampled, so no span of this decision would be recorded
		// (the installed sampler follows the parent): the commands carry the request's own
		// context on, as a span that records nothing would, without its cost (about 1 µs and
		// six allocations per decision on the development machine: BenchmarkDecisionSpanProduction).
		return noSpan, tp
	}
	ctx := context.Background()
	if len(tp) <= maxTraceparent {
		ctx = w3c.Extract(ctx, traceparentCarrier(tp))
	}
	_, span := otel.Tracer(tracerName).Start(ctx, "kvc-controlplane route")
	sc := span.SpanContext()
	if !sc.IsValid() {
		return span, ""
	}
	return span, formatTraceparent(sc)
}

// unsampledTraceparent reports whether tp is a well-formed version-00 W3C traceparent (W3C Trace
// Context §3.2: "00-", 32 and 16 lowercase hex digits, neither all zeros, 2 of flags, joined by
// dashes) whose sampled flag is clear — one that propagation.TraceContext extracts as a valid,
// unsampled span context and formatTraceparent writes back unchanged (FuzzUnsampledTraceparent).
func unsampledTraceparent(tp string) bool {
	if len(tp) != 55 || tp[0] != '0' || tp[1] != '0' || tp[2] != '-' || tp[35] != '-' || tp[52] != '-' ||
		tp[53] != '0' || (tp[54] != '0' && tp[54] != '2') {
		// Flags 00 or 02: the sampled bit (0x01) clear, and no bit above 0x02, which
		// propagation.TraceContext refuses in version 00.
		return false
	}
	return lowerHexNotZero(tp[3:35]) && lowerHexNotZero(tp[36:52])
}

// lowerHexNotZero reports whether s is lowercase hex digits, not all '0'.
func lowerHexNotZero(s string) bool {
	var bad, bits byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		bad |= notLowerHex[c]
		bits |= c ^ '0'
	}
	return bad == 0 && bits != 0
}

// notLowerHex is 1 for every byte but '0'-'9' and 'a'-'f'.
var notLowerHex = func() (t [256]byte) {
	for c := range t {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			t[c] = 1
		}
	}
	return t
}()

// formatTraceparent is sc as a version-00 W3C traceparent, built in one allocation (the
// concatenation of the ids' String forms took four).
func formatTraceparent(sc trace.SpanContext) string {
	var b [55]byte // "00-" 32 hex "-" 16 hex "-" 2 hex
	tid, sid, flags := sc.TraceID(), sc.SpanID(), sc.TraceFlags()
	b[0], b[1], b[2] = '0', '0', '-'
	hex.Encode(b[3:35], tid[:])
	b[35] = '-'
	hex.Encode(b[36:52], sid[:])
	b[52] = '-'
	hex.Encode(b[53:55], []byte{byte(flags)})
	return string(b[:])
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
