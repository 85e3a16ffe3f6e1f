package server

import (
	"context"
	"net/http"
	"strconv"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Tracing of client requests (OpenTelemetry, the global TracerProvider that obs.SetupTracing
// installs; a no-op one without it):
//
//   - traced: one server span per client request, "kvc-gateway <METHOD> <path>", child of the
//     client's own W3C traceparent when it sends one. When the answer starts, the span takes
//     the decision the gateway carried out from its X-KVC-* headers (kvc.decision_id, kvc.mode,
//     kvc.reason, kvc.decode_worker, kvc.fail_open, kvc.retries, kvc.error_kind) and the HTTP
//     status; the response carries X-KVC-Trace-Id for correlation.
//   - workerTransport: one client span per call to a worker (otelhttp), and the W3C
//     traceparent header on the request, so a worker (SGLang, kvc-sim) can continue the trace.
//
// The Route stream to the control plane is one long-lived gRPC stream (gRPC metadata is per
// stream), so the request's trace travels in the query itself: RouteQuery.traceparent is the
// request span's context (traceparent), and the control plane's decision span is its child.
// The decision id attribute names the decision too.

const tracerName = "github.com/kvcentric/kvcentric/gateway"

// w3c is the W3C Trace Context propagator, used whatever global propagator is installed.
var w3c = propagation.TraceContext{}

// traceparent is the W3C traceparent of ctx's span ("" without a valid span context).
func traceparent(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return ""
	}
	c := propagation.MapCarrier{}
	w3c.Inject(ctx, c)
	return c.Get("traceparent")
}

func traced(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := w3c.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, span := otel.Tracer(tracerName).Start(ctx, "kvc-gateway "+r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path)))
		defer span.End()
		if sid := r.Header.Get("X-Session-ID"); sid != "" {
			span.SetAttributes(attribute.String("kvc.session_id", sid))
		}
		if sc := span.SpanContext(); sc.HasTraceID() {
			w.Header().Set("X-KVC-Trace-Id", sc.TraceID().String())
		}
		tw := &traceWriter{ResponseWriter: w, span: span}
		next.ServeHTTP(tw, r.WithContext(ctx))
		tw.record(http.StatusOK)
	})
}

// traceWriter records the answer's status and decision headers on the span when the header
// is written (before a stream's first byte).
type traceWriter struct {
	http.ResponseWriter
	span trace.Span
	done bool
}

func (t *traceWriter) WriteHeader(code int) {
	t.record(code)
	t.ResponseWriter.WriteHeader(code)
}

func (t *traceWriter) Write(b []byte) (int, error) {
	t.record(http.StatusOK)
	return t.ResponseWriter.Write(b)
}

// Flush keeps streaming answers flushable through the wrapper.
func (t *traceWriter) Flush() {
	if f, ok := t.ResponseWriter.(http.Flusher); ok {
		t.record(http.StatusOK)
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the connection's own writer.
func (t *traceWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }

var traceHeaders = []struct{ header, attr string }{
	{"X-KVC-Decision-Id", "kvc.decision_id"},
	{"X-KVC-Mode", "kvc.mode"},
	{"X-KVC-Reason", "kvc.reason"},
	{"X-KVC-Decode-Worker", "kvc.decode_worker"},
	{"X-KVC-Fail-Open", "kvc.fail_open"},
	{"X-KVC-Retries", "kvc.retries"},
	{"X-KVC-Retried-From", "kvc.retried_from"},
	{"X-KVC-Error-Kind", "kvc.error_kind"},
}

func (t *traceWriter) record(code int) {
	if t.done {
		return
	}
	t.done = true
	h := t.ResponseWriter.Header()
	attrs := []attribute.KeyValue{attribute.Int("http.response.status_code", code)}
	for _, th := range traceHeaders {
		if v := h.Get(th.header); v != "" {
			attrs = append(attrs, attribute.String(th.attr, v))
		}
	}
	t.span.SetAttributes(attrs...)
	if code >= 500 {
		t.span.SetStatus(codes.Error, strconv.Itoa(code))
	}
}

// workerTransport traces every call to a worker with otelhttp
// (go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp): a client span named
// "worker <METHOD> <path>" with the HTTP semantic-convention attributes, ended when the answer's
// body is read to its end or closed (a stream's whole length), and the W3C traceparent header on
// the request so a worker (SGLang, kvc-sim) can continue the trace.
func workerTransport(base http.RoundTripper) http.RoundTripper {
	return otelhttp.NewTransport(base, otelhttp.WithPropagators(w3c),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return "worker " + r.Method + " " + r.URL.Path }))
}
