package router

import (
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// The ledger counts plain P/D requests in flight per decode worker until their outcome (the
// load a power-of-two P/D router balances on) and remembers the prompts routed to each prefill
// worker (what a cache-aware router matches).
func TestLedgerPlainInFlightAndPrefixView(t *testing.T) {
	l := newLedger()
	now := time.Now()
	add := func(seq uint64, plain bool, decode, prefill string, prompt []uint64) {
		l.add(&reservation{seq: seq, mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, decode: decode, prefill: prefill,
			prefills: prefill != "", plain: plain, prompt: prompt, deadline: now.Add(time.Minute)})
	}
	add(1, true, "d1", "p1", []uint64{1, 2, 3})
	add(2, true, "d1", "p1", []uint64{1, 2, 9})
	add(3, true, "d2", "p2", nil)
	if got := []int32{l.Reserved("d1").Plain, l.Reserved("d2").Plain, l.Reserved("d3").Plain}; got[0] != 2 || got[1] != 1 || got[2] != 0 {
		t.Fatalf("plain in flight d1 d2 d3 = %v, want [2 1 0]", got)
	}
	tests := []struct {
		worker string
		prompt []uint64
		want   int
	}{
		{"p1", []uint64{1, 2, 3, 4}, 3},
		{"p1", []uint64{1, 2, 9}, 3},
		{"p1", []uint64{5, 2, 3}, 0},
		{"p2", []uint64{1, 2, 3}, 0},
	}
	for _, tt := range tests {
		if got := l.PrefillPrefix(tt.worker, tt.prompt); got != tt.want {
			t.Errorf("PrefillPrefix(%s, %v) = %d, want %d", tt.worker, tt.prompt, got, tt.want)
		}
	}
	for seq := uint64(1); seq <= 3; seq++ {
		if _, ok := l.remove(seq); !ok {
			t.Fatalf("remove %d", seq)
		}
	}
	for id, w := range l.workers {
		if !w.idle() {
			t.Fatalf("after the outcomes: %s holds %+v", id, w.res)
		}
	}
	if l.Reserved("d1").Plain != 0 {
		t.Fatalf("after the outcomes: d1 plain %d", l.Reserved("d1").Plain)
	}
}
