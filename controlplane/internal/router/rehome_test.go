package router

import (
	"runtime"
	"slices"
	"testing"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/proto"
)

// lostRecord is a session whose decode worker from left READY (the state dropped its
// residency), with a snapshot of snapLen tokens on p0 (none when snapLen is 0).
func lostRecord(id, from string, kv, snapLen int64) *kvcv1.SessionRecord {
	rec := &kvcv1.SessionRecord{SessionId: id, PreviousDecodeWorker: from, KvCommittedLen: kv, Generation: 3, Turn: 2}
	if snapLen > 0 {
		rec.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p0", Seqlen: snapLen, Generation: 3, Bytes: snapLen * 64}
	}
	return rec
}

// loads returns the LoadSessionCommands sent to worker, by session.
func loads(c *routertest.Cluster, worker string) map[string]*kvcv1.LoadSessionCommand {
	out := map[string]*kvcv1.LoadSessionCommand{}
	for _, cmd := range c.Commands(worker) {
		if l := cmd.GetLoadSession(); l != nil {
			out[l.GetSessionId()] = l
		}
	}
	return out
}

func pushes(c *routertest.Cluster, worker string) int {
	n := 0
	for _, cmd := range c.Commands(worker) {
		if cmd.GetPushSnapshot() != nil {
			n++
		}
	}
	return n
}

// loaded delivers decode worker d's LOADED event for l and waits until it is applied.
func (f *fixture) loaded(d string, l *kvcv1.LoadSessionCommand, ok bool) {
	f.t.Helper()
	kind := kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED
	if !ok {
		kind = kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED
	} else {
		f.c.Commit(d, l.GetSessionId(), l.GetSeqlen()) // the load's COMMITTED, before LOADED on its stream
	}
	f.s.SessionLoaded(d, &kvcv1.SessionEvent{SessionId: l.GetSessionId(), Kind: kind, KvLen: l.GetSeqlen(), Room: l.GetRoom(),
		Detail: l.GetDecisionId()})
	f.s.rehomeWG.Wait()
}

func TestRehomeSessionsOfALostWorker(t *testing.T) {
	tests := []struct {
		name       string
		snap       int64 // the session's snapshot length (0: none)
		d2Capacity int64
		wantLoad   bool
		result     string
		resident   bool
	}{
		{"snapshot: loaded onto the other D", 1000, 10_000, true, "loaded", true},
		{"no snapshot: lost as before", 0, 10_000, false, "no_snapshot", false},
		{"no room anywhere: queued, not sent", 1000, 500, false, "", false},
		{"load failed: lost, next turn reseeds", 1000, 10_000, true, "load_failed", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d2", tc.d2Capacity, 0))
			f.c.PutSession(lostRecord("S", "d1", 1000, tc.snap))
			f.s.SessionsLost("d1", []string{"S"})
			f.s.rehomePass()
			l := loads(f.c, "d2")["S"]
			if (l != nil) != tc.wantLoad {
				t.Fatalf("load_session sent %v, want %v (commands %v)", l != nil, tc.wantLoad, f.c.Commands("d2"))
			}
			if tc.wantLoad {
				if l.GetSeqlen() != 1000 || l.GetPrefillWorkerId() != "p0" || l.GetPrefillPeerAddr() != "p0:7000" || l.GetRoom() == 0 || pushes(f.c, "p0") != 1 {
					t.Fatalf("load %v, pushes to p0 %d", l, pushes(f.c, "p0"))
				}
				if got := testutil.ToFloat64(f.s.m.decisions.WithLabelValues("RESEED_SNAPSHOT", "REHOME")); got != 1 {
					t.Fatalf("REHOME decisions %v", got)
				}
				if f.s.rehomeWait("S") == nil || f.s.nRehomes.Load() != 1 {
					t.Fatalf("a re-home in flight not seen by a turn's look (%d counted)", f.s.nRehomes.Load())
				}
				f.loaded("d2", l, tc.result == "loaded")
			}
			if f.s.rehomeWait("S") != nil || f.s.nRehomes.Load() != 0 {
				t.Fatalf("a re-home ended still seen by a turn's look (%d counted)", f.s.nRehomes.Load())
			}
			rec, _ := f.c.Session("S")
			if got := rec.GetDecodeWorker() == "d2"; got != tc.resident {
				t.Fatalf("resident on d2 %v, want %v (record %v)", got, tc.resident, rec)
			}
			if tc.resident {
				var target *kvcv1.SetSnapshotTargetCommand
				for _, cmd := range f.c.Commands("d2") {
					if tg := cmd.GetSetSnapshotTarget(); tg != nil {
						target = tg
					}
				}
				if target == nil || target.GetValidBaseLen() != 1000 || target.GetBaseGeneration() != 3 || rec.GetGeneration() <= 3 {
					t.Fatalf("snapshot target %v, generation %d", target, rec.GetGeneration())
				}
			}
			if tc.result != "" {
				if got := testutil.ToFloat64(f.s.m.rehomes.WithLabelValues(tc.result)); got != 1 {
					t.Fatalf("rehomes{%s} = %v", tc.result, got)
				}
			}
			f.s.mu.Lock()
			held := f.s.led.pending.len()
			f.s.mu.Unlock()
			if held != 0 {
				t.Fatalf("%d reservations left", held)
			}
		})
	}
}

