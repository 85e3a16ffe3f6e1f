package router

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	"github.com/kvcentric/kvcentric/pkg/obs"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func spanAttr(s sdktrace.ReadOnlySpan, key string) string {
	for _, a := range s.Attributes() {
		if a.Key == attribute.Key(key) {
			return a.Value.String()
		}
	}
	return ""
}

// TestDecisionSpan: a query carrying the gateway request span's traceparent is decided in a
// span of the same trace, child of that span, with the decision as attributes; the commands
// sent for the decision (the snapshot target after its outcome) carry the decision span's
// context. A malformed or missing traceparent starts a trace of the control plane's own.
func TestDecisionSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	t.Cleanup(func() { otel.SetTracerProvider(prev) })

	f := newFixture(t, basicCluster()...)
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	req := query("s-trace", 0, 1_000, 50)
	req.GetQuery().Traceparent = "00-" + traceID + "-" + parentID + "-01"
	d := f.s.Handle(req).GetDecision()
	if d == nil || d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("decision %v", d)
	}
	ended := rec.Ended()
	if len(ended) != 1 {
		t.Fatalf("%d spans, want 1", len(ended))
	}
	span := ended[0]
	if span.Name() != "kvc-controlplane route" || span.SpanContext().TraceID().String() != traceID ||
		span.Parent().SpanID().String() != parentID || !span.Parent().IsRemote() {
		t.Fatalf("span %s %v parent %v", span.Name(), span.SpanContext(), span.Parent())
	}
	for k, want := range map[string]string{"kvc.decision_id": d.DecisionId, "kvc.mode": "SEED", "kvc.reason": ReasonName(d.Reason),
		"kvc.session_id": "s-trace", "kvc.decode_worker": d.Decode.WorkerId, "kvc.prefill_worker": d.Prefill.WorkerId} {
		if got := spanAttr(span, k); got != want {
			t.Fatalf("%s = %q, want %q", k, got, want)
		}
	}

	// The outcome makes the session resident: its snapshot target is a command of this decision.
	f.report(d.DecisionId, true, okKind, 1_050)
	cmds := f.c.Commands(d.Decode.WorkerId)
	want := "00-" + traceID + "-" + span.SpanContext().SpanID().String() + "-01"
	if len(cmds) == 0 || cmds[len(cmds)-1].GetSetSnapshotTarget() == nil || cmds[len(cmds)-1].GetTraceparent() != want {
		t.Fatalf("commands %v, want a set_snapshot_target with traceparent %s", cmds, want)
	}

	for name, tp := range map[string]string{"malformed": "00-xyz", "too long": "00-" + strings.Repeat("a", 300)} {
		t.Run(name, func(t *testing.T) {
			rec.Reset()
			req := query("s-"+strings.ReplaceAll(name, " ", "-"), 0, 100, 10)
			req.GetQuery().Traceparent = tp
			if f.s.Handle(req).GetDecision() == nil {
				t.Fatal("no decision")
			}
			ended := rec.Ended()
			if len(ended) != 1 || ended[0].Parent().IsValid() || !ended[0].SpanContext().IsValid() {
				t.Fatalf("spans %d, want one root span", len(ended))
			}
		})
	}
	// No traceparent (not from the gateway): no span, no trace on the commands.
	rec.Reset()
	d = f.s.Handle(query("s-none", 0, 100, 10)).GetDecision()
	f.report(d.DecisionId, true, okKind, 110)
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("%d spans for a query without traceparent", n)
	}
	if cmds := f.c.Commands(d.Decode.WorkerId); len(cmds) == 0 || cmds[len(cmds)-1].GetTraceparent() != "" {
		t.Fatalf("commands %v", cmds)
	}
}

// TestDecisionSpanKeepsItsID: a decision id's bytes live in the answer's block, which a Route
// stream recycles once the answer is sent; the span recorded for the decision keeps its own
// copy, so the next decisions (reusing the block) do not change it.
func TestDecisionSpanKeepsItsID(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))
	t.Cleanup(func() { otel.SetTracerProvider(prev) })

	f := newFixture(t, basicCluster()...)
	var ids []string
	for i := range 4 {
		req := query("s-recycled-"+string(rune('a'+i)), 0, 1_000, 50)
		req.GetQuery().Traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
		resp, m := f.s.handle(req, true) // the stream's path: a pooled block
		if resp.GetDecision() == nil || m == nil {
			t.Fatalf("query %d: %v", i, resp)
		}
		ids = append(ids, strings.Clone(resp.GetDecision().GetDecisionId()))
		m.recycle() // sent: the block serves the next answer
	}
	ended := rec.Ended()
	if len(ended) != len(ids) {
		t.Fatalf("%d spans, want %d", len(ended), len(ids))
	}
	for i, span := range ended {
		if got := spanAttr(span, "kvc.decision_id"); got != ids[i] {
			t.Fatalf("span %d: kvc.decision_id %q after its block was recycled, want %q", i, got, ids[i])
		}
	}
}

