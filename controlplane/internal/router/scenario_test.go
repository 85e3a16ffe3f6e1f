package router

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/proto"
)

// The seed story "a session pinned to a full D starves": without migration every turn is
// rejected (or falls back); with migration after 3 rejections it moves once and recovers.
func TestScenarioPinnedToFullD(t *testing.T) {
	cases := []struct {
		name       string
		threshold  int32
		dFull      bool // the control plane sees d1 full (load report) rather than d1 rejecting itself
		wantDirect int  // successful direct-to-D turns out of 30
		wantMoves  int32
		wantReject int // rejections seen (outcomes or local)
	}{
		{"D rejects, no migration: starves", 1000, false, 0, 0, 30},
		{"D rejects, migrate after 3: recovers", 3, false, 26, 1, 3},
		{"D full by load, no migration: always fallback", 1000, true, 0, 0, 30},
		{"D full by load, migrate after 3: recovers", 3, true, 26, 1, 3},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 200_000, 0),
				routertest.Decode("d2", 200_000, 0), routertest.Decode("d3", 200_000, 0))
			if err := f.c.SetPolicy(&kvcv1.Policy{MigrationRejectThreshold: proto.Int32(tt.threshold), SnapshotsEnabled: proto.Bool(false)}); err != nil {
				t.Fatal(err)
			}
			if tt.dFull {
				f.c.UpdateWorker("d1", func(w *kvcv1.Worker) { w.Load.UsedTokens = 195_000 })
			}
			f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d1", KvCommittedLen: 10_000, Generation: 1, LastSeenUnixMs: 1})
			direct, rejects := 0, 0
			input := int64(10_000)
			for turn := int32(1); turn <= 30; turn++ {
				input += 200
				d := f.decide("s", turn, input, 100)
				switch {
				case d.Mode == kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK:
					if d.Reason != kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY {
						t.Fatalf("turn %d: fallback %s", turn, d.Reason)
					}
					rejects++ // a local rejection
					f.report(d.DecisionId, true, okKind, 0)
				case d.Decode.WorkerId == "d1":
					rejects++
					f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)
				default:
					if d.Mode == kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
						direct++
					} else if d.Reason != kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS {
						t.Fatalf("turn %d: %s/%s", turn, d.Mode, d.Reason)
					}
					f.report(d.DecisionId, true, okKind, input+100)
				}
			}
			rec := f.session("s")
			if direct != tt.wantDirect || rec.Migrations != tt.wantMoves || rejects != tt.wantReject {
				t.Fatalf("direct %d moves %d rejects %d; want %d %d %d (record %v)", direct, rec.Migrations, rejects,
					tt.wantDirect, tt.wantMoves, tt.wantReject, rec)
			}
			if tt.wantMoves > 0 && (rec.DecodeWorker == "d1" || rec.PreviousDecodeWorker != "d1" || len(rec.DRejects) != 0) {
				t.Fatalf("after recovery: %v", rec)
			}
			f.checkLedger()
		})
	}
}

// The v1 thrash (move on every rejection; one session moved 116 times) must not happen: with
// flaky decode workers a move needs threshold consecutive rejections, success resets the count,
// and a move never goes straight back to the D just left while another is available.
func TestScenarioNoThrash(t *testing.T) {
	for _, threshold := range []int32{1, 3, 5} {
		t.Run(fmt.Sprintf("threshold=%d", threshold), func(t *testing.T) {
			f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 10_000_000, 0),
				routertest.Decode("d2", 10_000_000, 0), routertest.Decode("d3", 10_000_000, 0))
			if err := f.c.SetPolicy(&kvcv1.Policy{MigrationRejectThreshold: proto.Int32(threshold)}); err != nil {
				t.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(7, uint64(threshold)))
			const turns = 500
			rejections := 0
			var path []string
			input := int64(1000)
			for turn := int32(0); turn < turns; turn++ {
				input += 200
				d := f.decide("s", turn, input, 50)
				if d.Mode == kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK {
					f.report(d.DecisionId, true, okKind, 0)
					continue
				}
				if rng.Float64() < 0.4 { // every D rejects 40% of requests
					rejections++
					f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)
					continue
				}
				f.report(d.DecisionId, true, okKind, input+50)
				if rec := f.session("s"); len(path) == 0 || path[len(path)-1] != rec.DecodeWorker {
					path = append(path, rec.DecodeWorker)
				}
			}
			moves := int(f.session("s").Migrations)
			if moves != len(path)-1 {
				t.Fatalf("migrations %d but path %v", moves, path)
			}
			// Each move needs threshold consecutive rejections since the last success.
			if moves*int(threshold) > rejections {
				t.Fatalf("%d moves for %d rejections at threshold %d", moves, rejections, threshold)
			}
			// The v1 failure mode moved on every rejection.
			if threshold > 1 && moves*2 > rejections {
				t.Fatalf("thrash: %d moves for %d rejections", moves, rejections)
			}
			for i := 2; i < len(path); i++ {
				if path[i] == path[i-2] {
					t.Fatalf("bounced back %s -> %s -> %s", path[i-2], path[i-1], path[i])
				}
			}
			t.Logf("threshold %d: %d rejections, %d moves", threshold, rejections, moves)
			f.checkLedger()
		})
	}
}

