package sidecar

import "testing"

func TestPushPhasesCriticalMs(t *testing.T) {
	tests := []struct {
		name string
		ph   PushPhases
		want float64
	}{
		{"serial", PushPhases{ReserveMs: 0.5, PlanMs: 0.1, TransferMs: 10, CommitMs: 0.2}, 10.8},
		{"overlapped, reserve and plan longer", PushPhases{ReserveMs: 0.5, CreditMs: 0.3, ReserveOverlapped: true, PlanMs: 0.1, TransferMs: 10, CommitMs: 0.2}, 10.8},
		{"overlapped, credit copy longer", PushPhases{ReserveMs: 0.5, CreditMs: 1.5, ReserveOverlapped: true, PlanMs: 0.1, TransferMs: 9, CommitMs: 0.2}, 10.7},
	}
	for _, tt := range tests {
		if got := tt.ph.CriticalMs(); got < tt.want-1e-9 || got > tt.want+1e-9 {
			t.Fatalf("%s: %v, want %v", tt.name, got, tt.want)
		}
	}
}
