package policy

import (
	"fmt"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Plain P/D requests reserve nothing on their D, so between two load reports the control plane
// does not see the ones it already sent: they must not all go to the same D (before the spread
// scorer, 80–90% of a baseline arm's requests ran on decode-0 of four). Ds of about the same
// headroom share the sessions; a D with half its capacity more free still takes them all.
func TestFallbackSpreadsOverDecodeWorkers(t *testing.T) {
	d4 := func(used ...int64) []*kvcv1.Worker {
		ws := []*kvcv1.Worker{pW("p1", 0)}
		for i, u := range used {
			ws = append(ws, dW(fmt.Sprintf("d%d", i), 100_000, u))
		}
		return ws
	}
	tests := []struct {
		name     string
		k        func(p *kvcv1.Policy)
		workers  []*kvcv1.Worker
		rec      func(i int) *kvcv1.SessionRecord
		min, max map[string]int // share bounds of 400 sessions per D (absent: 0..400)
	}{
		{"equal decode workers share plain P/D", func(p *kvcv1.Policy) { p.KvCentricEnabled = b(false) }, d4(0, 0, 0, 0), nil,
			map[string]int{"d0": 70, "d1": 70, "d2": 70, "d3": 70}, map[string]int{"d0": 130, "d1": 130, "d2": 130, "d3": 130}},
		{"about the same headroom shares too", func(p *kvcv1.Policy) { p.KvCentricEnabled = b(false) }, d4(0, 5_000, 10_000, 0), nil,
			map[string]int{"d0": 50, "d1": 50, "d2": 50, "d3": 50}, nil},
		// A P/D router does not see decode workers' KV (plainpd.go): the power-of-two draw on
		// equal in-flight counts spreads whatever the reported headroom.
		{"plain P/D ignores reported headroom", func(p *kvcv1.Policy) { p.KvCentricEnabled = b(false) }, d4(60_000, 60_000, 0, 60_000), nil,
			map[string]int{"d0": 70, "d1": 70, "d2": 70, "d3": 70}, map[string]int{"d2": 130}},
		// KV-centric fallbacks (a seed gate's: a resident session is never one any more) keep the
		// fallback profile.
		{"a KV-centric fallback goes to a D with half its capacity more free", seedMaxOut50, d4(90_000, 60_000, 0, 60_000), nil,
			map[string]int{"d2": 400}, nil},
		{"KV-centric fallbacks (SEED_FILTER_OUTPUT_TOKENS) spread too", seedMaxOut50, d4(90_000, 0, 0, 0), nil,
			map[string]int{"d1": 70, "d2": 70, "d3": 70}, map[string]int{"d0": 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := map[string]int{}
			for i := range 400 {
				qq := q(30_000, 100, int32(i%7+1))
				qq.SessionID = fmt.Sprintf("s-%d", i)
				var rec *kvcv1.SessionRecord
				if tt.rec != nil {
					rec = tt.rec(i)
					rec.SessionId = qq.SessionID
				}
				in := &Input{Knobs: knobs(tt.k), Query: qq, Session: rec, Workers: tt.workers, Ledger: ledger(map[string]Reserved{}), NowMs: nowMs}
				d := Decide(in)
				if d.Mode != mFallback || d.Decode == nil {
					t.Fatalf("session %d: %s/%s decode %v", i, d.Mode, d.Reason, d.Decode)
				}
				if again := Decide(in); workerIDOf(again.Decode) != workerIDOf(d.Decode) {
					t.Fatalf("session %d: not deterministic: %s then %s", i, workerIDOf(d.Decode), workerIDOf(again.Decode))
				}
				got[workerIDOf(d.Decode)]++
			}
			for w, n := range tt.min {
				if got[w] < n {
					t.Errorf("%s got %d of 400, want at least %d (%v)", w, got[w], n, got)
				}
			}
			for w, n := range tt.max {
				if got[w] > n {
					t.Errorf("%s got %d of 400, want at most %d (%v)", w, got[w], n, got)
				}
			}
		})
	}
}

func seedMaxOut50(p *kvcv1.Policy) { p.SeedMaxOutputTokens = i64(50) }

func TestSpreadDraw(t *testing.T) {
	tests := []struct {
		name      string
		a, b      [4]any // session, turn, input, worker
		wantEqual bool
	}{
		{"same inputs, same draw", [4]any{"s", int32(1), int64(100), "d0"}, [4]any{"s", int32(1), int64(100), "d0"}, true},
		{"another worker", [4]any{"s", int32(1), int64(100), "d0"}, [4]any{"s", int32(1), int64(100), "d1"}, false},
		{"another turn", [4]any{"s", int32(1), int64(100), "d0"}, [4]any{"s", int32(2), int64(100), "d0"}, false},
		{"another session", [4]any{"s", int32(1), int64(100), "d0"}, [4]any{"t", int32(1), int64(100), "d0"}, false},
	}
	draw := func(x [4]any) float64 { return spreadDraw(x[0].(string), x[1].(int32), x[2].(int64), x[3].(string)) }
	for _, tt := range tests {
		a, b := draw(tt.a), draw(tt.b)
		if a < 0 || a >= 1 || b < 0 || b >= 1 || (a == b) != tt.wantEqual {
			t.Errorf("%s: %v vs %v", tt.name, a, b)
		}
	}
	// Roughly uniform: 10 bins of 10,000 draws.
	var bins [10]int
	for i := range 10_000 {
		bins[int(spreadDraw(fmt.Sprint("s-", i), 3, 20_000, "decode-1")*10)]++
	}
	for i, n := range bins {
		if n < 850 || n > 1150 {
			t.Errorf("bin %d: %d of 10000 (%v)", i, n, bins)
		}
	}
}
