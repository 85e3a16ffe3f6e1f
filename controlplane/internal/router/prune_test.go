package router

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
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
				lists := 0
				for _, w := range l.workers {
					if len(w.settling) > 0 {
						lists++
					}
				}
				if lists != len(refS) || l.nSettling != len(refS) {
					t.Fatalf("step %d: %d settling lists (counted %d), want %d", step, lists, l.nSettling, len(refS))
				}
				for id, want := range refS {
					var got []settle
					var tok int64
					if w := l.workers[id]; w != nil {
						got, tok = w.settling, w.res.Settling
					}
					if len(got) != len(want) || tok != refT[id] || l.Reserved(id).Settling != refT[id] {
						t.Fatalf("step %d, %s: %d entries / %d tokens, want %d / %d",
							step, id, len(got), tok, len(want), refT[id])
					}
				}
			}
		})
	}
}

// TestLedgerAccountsKeptAndSwept: a worker's account survives its reservations falling to
// zero (no delete and re-insert per decision), and accounts that hold nothing are swept once
// the table outgrows twice the worker snapshot, so workers that left do not pile up.
func TestLedgerAccountsKeptAndSwept(t *testing.T) {
	l := newLedger()
	now := time.Now()
	ws := []*kvcv1.Worker{{WorkerId: "d0"}, {WorkerId: "p0"}}
	r := &reservation{seq: 1, decode: "d0", prefill: "p0", prefills: true, tokens: 10, deadline: now.Add(time.Minute)}
	l.add(r)
	a := l.workers["d0"]
	if _, ok := l.remove(1); !ok || a == nil {
		t.Fatal("reservation 1 not pending")
	}
	l.prune(ws)
	if l.workers["d0"] != a || !a.idle() || l.Reserved("d0") != (policy.Reserved{}) {
		t.Fatalf("d0's account after its last release: %p %+v, want %p kept and idle", l.workers["d0"], l.workers["d0"], a)
	}
	// Workers that came and went (an account each), one still settling, one still holding.
	for i := range 40 {
		id := fmt.Sprintf("gone-%d", i)
		l.add(&reservation{seq: uint64(10 + i), decode: id, tokens: 5, deadline: now.Add(time.Minute)})
		l.remove(uint64(10 + i))
	}
	l.settle("gone-0", 7, 1)
	l.add(&reservation{seq: 100, decode: "gone-1", tokens: 3, deadline: now.Add(time.Minute)})
	l.prune(ws)
	if len(l.workers) != 2 || l.Reserved("gone-0").Settling != 7 || l.Reserved("gone-1").Tokens != 3 {
		t.Fatalf("after the sweep: %d accounts (want gone-0 settling, gone-1 holding), gone-0 %+v, gone-1 %+v",
			len(l.workers), l.Reserved("gone-0"), l.Reserved("gone-1"))
	}
}

// TestLedgerAccountCache: the ledger's cache of accounts by id string answers as its map does,
// for the same string, an equal string in other memory and ids whose slots collide, and a
// sweep that drops a cached account leaves no stale answer (the next reservation on that id
// gets a new account, which Reserved then reads).
func TestLedgerAccountCache(t *testing.T) {
	l := newLedger()
	now := time.Now()
	seq := uint64(0)
	hold := func(id string, tokens int64) {
		seq++
		l.add(&reservation{seq: seq, decode: id, tokens: tokens, deadline: now.Add(time.Minute)})
	}
	ids := make([]string, 3*acctSlots) // more ids than slots: some share one
	for i := range ids {
		ids[i] = fmt.Sprintf("d%d", i)
		hold(ids[i], int64(i+1))
	}
	for round := range 2 { // the second round hits the slots the first filled
		for i, id := range ids {
			for _, ask := range []string{id, strings.Clone(id)} {
				if got := l.Reserved(ask).Tokens; got != int64(i+1) {
					t.Fatalf("round %d: Reserved(%q) tokens %d, want %d", round, ask, got, i+1)
				}
			}
		}
	}
	if got := l.Reserved("nobody"); got != (policy.Reserved{}) {
		t.Fatalf("Reserved of a worker without an account: %+v", got)
	}
	// Release everything; the sweep drops the idle accounts the cache names.
	for s := uint64(1); s <= seq; s++ {
		l.remove(s)
	}
	l.Reserved(ids[0]) // cached
	l.sweep()
	if len(l.workers) != 0 {
		t.Fatalf("%d accounts after the sweep, want 0", len(l.workers))
	}
	hold(ids[0], 42) // a new account for the same id string
	if a := l.workers[ids[0]]; a == nil || l.Reserved(ids[0]).Tokens != 42 || a.res.Tokens != 42 {
		t.Fatalf("after the sweep: Reserved(%q) %+v, account %+v, want 42 tokens in a new account", ids[0], l.Reserved(ids[0]), a)
	}
}

// TestLedgerFindWorker: the ledger's cached FindWorker answers as policy.FindWorker on the
// snapshot it is given: the same id string twice, an equal string elsewhere in memory, another
// role, an id not in the snapshot, and a new snapshot (a load report's) whose worker of the same
// id is a new record.
func TestLedgerFindWorker(t *testing.T) {
	l := newLedger()
	mk := func(load int64) []*kvcv1.Worker {
		var ws []*kvcv1.Worker
		for i := range 8 {
			ws = append(ws, &kvcv1.Worker{WorkerId: fmt.Sprintf("p%d", i), Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL})
		}
		for i := range 40 {
			ws = append(ws, &kvcv1.Worker{WorkerId: fmt.Sprintf("d%02d", i), Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE,
				Load: &kvcv1.WorkerLoad{UsedTokens: load}})
		}
		return ws
	}
	ids := []string{"d00", "d17", "d39", "p3", "d40", "x"}
	decode, prefill := kvcv1.WorkerRole_WORKER_ROLE_DECODE, kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	clones := make([]string, len(ids))
	for i, id := range ids {
		clones[i] = strings.Clone(id)
	}
	for _, ws := range [][]*kvcv1.Worker{mk(1), mk(2)} {
		// A role asked twice in a row hits what the first asking cached; the next role must not.
		for _, role := range []kvcv1.WorkerRole{decode, decode, prefill, prefill, decode} {
			for i, id := range ids {
				for _, ask := range []string{id, clones[i]} {
					if got, want := l.FindWorker(ws, ask, role), policy.FindWorker(ws, ask, role); got != want {
						t.Fatalf("FindWorker(%q, %s) = %p, want %p (the snapshot's)", ask, role, got, want)
					}
				}
			}
		}
	}
}
