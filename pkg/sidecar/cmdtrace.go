package sidecar

import (
	"context"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Traces of control-plane commands (issue 15 item 8). The Connect stream is long-lived, so a
// command's trace travels in the command itself: Command.traceparent is the context of the
// control plane's decision span that sent it (empty for commands of no decision: drains,
// policy updates, resync targets). The sidecar records one span per command,
// "kvc-sidecar <action>", child of that context (a root of its own without one), with
// kvc.command_id, kvc.epoch, kvc.session_id, kvc.decision_id (push_snapshot) and
// kvc.result (applied, error, stale, duplicate); the handler's context carries the span.

const tracerName = "github.com/kvcentric/kvcentric/pkg/sidecar"

// maxTraceparent bounds a command's traceparent; a longer one is ignored.
const maxTraceparent = 256

var w3c = propagation.TraceContext{}

// commandAction names a command's action ("" for none).
func commandAction(cmd *kvcv1.Command) (action, session, decision string) {
	switch a := cmd.GetAction().(type) {
	case *kvcv1.Command_SetSnapshotTarget:
		return "set_snapshot_target", a.SetSnapshotTarget.GetSessionId(), ""
	case *kvcv1.Command_SetSessionHints:
		return "set_session_hints", a.SetSessionHints.GetSessionId(), ""
	case *kvcv1.Command_LoadSession:
		return "load_session", a.LoadSession.GetSessionId(), a.LoadSession.GetDecisionId()
	case *kvcv1.Command_ReleaseSession:
		return "release_session", a.ReleaseSession.GetSessionId(), ""
	case *kvcv1.Command_PushSnapshot:
		return "push_snapshot", a.PushSnapshot.GetSessionId(), a.PushSnapshot.GetDecisionId()
	case *kvcv1.Command_Drain:
		return "drain", "", ""
	case *kvcv1.Command_UpdatePolicy:
		return "update_policy", "", ""
	}
	return "unknown", "", ""
}

// startCommand starts cmd's span; ctx carries it to the handler.
func startCommand(ctx context.Context, cmd *kvcv1.Command) (context.Context, trace.Span) {
	if tp := cmd.GetTraceparent(); tp != "" && len(tp) <= maxTraceparent {
		ctx = w3c.Extract(ctx, propagation.MapCarrier{"traceparent": tp})
	}
	action, session, decision := commandAction(cmd)
	ctx, span := otel.Tracer(tracerName).Start(ctx, "kvc-sidecar "+action, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(attribute.Int64("kvc.command_id", int64(cmd.GetCommandId())), attribute.Int64("kvc.epoch", cmd.GetEpoch()))
		if session != "" {
			span.SetAttributes(attribute.String("kvc.session_id", session))
		}
		if decision != "" {
			span.SetAttributes(attribute.String("kvc.decision_id", decision))
		}
	}
	return ctx, span
}

// endCommand records the command's result (its ack) and ends its span.
func endCommand(span trace.Span, result string, ack *kvcv1.CommandAck) {
	if span.IsRecording() {
		span.SetAttributes(attribute.String("kvc.result", result))
		if !ack.GetOk() {
			span.SetStatus(codes.Error, ack.GetError())
		}
	}
	span.End()
}
