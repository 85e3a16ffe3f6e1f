package router

import (
	"math/rand/v2"
	"testing"
)

// TestPendingTableMatchesMap runs random adds, lookups and removals on a pendingTable and on a
// map (what the ledger held before): outcomes in order, out of order, and reservations kept
// pending while the sequence numbers run past the table's size (their slots then taken by
// newer ones, which go to the overflow map), through the table's growth.
func TestPendingTableMatchesMap(t *testing.T) {
	for _, tc := range []struct {
		name   string
		window int     // outcomes come back among the last window decisions
		keep   float64 // share of reservations left pending for a long time
		n      int
	}{
		{"in order", 1, 0, 5000},
		{"window of 4", 4, 0, 5000},
		{"window past the first size", 3 * minPendingSlots, 0, 20000},
		{"some kept across the slots", 16, 0.02, 20000},
		{"many kept (growth)", 64, 0.5, 20000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(7, uint64(tc.window)))
			var tab pendingTable
			ref := map[uint64]*reservation{}
			var inflight []uint64
			check := func(seq uint64) {
				t.Helper()
				if got, want := tab.get(seq), ref[seq]; got != want {
					t.Fatalf("get(%d) = %p, want %p", seq, got, want)
				}
			}
			for seq := uint64(1); seq <= uint64(tc.n); seq++ {
				r := &reservation{seq: seq}
				tab.put(r)
				ref[seq] = r
				if rng.Float64() >= tc.keep {
					inflight = append(inflight, seq)
				}
				check(seq)
				check(seq + 1)           // never issued
				check(seq - min(seq, 1)) // just before
				for len(inflight) > tc.window {
					i := rng.IntN(len(inflight))
					done := inflight[i]
					inflight = append(inflight[:i], inflight[i+1:]...)
					if got, want := tab.take(done), ref[done]; got != want || got == nil {
						t.Fatalf("take(%d) = %p, want %p", done, got, want)
					}
					delete(ref, done)
					if tab.take(done) != nil {
						t.Fatalf("take(%d) twice returned a reservation", done)
					}
					check(done)
				}
				if tab.len() != len(ref) {
					t.Fatalf("len %d, want %d", tab.len(), len(ref))
				}
			}
			seen := 0
			for r := range tab.all() {
				if ref[r.seq] != r {
					t.Fatalf("all yields %d, not held", r.seq)
				}
				seen++
			}
			if seen != len(ref) {
				t.Fatalf("all yields %d reservations, %d held", seen, len(ref))
			}
			for seq := range ref {
				check(seq)
			}
			// A reservation put again under its sequence number replaces the first.
			for seq := range ref {
				r := &reservation{seq: seq}
				tab.put(r)
				if tab.get(seq) != r || tab.len() != len(ref) {
					t.Fatalf("put of held %d did not replace it (len %d, want %d)", seq, tab.len(), len(ref))
				}
				break
			}
		})
	}
}
