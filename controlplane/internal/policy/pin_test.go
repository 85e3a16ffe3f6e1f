package policy

import (
	"strings"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestDecideAgentHints: a pinned session is not migrated while its pin holds (and is once it
// has passed); a low-priority session's prefills are hinted low.
func TestDecideAgentHints(t *testing.T) {
	rejected := func(pinnedUntil int64) *kvcv1.SessionRecord {
		return with2(resident("d1", 19_000), func(r *kvcv1.SessionRecord) {
			r.DRejects = map[string]int32{"d1": 3}
			r.PinnedUntilUnixMs = pinnedUntil
		})
	}
	lowQ := func(qq Query) Query { qq.LowPriority = true; return qq }
	cases := []tc{
		{name: "pinned: no migration after rejects", q: q(20_000, 100, 5), rec: rejected(nowMs + 1),
			workers: cluster(), mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, decode: "d1"},
		{name: "pin expired: migrates", q: q(20_000, 100, 5), rec: rejected(nowMs),
			workers: cluster(), mode: mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS, decode: "d2"},
		{name: "pinned and its D full: waits on its D, not moved", q: q(20_000, 100, 5), rec: rejected(nowMs + 60_000),
			workers: []*kvcv1.Worker{pW("p1", 0), dW("d1", 100_000, 99_000), dW("d2", 100_000, 0)},
			mode:    mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_D_QUEUED, decode: "d1",
			check: func(t *testing.T, d Decision) {
				if d.LocalReject != "" || d.Exec.OpenSession || !d.Exec.KeepSession || d.UsesPrefill {
					t.Errorf("pinned, no room: %+v", d)
				}
			}},
		{name: "low priority seed: prefill hinted low", q: lowQ(q(20_000, 10, 1)), workers: cluster(),
			mode: mSeed, reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION,
			check: func(t *testing.T, d Decision) {
				if d.PrefillPriority != PrefillPriorityLow {
					t.Errorf("prefill priority %d", d.PrefillPriority)
				}
			}},
		{name: "low priority fallback: prefill hinted low", k: func(p *kvcv1.Policy) { p.SeedMinTurn = i32(9) }, q: lowQ(q(20_000, 100, 5)),
			workers: cluster(), mode: mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_EARLY_TURN,
			check: func(t *testing.T, d Decision) {
				if !d.UsesPrefill || d.PrefillPriority != PrefillPriorityLow {
					t.Errorf("low priority fallback: %+v", d)
				}
			}},
		{name: "low priority direct turn: no prefill, no hint", q: lowQ(q(12_000, 100, 4)), rec: resident("d2", 10_000), workers: cluster(),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, decode: "d2",
			check: func(t *testing.T, d Decision) {
				if d.PrefillPriority != PrefillPriorityNormal || d.UsesPrefill {
					t.Errorf("%+v", d)
				}
			}},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			in := &Input{Knobs: knobs(tt.k), Query: tt.q, Session: tt.rec, Workers: tt.workers, Ledger: ledger(map[string]Reserved{}), NowMs: nowMs}
			d := Decide(in)
			if d.Mode != tt.mode || d.Reason != tt.reason {
				t.Fatalf("got %s/%s, want %s/%s", d.Mode, d.Reason, tt.mode, tt.reason)
			}
			if tt.decode != "" && workerIDOf(d.Decode) != tt.decode {
				t.Errorf("decode %q, want %q", workerIDOf(d.Decode), tt.decode)
			}
			if tt.check != nil {
				tt.check(t, d)
			}
		})
	}
}

func TestGrantPin(t *testing.T) {
	k := Compile(nil) // max_pin_ms 600000, max_pinned_share 0.5
	off := Compile(&kvcv1.Policy{MaxPinMs: i64(0)})
	tests := []struct {
		name                                string
		k                                   *Knobs
		pinMs, tokens, pinnedOthers, capTok int64
		wantUntil                           int64
		wantResult                          string
	}{
		{"no pin", k, 0, 1000, 0, 100_000, 0, ""},
		{"granted", k, 30_000, 1000, 0, 100_000, nowMs + 30_000, PinGranted},
		{"clamped to max_pin_ms", k, 3_600_000, 1000, 0, 100_000, nowMs + DefaultMaxPinMs, PinClamped},
		{"share exactly full", k, 1000, 20_000, 30_000, 100_000, nowMs + 1000, PinGranted},
		{"share passed", k, 1000, 20_001, 30_000, 100_000, 0, PinRefusedShare},
		{"pins off", off, 1000, 1, 0, 100_000, 0, PinRefusedDisabled},
		{"no capacity", k, 1000, 1, 0, 0, 0, PinRefusedCapacity},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := GrantPin(tt.k, tt.pinMs, nowMs, tt.tokens, tt.pinnedOthers, tt.capTok)
			if g.UntilMs != tt.wantUntil || g.Result != tt.wantResult {
				t.Fatalf("got %+v, want until %d result %q", g, tt.wantUntil, tt.wantResult)
			}
			if (g.Result == PinClamped || strings.HasPrefix(g.Result, "refused")) && g.Detail == "" {
				t.Fatal("a clamp or refusal without a reason")
			}
		})
	}
	if !Pinned(&kvcv1.SessionRecord{PinnedUntilUnixMs: nowMs + 1}, nowMs) || Pinned(&kvcv1.SessionRecord{PinnedUntilUnixMs: nowMs}, nowMs) || Pinned(nil, nowMs) {
		t.Fatal("Pinned")
	}
}

func TestValidatePinKnobs(t *testing.T) {
	for _, p := range []*kvcv1.Policy{
		{MaxPinMs: i64(-1)}, {MaxPinMs: i64(MaxPinMsLimit + 1)}, {MaxPinnedShare: f64(1.5)}, {MaxPinnedShare: f64(-0.1)},
	} {
		if err := Validate(p); err == nil || !strings.Contains(err.Error(), "pin") {
			t.Errorf("%v: %v", p, err)
		}
	}
	if err := Validate(&kvcv1.Policy{MaxPinMs: i64(0), MaxPinnedShare: f64(1)}); err != nil {
		t.Fatal(err)
	}
}
