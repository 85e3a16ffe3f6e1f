package sidecar_test

import (
	"context"
	"sync"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvcentric/kvcentric/pkg/sidecar/cptest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// spanHandler records the span context its Apply ran in.
type spanHandler struct {
	fakeHandler
	mu  sync.Mutex
	scs map[uint64]trace.SpanContext
}

func (h *spanHandler) Apply(ctx context.Context, c *kvcv1.Command) error {
	h.mu.Lock()
	h.scs[c.GetCommandId()] = trace.SpanContextFromContext(ctx)
	h.mu.Unlock()
	return h.fakeHandler.Apply(ctx, c)
}

// TestCommandSpan: a command carrying the control plane decision's traceparent (over a real
// Connect stream) is one span of that trace in the sidecar, child of the decision span, named
// after its action, with the command and its result as attributes; the handler runs inside it.
// A command without a traceparent is a root span of its own.
func TestCommandSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	t.Cleanup(func() { otel.SetTracerProvider(prev) })

	srv, err := cptest.Start(5, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h := &spanHandler{fakeHandler: fakeHandler{id: "d0"}, scs: map[uint64]trace.SpanContext{}}
	startLoop(t, []string{srv.Addr}, h)
	ctx := wctx(t)
	if err := srv.Wait(ctx, func(v *cptest.View) bool { return v.Resync("d0") != nil }); err != nil {
		t.Fatal(err)
	}
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	send := func(cmd *kvcv1.Command) sdktrace.ReadOnlySpan {
		t.Helper()
		id, err := srv.Send("d0", cmd)
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.Wait(ctx, func(v *cptest.View) bool { return v.Ack(id) != nil }); err != nil {
			t.Fatal(err)
		}
		for _, s := range rec.Ended() { // the span ends before the ack is sent
			for _, a := range s.Attributes() {
				if a.Key == "kvc.command_id" && a.Value.AsInt64() == int64(id) {
					h.mu.Lock()
					sc := h.scs[id]
					h.mu.Unlock()
					if sc.SpanID() != s.SpanContext().SpanID() {
						t.Fatalf("handler ran in span %v, not the command's %v", sc.SpanID(), s.SpanContext().SpanID())
					}
					return s
				}
			}
		}
		t.Fatalf("no span for command %d", id)
		return nil
	}
	s := send(&kvcv1.Command{Traceparent: "00-" + traceID + "-" + parentID + "-01",
		Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{SessionId: "s-trace", PrefillWorkerId: "p0"}}})
	if s.Name() != "kvc-sidecar set_snapshot_target" || s.SpanContext().TraceID().String() != traceID ||
		s.Parent().SpanID().String() != parentID || !s.Parent().IsRemote() {
		t.Fatalf("span %s %v parent %v", s.Name(), s.SpanContext(), s.Parent())
	}
	attrs := map[attribute.Key]string{}
	for _, a := range s.Attributes() {
		attrs[a.Key] = a.Value.String()
	}
	if attrs["kvc.session_id"] != "s-trace" || attrs["kvc.result"] != "applied" || attrs["kvc.epoch"] != "5" {
		t.Fatalf("attributes %v", attrs)
	}

	s = send(&kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}})
	if s.Name() != "kvc-sidecar drain" || s.Parent().IsValid() || s.SpanContext().TraceID().String() == traceID {
		t.Fatalf("command without traceparent: span %s parent %v", s.Name(), s.Parent())
	}
}
