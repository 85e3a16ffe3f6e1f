package sidecar

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestCommandAction: every command the control plane sends a sidecar names its span by its
// action, with its session and decision.
func TestCommandAction(t *testing.T) {
	tests := []struct {
		cmd                       *kvcv1.Command
		action, session, decision string
	}{
		{&kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{SessionId: "s"}}}, "set_snapshot_target", "s", ""},
		{&kvcv1.Command{Action: &kvcv1.Command_SetSessionHints{SetSessionHints: &kvcv1.SetSessionHintsCommand{SessionId: "s"}}}, "set_session_hints", "s", ""},
		{&kvcv1.Command{Action: &kvcv1.Command_LoadSession{LoadSession: &kvcv1.LoadSessionCommand{SessionId: "s", DecisionId: "d"}}}, "load_session", "s", "d"},
		{&kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{SessionId: "s"}}}, "release_session", "s", ""},
		{&kvcv1.Command{Action: &kvcv1.Command_PushSnapshot{PushSnapshot: &kvcv1.PushSnapshotCommand{SessionId: "s", DecisionId: "d"}}}, "push_snapshot", "s", "d"},
		{&kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}, "drain", "", ""},
		{&kvcv1.Command{Action: &kvcv1.Command_UpdatePolicy{UpdatePolicy: &kvcv1.UpdatePolicyCommand{}}}, "update_policy", "", ""},
		{&kvcv1.Command{}, "unknown", "", ""},
	}
	for _, tt := range tests {
		a, s, d := commandAction(tt.cmd)
		if a != tt.action || s != tt.session || d != tt.decision {
			t.Errorf("%v: %q %q %q, want %q %q %q", tt.cmd, a, s, d, tt.action, tt.session, tt.decision)
		}
	}
}