// Re-homes take transfer slots: with one slot per decode worker, a second session waits until
// the first has loaded.
func TestRehomeRespectsTheTransferBudget(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d2", 100_000, 0))
	if err := f.c.SetPolicy(&kvcv1.Policy{MaxConcurrentTransfers: proto.Int32(1)}); err != nil {
		t.Fatal(err)
	}
	f.c.PutSession(lostRecord("A", "d1", 1000, 1000))
	f.c.PutSession(lostRecord("B", "d1", 1000, 1000))
	f.s.SessionsLost("d1", []string{"A", "B"})
	f.s.rehomePass()
	first := loads(f.c, "d2")
	if len(first) != 1 {
		t.Fatalf("%d loads in flight with one transfer slot", len(first))
	}
	for _, l := range first {
		f.loaded("d2", l, true)
	}
	f.s.rehomePass()
	if got := loads(f.c, "d2"); len(got) != 2 {
		t.Fatalf("after the first loaded: loads %v", got)
	}
}

// A turn that arrives while its session is being re-homed waits for it and is then DIRECT_TO_D
// on the new decode worker: one snapshot push in all, never a second reseed. A turn decided
// first keeps its reseed and the re-home leaves the session alone.
func TestRehomeTurnWaits(t *testing.T) {
	t.Run("turn during the re-home waits", func(t *testing.T) {
		f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d2", 100_000, 0))
		f.c.PutSession(lostRecord("S", "d1", 1000, 1000))
		f.s.SessionsLost("d1", []string{"S"})
		f.s.rehomePass()
		l := loads(f.c, "d2")["S"]
		if l == nil {
			t.Fatal("no load")
		}
		got := make(chan *kvcv1.RouteResponse, 1)
		go func() { got <- f.s.Handle(query("S", 3, 1100, 50)) }()
		for testutil.ToFloat64(f.s.m.rehomeWaits) == 0 { // the turn is waiting for the re-home
			runtime.Gosched()
		}
		f.loaded("d2", l, true)
		d := (<-got).GetDecision()
		if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.GetDecode().GetWorkerId() != "d2" || d.GetCachedTokens() != 1000 {
			t.Fatalf("turn after the re-home: %v", d)
		}
		if n := pushes(f.c, "p0"); n != 1 {
			t.Fatalf("%d snapshot pushes, want 1", n)
		}
	})
	t.Run("turn before the re-home keeps its reseed", func(t *testing.T) {
		f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d2", 100_000, 0))
		f.c.PutSession(lostRecord("S", "d1", 1000, 1000))
		d := f.decide("S", 3, 1100, 50)
		if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
			t.Fatalf("turn: %v", d)
		}
		f.s.SessionsLost("d1", []string{"S"})
		f.s.rehomePass()
		if l := loads(f.c, "d2"); len(l) != 0 || pushes(f.c, "p0") != 1 {
			t.Fatalf("re-home started beside the turn's reseed: loads %v, pushes %d", l, pushes(f.c, "p0"))
		}
	})
}

// On the Route stream a turn of a session being re-homed waits off the stream's loop: a turn of
// another session sent after it is answered first, and the waiting one is answered DIRECT_TO_D
// once the re-home loaded.
func TestRehomeWaitDoesNotHoldTheStream(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d2", 100_000, 0))
	f.c.PutSession(lostRecord("S", "d1", 1000, 1000))
	f.s.SessionsLost("d1", []string{"S"})
	f.s.rehomePass()
	l := loads(f.c, "d2")["S"]
	if l == nil {
		t.Fatal("no load")
	}
	st := openRoute(t, f.s)
	if err := st.Send(query("S", 3, 1100, 50)); err != nil {
		t.Fatal(err)
	}
	if err := st.Send(query("other", 0, 2000, 50)); err != nil {
		t.Fatal(err)
	}
	first, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if first.GetDecision().GetRequestId() != "r-other-0" {
		t.Fatalf("first answer %v, want the other session's (the re-homing one waits)", first)
	}
	f.loaded("d2", l, true)
	second, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if d := second.GetDecision(); d.GetRequestId() != "r-S-3" || d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.GetDecode().GetWorkerId() != "d2" {
		t.Fatalf("second answer %v, want S DIRECT_TO_D on d2", second)
	}
	_ = st.CloseSend()
}

