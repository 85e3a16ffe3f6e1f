package router

import (
	"math/rand/v2"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// refPrune is prune without the minFront shortcut: what prune must always equal.
func refPrune(settling map[string][]settle, tok map[string]int64, workers []*kvcv1.Worker) {
	for _, w := range workers {
		list, ok := settling[w.WorkerId]
		if !ok {
			continue
		}
		n := 0
		for n < len(list) && list[n].atMs+settleMarginMs < w.GetLastHeartbeatUnixMs() {
			tok[w.WorkerId] -= list[n].tokens
			n++
		}
		if n == len(list) {
			delete(settling, w.WorkerId)
			delete(tok, w.WorkerId)
			continue
		}
		settling[w.WorkerId] = list[n:]
	}
}

// TestPruneMatchesReference drives the ledger's settle/prune with out-of-order settle times
// and heartbeats (clocks that go back included), on new snapshots and on the last one again,
// and checks every step against refPrune.
func TestPruneMatchesReference(t *testing.T) {
	for _, tc := range []struct {
		name           string
		seed           uint64
		jitter, hbStep int64
	}{
		{"ordered", 1, 0, 30},
		{"settles_older_than_heartbeat", 2, 400, 30},
		{"heartbeats_jump", 3, 50, 500},
		{"clock_back", 4, 1000, -20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(tc.seed, 7))
			l := newLedger()
			refS, refT := map[string][]settle{}, map[string]int64{}
			ids := []string{"d0", "d1", "d2", "d3"}
			hb := map[string]int64{}
			now := int64(10_000)
			var ws []*kvcv1.Worker
			for step := range 2000 {
				now += 5
				switch r.IntN(3) {
				case 0, 1:
					id := ids[r.IntN(len(ids))]
					at := now - r.Int64N(tc.jitter+1)
					tokens := 1 + r.Int64N(100)
					l.settle(id, tokens, at)
					refS[id] = append(refS[id], settle{tokens: tokens, atMs: at})
					refT[id] += tokens
				case 2:
					id := ids[r.IntN(len(ids))]
					hb[id] = now + tc.hbStep*r.Int64N(3) - r.Int64N(tc.jitter+1)
				}
				if ws == nil || r.IntN(2) == 0 {
					// A new snapshot; else the same one again (as decisions between two load
					// reports see it), with settles added since.
					ws = nil
					for _, id := range ids[:1+r.IntN(len(ids))] {
						ws = append(ws, &kvcv1.Worker{WorkerId: id, LastHeartbeatUnixMs: hb[id]})
					}
				}
				l.prune(ws)
				refPrune(refS, refT, ws)
				if len(l.settling) != len(refS) {
					t.Fatalf("step %d: %d settling lists, want %d", step, len(l.settling), len(refS))
				}
				for id, want := range refS {
					got := l.settling[id]
					if len(got) != len(want) || l.settleTok[id] != refT[id] {
						t.Fatalf("step %d, %s: %d entries / %d tokens, want %d / %d",
							step, id, len(got), l.settleTok[id], len(want), refT[id])
					}
				}
			}
		})
	}
}
