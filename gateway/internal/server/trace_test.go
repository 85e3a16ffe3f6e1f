package server

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func recordSpans(t *testing.T) *tracetest.SpanRecorder {
	rec := tracetest.NewSpanRecorder()
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	t.Cleanup(func() { otel.SetTracerProvider(prev) })
	return rec
}

func attr(s sdktrace.ReadOnlySpan, key string) string {
	for _, a := range s.Attributes() {
		if a.Key == attribute.Key(key) {
			return a.Value.String()
		}
	}
	return ""
}

// TestRequestTrace: a client request that sends its own traceparent is one trace: the
// gateway's server span continues it, carries the decision it executed (decision id, mode,
// decode worker), and each call to a worker is a client span in the same trace; the answer
// names the trace in X-KVC-Trace-Id.
func TestRequestTrace(t *testing.T) {
	rec := recordSpans(t)
	direct := decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct())
	queried := make(chan string, 4) // the queries' traceparent, as the control plane received them
	e := setup(t, func(q *kvcv1.RouteQuery, p, d *fakeWorker) *kvcv1.RouteResponse {
		queried <- q.GetTraceparent()
		return direct(q, p, d)
	}, nil, nil, 0)
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	req, _ := http.NewRequest(http.MethodPost, e.gw.URL+"/generate", strings.NewReader(`{"text":"hi","stream":true}`))
	req.Header.Set("X-Session-ID", "s-trace")
	req.Header.Set("traceparent", "00-"+traceID+"-"+parentID+"-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(body), "[DONE]") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if got := resp.Header.Get("X-KVC-Trace-Id"); got != traceID {
		t.Fatalf("X-KVC-Trace-Id %q, want %s", got, traceID)
	}
	var server sdktrace.ReadOnlySpan
	var workers []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		switch {
		case s.SpanKind() == trace.SpanKindServer:
			server = s
		case s.SpanKind() == trace.SpanKindClient && strings.HasPrefix(s.Name(), "worker "):
			workers = append(workers, s)
		}
	}
	if server == nil || len(workers) == 0 {
		t.Fatalf("spans: server %v, worker calls %d", server != nil, len(workers))
	}
	if server.SpanContext().TraceID().String() != traceID || server.Parent().SpanID().String() != parentID || !server.Parent().IsRemote() {
		t.Fatalf("server span %v parent %v", server.SpanContext(), server.Parent())
	}
	if got, want := attr(server, "kvc.decision_id"), resp.Header.Get("X-KVC-Decision-Id"); got == "" || got != want {
		t.Fatalf("kvc.decision_id %q, answer's X-KVC-Decision-Id %q", got, want)
	}
	if attr(server, "kvc.mode") != resp.Header.Get("X-KVC-Mode") || attr(server, "kvc.decode_worker") != "d0" ||
		attr(server, "kvc.session_id") != "s-trace" || attr(server, "http.response.status_code") != "200" {
		t.Fatalf("server span attributes %v", server.Attributes())
	}
	// The query carried the request span's context through the Route stream: the control
	// plane's decision span is its child (controlplane router's TestDecisionSpan).
	if got, want := <-queried, "00-"+traceID+"-"+server.SpanContext().SpanID().String()+"-01"; got != want {
		t.Fatalf("RouteQuery.traceparent %q, want %q (the request span)", got, want)
	}
	for _, w := range workers {
		if w.SpanContext().TraceID().String() != traceID || w.Parent().SpanID() != server.SpanContext().SpanID() {
			t.Fatalf("worker call %s not a child of the request span", w.Name())
		}
	}
}

// TestWorkerCallCarriesTraceparent: a call to a worker through the gateway's transport
// (otelhttp) is exported as a client span of the caller's trace, with its status, and the
// worker receives the trace as a W3C traceparent naming that span; the caller's request is not
// changed.
func TestWorkerCallCarriesTraceparent(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	prev := otel.GetTracerProvider()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(context.Background()) })
	got := make(chan string, 1)
	w := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		got <- r.Header.Get("traceparent")
		rw.WriteHeader(503)
		_, _ = io.WriteString(rw, "busy")
	}))
	defer w.Close()
	ctx, span := otel.Tracer("test").Start(t.Context(), "request")
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, w.URL+"/generate", nil)
	resp, err := (&http.Client{Transport: workerTransport(http.DefaultTransport)}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if len(exp.GetSpans()) != 0 {
		t.Fatal("client span ended before the answer's body was read")
	}
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	span.End()
	tp0 := <-got
	if req.Header.Get("traceparent") != "" {
		t.Fatal("caller's request modified")
	}
	var call *tracetest.SpanStub
	for _, s := range exp.GetSpans() {
		if s.SpanKind == trace.SpanKindClient {
			call = &s
		}
	}
	if call == nil || call.Name != "worker POST /generate" {
		t.Fatalf("exported %v, want a client span worker POST /generate", exp.GetSpans())
	}
	want := "00-" + span.SpanContext().TraceID().String() + "-" + call.SpanContext.SpanID().String() + "-01"
	status := ""
	for _, a := range call.Attributes {
		if a.Key == "http.response.status_code" {
			status = a.Value.String()
		}
	}
	if tp0 != want || status != "503" || call.Status.Code.String() != "Error" || call.Parent.SpanID() != span.SpanContext().SpanID() {
		t.Fatalf("traceparent %q, want %q; span %v %v", tp0, want, call.Attributes, call.Status)
	}
}