// A re-homed session whose content the leader knows keeps it: the new decode worker loaded the
// snapshot, whose pages are the session's, so the next turn (a prompt that extends the
// conversation) is DIRECT_TO_D on the whole loaded KV there. Before, the re-home's outcome had
// no query content and the leader forgot the session's: the next turn reseeded with
// PREFIX_MISMATCH (seen with real KV: deploy/gpu/run-fromsnap.sh's rehome phase).
func TestRehomeKeepsContent(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d1", 200_000, 0), routertest.Decode("d2", 200_000, 0))
	prompt := idsN(1_000, 1)
	d := f.contentDecide("S", prompt, 50)
	gen := idsN(50, 70_000)
	f.contentReport(d, prompt, gen, 0)
	conv := append(append([]uint32(nil), prompt...), gen...)
	from, to := d.Decode.WorkerId, "d1"
	if from == "d1" {
		to = "d2"
	}
	// The snapshot of the whole committed KV reached p0; then from left READY.
	f.c.UpdateSession("S", func(r *kvcv1.SessionRecord) {
		r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p0", Seqlen: int64(len(conv)), Generation: r.Generation, Bytes: 1}
		r.PreviousDecodeWorker, r.DecodeWorker = from, ""
	})
	f.c.SetOffline(from, true)
	f.s.SessionsLost(from, []string{"S"})
	f.s.rehomePass()
	l := loads(f.c, to)["S"]
	if l == nil || l.GetSeqlen() != int64(len(conv)) {
		t.Fatalf("load on %s: %v", to, l)
	}
	f.loaded(to, l, true)
	if rec := f.session("S"); rec.GetDecodeWorker() != to || loadChain(rec) == nil {
		t.Fatalf("after the re-home: resident on %q, content chain %d bytes", rec.GetDecodeWorker(), len(rec.GetContentChain()))
	}
	next := append(append([]uint32(nil), conv...), idsN(200, 80_000)...)
	d = f.contentDecide("S", next, 40)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != to || d.CachedTokens != int64(len(conv)) {
		t.Fatalf("next turn after the re-home: %s/%s on %s cached %d, want DIRECT_TO_D on %s cached %d",
			d.Mode, d.Reason, d.Decode.GetWorkerId(), d.CachedTokens, to, len(conv))
	}
}

// A re-home is admitted only into free room below --rehome-fill of its target: idle sessions
// there count as used (the capacity rule of a turn counts them as room the worker releases on
// demand, and the release took the re-homed sessions first), and so do the re-homes in flight.
// A session with no room is not sent and, after the reservation timeout, lost as before.
func TestRehomeOnlyIntoFreeRoom(t *testing.T) {
	tests := []struct {
		name       string
		used, idle int64   // d2's last load report: used tokens, of which evictable
		sessions   []int64 // the lost sessions' snapshot lengths, re-homed in this order
		fill       float64
		want       int // loads sent to d2
	}{
		{"empty target: loaded", 0, 0, []int64{1000}, DefaultRehomeFill, 1},
		{"idle sessions fill it: not sent", 7500, 7500, []int64{1000}, DefaultRehomeFill, 0},
		{"up to the fill exactly", 7000, 7000, []int64{1000}, DefaultRehomeFill, 1},
		{"the re-home in flight counts", 0, 0, []int64{4500, 4500}, DefaultRehomeFill, 1},
		{"both below the fill", 0, 0, []int64{4000, 4000}, DefaultRehomeFill, 2},
		{"fill 0: no re-homes", 0, 0, []int64{1000}, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d2 := routertest.Decode("d2", 10_000, tc.used)
			d2.Load.EvictableTokens = tc.idle
			f := newFixture(t, routertest.Prefill("p0"), d2)
			if err := f.c.SetPolicy(&kvcv1.Policy{MaxConcurrentTransfers: proto.Int32(8)}); err != nil {
				t.Fatal(err)
			}
			f.s.SetRehomeFill(tc.fill)
			var ids []string
			for i, n := range tc.sessions {
				id := string(rune('A' + i))
				f.c.PutSession(lostRecord(id, "d1", n, n))
				ids = append(ids, id)
			}
			f.s.SessionsLost("d1", ids)
			f.s.rehomePass()
			if got := loads(f.c, "d2"); len(got) != tc.want {
				t.Fatalf("%d loads sent to d2, want %d (%v)", len(got), tc.want, got)
			}
			f.s.rqMu.Lock()
			queued := len(f.s.rq.items)
			f.s.rqMu.Unlock()
			if queued != len(tc.sessions)-tc.want {
				t.Fatalf("%d sessions still queued, want %d", queued, len(tc.sessions)-tc.want)
			}
			for _, id := range ids[tc.want:] {
				if rec, _ := f.c.Session(id); rec.GetDecodeWorker() != "" {
					t.Fatalf("session %s resident on %s without a load", id, rec.GetDecodeWorker())
				}
			}
		})
	}
}