// TestDecisionDebugLine: a router whose logger writes debug events logs each decision; at info
// (or with zerolog's global level above debug) it logs none.
func TestDecisionDebugLine(t *testing.T) {
	for _, tc := range []struct {
		name          string
		level, global zerolog.Level
		want          bool
	}{
		{"debug", zerolog.DebugLevel, zerolog.TraceLevel, true},
		{"info", zerolog.InfoLevel, zerolog.TraceLevel, false},
		{"global info", zerolog.DebugLevel, zerolog.InfoLevel, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prev := zerolog.GlobalLevel()
			zerolog.SetGlobalLevel(tc.global)
			defer zerolog.SetGlobalLevel(prev)
			var buf bytes.Buffer
			s := New(routertest.New(basicCluster()...), zerolog.New(&buf).Level(tc.level), nil)
			if s.Handle(query("s-log", 0, 1_000, 50)).GetDecision() == nil {
				t.Fatal("no decision")
			}
			if got := strings.Contains(buf.String(), `"message":"decision"`); got != tc.want {
				t.Fatalf("decision line logged %v, want %v: %s", got, tc.want, buf.String())
			}
		})
	}
}

// BenchmarkDecisionSpanProduction: the same with the provider obs.SetupTracing installs for a
// control plane without an exporter (the SDK, parent-based, never sampling a new trace), for a
// gateway query whose request span is not sampled (a gateway without an exporter either) and
// for one that is.
func BenchmarkDecisionSpanProduction(b *testing.B) {
	prev := otel.GetTracerProvider()
	stop, err := obs.SetupTracing(b.Context(), obs.Tracing{Service: "kvc-controlplane"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = stop(context.Background()); otel.SetTracerProvider(prev) })
	for _, flags := range []string{"00", "01"} {
		b.Run("flags-"+flags, func(b *testing.B) {
			q := &kvcv1.RouteQuery{Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-" + flags}
			d := &kvcv1.RouteDecision{DecisionId: "d1-1"}
			b.ReportAllocs()
			for b.Loop() {
				span, _ := startDecision(q)
				endDecision(span, q, d)
			}
		})
	}
}

// TestUnsampledRequestNoSpan: a query whose request trace is not sampled starts no span while
// the sampler follows the parent (every configuration but a non-parent-based
// OTEL_TRACES_SAMPLER), and the decision's commands carry the query's own traceparent, the
// trace the sidecars' spans join; with OTEL_TRACES_SAMPLER=always_on and an exporter the
// decision is a span of that trace as before.
func TestUnsampledRequestNoSpan(t *testing.T) {
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
	prev := otel.GetTracerProvider()
	t.Cleanup(func() { otel.SetTracerProvider(prev) })
	for _, tc := range []struct {
		name    string
		sampler string
		spans   int
	}{
		{name: "parent-based", spans: 0},
		{name: "always_on", sampler: "always_on", spans: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exp := tracetest.NewInMemoryExporter()
			t.Setenv("OTEL_TRACES_SAMPLER", tc.sampler)
			stop, err := obs.SetupTracing(t.Context(), obs.Tracing{Service: "kvc-controlplane", Exporter: exp})
			if err != nil {
				t.Fatal(err)
			}
			f := newFixture(t, basicCluster()...)
			req := query("s-unsampled-"+tc.name, 0, 1_000, 50)
			req.GetQuery().Traceparent = tp
			d := f.s.Handle(req).GetDecision()
			if d == nil {
				t.Fatal("no decision")
			}
			f.report(d.DecisionId, true, okKind, 1_050)
			spans := exp.GetSpans() // before stop: the exporter's Shutdown drops them
			if err := stop(context.Background()); err != nil {
				t.Fatal(err)
			}
			if len(spans) != tc.spans {
				t.Fatalf("%d spans, want %d", len(spans), tc.spans)
			}
			want := tp
			if tc.spans == 1 {
				want = formatTraceparent(spans[0].SpanContext)
			}
			cmds := f.c.Commands(d.Decode.WorkerId)
			if len(cmds) == 0 || cmds[len(cmds)-1].GetTraceparent() != want {
				t.Fatalf("commands %v, want the last with traceparent %s", cmds, want)
			}
		})
	}
}

// FuzzUnsampledTraceparent: unsampledTraceparent accepts exactly the strings that
// propagation.TraceContext extracts as a valid, unsampled span context and that
// formatTraceparent writes back unchanged (the canonical version-00 form).
func FuzzUnsampledTraceparent(f *testing.F) {
	for _, s := range []string{
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-02",
		"00-00000000000000000000000000000000-00f067aa0ba902b7-00",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-00",
		"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-00",
		"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
		"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
		"00-xyz", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		sc := trace.SpanContextFromContext(w3c.Extract(context.Background(), traceparentCarrier(s)))
		canonical := sc.IsValid() && !sc.IsSampled() && formatTraceparent(sc) == s
		if got := unsampledTraceparent(s); got != canonical {
			t.Fatalf("unsampledTraceparent(%q) = %v; extracted %v (valid %v, sampled %v)", s, got, sc, sc.IsValid(), sc.IsSampled())
		}
	})
}
