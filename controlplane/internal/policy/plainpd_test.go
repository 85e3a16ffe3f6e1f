package policy

import (
	"fmt"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// prefixLedger is a fakeLedger with the router's view of the prefill workers' caches.
type prefixLedger struct {
	fakeLedger
	match map[string]int // leading pages of any prompt each prefill worker holds
}

func (l prefixLedger) PrefillPrefix(id string, prompt []uint64) int {
	return min(l.match[id], len(prompt))
}

// The baselines' decode choice is SGLang's router's power of two choices on the requests it has
// in flight per decode worker (before: the most reported headroom, ties broken by a draw, which
// for plain P/D — whose requests never show in the load report — was a uniform draw).
func TestPlainPDDecodeIsPowerOfTwoOnInFlight(t *testing.T) {
	ws := []*kvcv1.Worker{pW("p1", 0), dW("d0", 100_000, 0), dW("d1", 100_000, 0), dW("d2", 100_000, 0), dW("d3", 100_000, 0)}
	off := func(p *kvcv1.Policy) { p.KvCentricEnabled = b(false) }
	tests := []struct {
		name     string
		plain    map[string]int32
		min, max map[string]int // of 600 requests
	}{
		{"a busy decode worker is never chosen over an idle one", map[string]int32{"d0": 3},
			nil, map[string]int{"d0": 0}},
		// p2c over loads 1 < 2 < 3 < 4: the least of two drawn — d0 in 3 of 6 pairs, d1 in 2,
		// d2 in 1, d3 in none.
		{"shares follow the pairs each worker wins", map[string]int32{"d0": 1, "d1": 2, "d2": 3, "d3": 4},
			map[string]int{"d0": 250, "d1": 150, "d2": 60}, map[string]int{"d0": 350, "d1": 250, "d2": 140, "d3": 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := map[string]Reserved{}
			for id, n := range tt.plain {
				res[id] = Reserved{Plain: n}
			}
			got := map[string]int{}
			for i := range 600 {
				qq := q(30_000, 100, int32(i%5+1))
				qq.SessionID = fmt.Sprintf("s-%d", i)
				d := Decide(&Input{Knobs: knobs(off), Query: qq, Workers: ws, Ledger: ledger(res), NowMs: nowMs})
				if d.Mode != mFallback || d.Reason != kvcv1.RouteReason_ROUTE_REASON_KV_CENTRIC_DISABLED || d.Decode == nil {
					t.Fatalf("%s/%s decode %v", d.Mode, d.Reason, d.Decode)
				}
				got[workerIDOf(d.Decode)]++
			}
			for w, n := range tt.min {
				if got[w] < n {
					t.Errorf("%s got %d of 600, want at least %d (%v)", w, got[w], n, got)
				}
			}
			for w, n := range tt.max {
				if got[w] > n {
					t.Errorf("%s got %d of 600, want at most %d (%v)", w, got[w], n, got)
				}
			}
		})
	}
}

// The baselines' prefill choice is cache-aware (SGLang's router's cache_aware): the prefill
// worker that was routed the longest prefix of the prompt, when that is ≥ 30% of it and the
// loads are balanced; else the least loaded (before: always the least loaded).
func TestPlainPDPrefillIsCacheAware(t *testing.T) {
	prompt := make([]uint64, 100)
	for i := range prompt {
		prompt[i] = uint64(i + 1)
	}
	tests := []struct {
		name    string
		p1Load  int32
		match   map[string]int
		content bool
		want    string
	}{
		{"the worker holding half the prompt, though busier", 2, map[string]int{"p1": 50}, true, "p1"},
		{"a match under the threshold: least loaded", 2, map[string]int{"p1": 20}, true, "p2"},
		{"imbalanced loads: least loaded", 100, map[string]int{"p1": 90}, true, "p2"},
		{"no page hashes: least loaded", 2, map[string]int{"p1": 90}, false, "p2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ws := []*kvcv1.Worker{pW("p1", tt.p1Load), pW("p2", 0), dW("d0", 100_000, 0), dW("d1", 100_000, 0)}
			in := &Input{Knobs: knobs(func(p *kvcv1.Policy) { p.KvCentricEnabled = b(false) }), Query: q(6400, 100, 1), Workers: ws,
				Ledger: prefixLedger{ledger(map[string]Reserved{}), tt.match}, NowMs: nowMs}
			if tt.content {
				in.Content = &Content{PageSize: 64, Prompt: prompt}
			}
			d := Decide(in)
			if workerIDOf(d.Prefill) != tt.want {
				t.Errorf("prefill %s, want %s", workerIDOf(d.Prefill), tt.want)
			}
		})
	}
}
