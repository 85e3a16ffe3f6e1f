package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestResyncingHoldsPlacement: while a new leader waits for decode workers to report
// (Input.Resyncing, issue 16), a session it holds no residency for is neither seeded nor
// reseeded — a plain fallback with no session effects — and a resident session is served as
// usual.
func TestResyncingHoldsPlacement(t *testing.T) {
	for _, tc := range []struct {
		name     string
		rec      *kvcv1.SessionRecord
		resync   bool
		wantMode kvcv1.RouteMode
		reason   kvcv1.RouteReason
	}{
		{"unknown session: not seeded", nil, true, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE},
		{"known, not resident: not reseeded", &kvcv1.SessionRecord{SessionId: "s", Generation: 2, PreviousDecodeWorker: "d1"}, true,
			kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE},
		{"resident: direct as usual", resident("d1", 10_000), true, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT},
		{"unknown session after the resync: seeded", nil, false, kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := &Input{Knobs: knobs(nil), Query: q(11_000, 100, 1), Session: tc.rec, Workers: cluster(),
				Ledger: ledger(map[string]Reserved{}), NowMs: nowMs, Resyncing: tc.resync}
			d := Decide(in)
			if d.Mode != tc.wantMode || d.Reason != tc.reason {
				t.Fatalf("%s/%s, want %s/%s", d.Mode, d.Reason, tc.wantMode, tc.reason)
			}
			if tc.wantMode == kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK && (d.Exec.KeepSession || d.Exec.OpenSession || d.Seed) {
				t.Fatalf("a resync fallback with session effects: %+v", d.Exec)
			}
		})
	}
}