// The policy's best target has no free room below the fill for the session (its scores weigh a
// short transfer queue above a little headroom), another has: the session goes there at once
// instead of waiting behind the best (on the code before it stayed queued, no load sent).
func TestRehomeTriesTheNextBestTarget(t *testing.T) {
	d2 := routertest.Decode("d2", 10_000, 7100) // 7100 + 1000 > 0.8 × 10000
	d2.Load.EvictableTokens = 7100
	d3 := routertest.Decode("d3", 10_000, 6900) // fits below the fill, but a longer queue
	d3.Load.EvictableTokens = 6900
	d3.Load.TransferQueueDepth = 3
	f := newFixture(t, routertest.Prefill("p0"), d2, d3)
	f.c.PutSession(lostRecord("A", "d1", 1000, 1000))
	f.s.SessionsLost("d1", []string{"A"})
	f.s.rehomePass()
	if got := loads(f.c, "d3"); got["A"] == nil {
		t.Fatalf("A not re-homed onto d3: d3 %v, d2 %v", got, loads(f.c, "d2"))
	}
	if got := loads(f.c, "d2"); len(got) != 0 {
		t.Fatalf("a load sent to d2, which has no free room: %v", got)
	}
}

// The queue is tried soonest due first: with one transfer slot, the session whose next turn is
// due first by its usual gap between turns is re-homed first, then the next due, then one that
// has paused (idle more than twice its gap), then one with a single turn; whatever order the
// sidecar reported the losses in (on the code before: that order).
func TestRehomeSoonestDueFirst(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d2", 100_000, 0))
	if err := f.c.SetPolicy(&kvcv1.Policy{MaxConcurrentTransfers: proto.Int32(1)}); err != nil {
		t.Fatal(err)
	}
	now := f.now.UnixMilli()
	for _, s := range []struct {
		id            string
		turn          int32
		created, seen int64 // ms before now
	}{
		{"single", 0, 1_000, 1_000},     // one turn: no gap to go by
		{"paused", 5, 100_000, 60_000},  // gap 8 s, idle 60 s
		{"later", 10, 50_000, 3_000},    // gap 4.7 s: due in 1.7 s
		{"soonest", 10, 100_000, 8_000}, // gap 9.2 s: due in 1.2 s
	} {
		rec := lostRecord(s.id, "d1", 1000, 1000)
		rec.Turn, rec.CreatedUnixMs, rec.LastSeenUnixMs = s.turn, now-s.created, now-s.seen
		f.c.PutSession(rec)
	}
	f.s.SessionsLost("d1", []string{"single", "paused", "later", "soonest"})
	var order []string
	for range 4 {
		f.s.rehomePass()
		for id, l := range loads(f.c, "d2") {
			if !slices.Contains(order, id) {
				order = append(order, id)
				f.loaded("d2", l, true)
			}
		}
	}
	if want := []string{"soonest", "later", "paused", "single"}; !slices.Equal(order, want) {
		t.Fatalf("re-homed in order %v, want %v", order, want)
	}
}

// A new term drops the re-homes in flight: a turn's look (rehomeWait, lock-free while none is
// counted) finds none.
func TestRehomeCountResetWithTheTerm(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p0"), routertest.Decode("d2", 10_000, 0))
	f.c.PutSession(lostRecord("S", "d1", 1000, 1000))
	f.s.SessionsLost("d1", []string{"S"})
	f.s.rehomePass()
	if f.s.rehomeWait("S") == nil {
		t.Fatal("no re-home in flight after the pass")
	}
	f.s.OnLeadershipChange(false)
	if f.s.rehomeWait("S") != nil || f.s.nRehomes.Load() != 0 {
		t.Fatalf("re-homes of the old term still seen (%d counted)", f.s.nRehomes.Load())
	}
}