// The seed story "turn-1 seed storm": 200 new sessions at once on 4 Ds with a bound of 2
// concurrent seeds per D (seed_max_inflight_decode) give 8 seeds; the rest are fallbacks (which
// keep their sessions where their KV lands) until outcomes free slots. The transfer budget
// (max_concurrent_transfers) does not bound seeds: a seed's transfer starts only once P has
// prefilled, and the budget is the store reseeds' (issue 20 item 1).
func TestScenarioSeedStormHeldToBudget(t *testing.T) {
	f := newFixture(t, manyDecode(4, 10_000_000)...)
	if err := f.c.SetPolicy(&kvcv1.Policy{MaxConcurrentTransfers: proto.Int32(2)}); err != nil {
		t.Fatal(err)
	}
	for i := range 12 {
		if d := f.decide(fmt.Sprintf("early-%d", i), 1, 80_000, 500); d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
			t.Fatalf("seed %d under a transfer budget of 2 per D: %s/%s", i, d.Mode, d.Reason)
		}
	}
	f = newFixture(t, manyDecode(4, 10_000_000)...)
	if err := f.c.SetPolicy(&kvcv1.Policy{MaxConcurrentTransfers: proto.Int32(2), SeedMaxInflightDecode: proto.Int32(2)}); err != nil {
		t.Fatal(err)
	}
	const sessions, workers = 200, 16
	var mu sync.Mutex
	seedsPerD := map[string]int{}
	var seeds []*kvcv1.RouteDecision
	budget := 0
	var wg sync.WaitGroup
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := g; i < sessions; i += workers {
				d := f.s.Handle(query(fmt.Sprintf("big-%d", i), 1, 80_000, 500)).GetDecision()
				mu.Lock()
				switch {
				case d == nil:
					t.Error("no decision")
				case d.Mode == kvcv1.RouteMode_ROUTE_MODE_SEED:
					seeds = append(seeds, d)
					seedsPerD[d.Decode.WorkerId]++
				case d.Reason == kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_INFLIGHT && d.Execution.GetOpenSession():
					budget++
				default:
					t.Errorf("unexpected %s/%s", d.Mode, d.Reason)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(seeds) != 8 || budget != sessions-8 {
		t.Fatalf("%d seeds, %d budget fallbacks", len(seeds), budget)
	}
	for d, n := range seedsPerD {
		if n > 2 {
			t.Fatalf("%s got %d concurrent seeds", d, n)
		}
	}
	f.checkLedger()
	// Outcomes free the slots: the next wave seeds again.
	for _, d := range seeds[:4] {
		f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT, 0)
	}
	n := 0
	for i := range 10 {
		if d := f.decide(fmt.Sprintf("late-%d", i), 1, 80_000, 500); d.Mode == kvcv1.RouteMode_ROUTE_MODE_SEED {
			n++
		}
	}
	if n != 4 {
		t.Fatalf("%d seeds after 4 slots freed", n)
	}
	// seed_min_turn=2 holds every turn-1 seed back.
	if err := f.c.SetPolicy(&kvcv1.Policy{SeedMinTurn: proto.Int32(2), MaxConcurrentTransfers: proto.Int32(0)}); err != nil {
		t.Fatal(err)
	}
	if d := f.decide("storm-x", 1, 80_000, 500); d.Reason != kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_EARLY_TURN {
		t.Fatalf("seed_min_turn: %s", d.Reason)
	}
	f.checkLedger()
}

// Concurrent first queries of one session: exactly one seed, the others go plain P/D
// (SESSION_NOT_RESIDENT) instead of racing it.
func TestConcurrentQueriesOfOneSessionSeedOnce(t *testing.T) {
	f := newFixture(t, manyDecode(4, 1_000_000)...)
	const n = 32
	modes := make(chan *kvcv1.RouteDecision, n)
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			modes <- f.s.Handle(query("same", 0, 5000, 10)).GetDecision()
		}()
	}
	wg.Wait()
	close(modes)
	seeds := 0
	for d := range modes {
		switch {
		case d.GetMode() == kvcv1.RouteMode_ROUTE_MODE_SEED:
			seeds++
		case d.GetReason() != kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT:
			t.Errorf("unexpected %s/%s", d.GetMode(), d.GetReason())
		}
	}
	if seeds != 1 {
		t.Fatalf("%d seeds of one session", seeds)
	}
	f.checkLedger()
}
