package worker

import (
	"context"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// fidelityTiming: a 300 ms prefill pass whatever its size, 40 ms decode steps and a link of
// 1 GB/s at 500 kB per token (400 tokens = 200 ms), at real speed.
func fidelityTiming() Timing {
	return Timing{PrefillTokensPerS: 1e12, PrefillOverhead: 300 * time.Millisecond, DecodePerToken: 40 * time.Millisecond,
		LinkGbps: 8, ModelBytesPerToken: 500_000, Scale: 1}
}

type timed struct {
	r   result
	end time.Time
}

func postAsync(t *testing.T, ctx context.Context, url string, b []byte) <-chan timed {
	ch := make(chan timed, 1)
	go func() {
		r := post(t, ctx, url, b)
		ch <- timed{r, time.Now()}
	}()
	return ch
}

// TestPrefillWaitsForDecodePrealloc: SGLang's prefill leaves its bootstrap queue only once the
// decode worker has pre-allocated pages. B's decode half waits in D's prealloc queue until A's
// turn ends; B's prefill must start only then, so it ends a whole prefill pass after A's end
// (before: P prefilled meanwhile and B's prefill was hidden behind D's wait).
func TestPrefillWaitsForDecodePrealloc(t *testing.T) {
	h := newHub()
	tm := fidelityTiming()
	tm.LinkGbps = 1e6 // no link time
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, tm)
	// Room for one turn of 40 + 10 tokens (13 pages of 4) only.
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 60, tm, 10*time.Second)
	ctx := context.Background()
	req := func(sess string, room int64, role string) []byte {
		return body("r-"+sess, 10, false, kvcReq{Mode: "SEED", Role: role, SessionID: sess, InputTokens: 40, Room: i64(room)})
	}
	aD := postAsync(t, ctx, d.url, req("a", 1, "decode"))
	if ar := post(t, ctx, p.url, req("a", 1, "prefill")); ar.status != 200 {
		t.Fatalf("A prefill: %d %s", ar.status, ar.code)
	}
	// A's KV is on D; D decodes A for 400 ms with A's pages pinned. Now B, both halves at once.
	bD := postAsync(t, ctx, d.url, req("b", 2, "decode"))
	bP := postAsync(t, ctx, p.url, req("b", 2, "prefill"))
	a, bp, bd := <-aD, <-bP, <-bD
	if a.r.status != 200 || bp.r.status != 200 || bd.r.status != 200 {
		t.Fatalf("A D %d %s, B P %d %s, B D %d %s", a.r.status, a.r.code, bp.r.status, bp.r.code, bd.r.status, bd.r.code)
	}
	if gap := bp.end.Sub(a.end); gap < 250*time.Millisecond {
		t.Fatalf("B's prefill ended %v after A's turn freed D's pages: it ran while D had no pages for it (want a whole 300 ms pass after)", gap)
	}
	if w := bp.r.ans.MetaInfo.KVC.BootstrapWaitMS; w < 200 {
		t.Fatalf("B's bootstrap wait %v ms, want about A's remaining decode (~400 ms)", w)
	}
}

// TestTierPullDoesNotHoldPrefillGPU: a prefill that first pulls a long prefix from a KV tier
// (HiCache L3 prefetch, llm-d's host-tier pull) holds the GPU only for its compute: another
// prefill arriving during the pull is not queued behind it.
func TestTierPullDoesNotHoldPrefillGPU(t *testing.T) {
	h := newHub()
	tm := fidelityTiming()
	tm.PrefillOverhead = 100 * time.Millisecond
	tier := filepath.Join(t.TempDir(), "l3")
	off, err := NewBaseline(BaselineConfig{OffloadDir: tier}, 4)
	if err != nil {
		t.Fatal(err)
	}
	// The tier holds 1,600 tokens of session a's history: an 800 ms pull.
	if err := off.offloadWrite("a", chainHashes((&plan{seedKey: "a"}).tokenIDs(1600), 4), 4); err != nil {
		t.Fatal(err)
	}
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 8192, tm)
	p.w.cfg.Baseline, err = NewBaseline(BaselineConfig{PullDirs: []string{tier}}, 4)
	if err != nil {
		t.Fatal(err)
	}
	tmD := tm
	tmD.LinkGbps = 1e6 // the decode side's receive is not what is measured
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 8192, tmD)
	ctx := context.Background()
	req := func(sess string, in, room int64, role string) []byte {
		return body("r-"+sess, 1, false, kvcReq{Mode: "SEED", Role: role, SessionID: sess, InputTokens: in, Room: i64(room)})
	}
	aD := postAsync(t, ctx, d.url, req("a", 1700, 1, "decode"))
	aP := postAsync(t, ctx, p.url, req("a", 1700, 1, "prefill"))
	waitFor(t, func() bool { return p.w.inbound.count() == 1 }) // A is pulling
	t0 := time.Now()
	bD := postAsync(t, ctx, d.url, req("b", 40, 2, "decode"))
	bp := <-postAsync(t, ctx, p.url, req("b", 40, 2, "prefill"))
	if bp.r.status != 200 {
		t.Fatalf("B prefill: %d %s", bp.r.status, bp.r.code)
	}
	if took := bp.end.Sub(t0); took > 600*time.Millisecond {
		t.Fatalf("B's 100 ms prefill took %v: it waited behind A's 800 ms tier pull", took)
	}
	ap := <-aP
	if ap.r.status != 200 || ap.r.ans.MetaInfo.KVC.FetchMS < 750 || ap.r.ans.MetaInfo.KVC.PrefixCachedTokens != 1600 {
		t.Fatalf("A: %d %s, fetch %v ms, %d tokens from the tier (want ~800 ms, 1600)", ap.r.status, ap.r.code,
			ap.r.ans.MetaInfo.KVC.FetchMS, ap.r.ans.MetaInfo.KVC.PrefixCachedTokens)
	}
	<-aD
	<-bD
}

// TestLinkSharedByConcurrentTransfers: two transfers into one node share its NIC (and two out
// of one sender its egress): each takes about twice as long as alone, where before each was an
// independent sleep of the whole link's time.
func TestLinkSharedByConcurrentTransfers(t *testing.T) {
	tm := fidelityTiming() // 400 tokens: 200 ms alone
	alone := tm.Transfer(400)
	cases := []struct {
		name string
		// two flows: into which worker, from which sender
		into [2]int
		from [2]string
	}{
		{"one NIC inbound", [2]int{0, 0}, [2]string{"", ""}},
		{"one sender's egress", [2]int{0, 1}, [2]string{"p0:1", "p0:1"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			ws := []*Worker{{cfg: Config{Timing: tm, LinkDir: dir}}, {cfg: Config{Timing: tm, LinkDir: dir}}}
			var wg sync.WaitGroup
			took := make([]time.Duration, 2)
			start := make(chan struct{})
			for i := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					d, err := ws[c.into[i]].move(context.Background(), 400, c.from[i])
					if err != nil {
						t.Error(err)
					}
					took[i] = d
				}()
			}
			close(start)
			wg.Wait()
			for i, d := range took {
				if d < alone*3/2 {
					t.Errorf("flow %d took %v; alone it takes %v, shared it must take about twice that", i, d, alone)
				}
			}
		})
	}
	// Flows on different links do not slow each other.
	dir := t.TempDir()
	a, b := &Worker{cfg: Config{Timing: tm, LinkDir: dir}}, &Worker{cfg: Config{Timing: tm, LinkDir: dir}}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _, _ = a.move(context.Background(), 400, "p0:1") }()
	d, _ := b.move(context.Background(), 400, "p1:1")
	wg.Wait()
	if d >= alone*3/2 {
		t.Errorf("a flow on its own links took %v, want about %v", d, alone)
	}
	// A tier with twice a NIC's egress (a store striped over two nodes) serves two receivers at
	// full rate each; with the default (one NIC) they share it.
	for _, tc := range []struct {
		egress float64
		slow   bool
	}{{0, true}, {2 * tm.LinkGbps, false}} {
		dir := t.TempDir()
		a := &Worker{cfg: Config{Timing: tm, LinkDir: dir, TierEgressGbps: tc.egress}}
		b := &Worker{cfg: Config{Timing: tm, LinkDir: dir, TierEgressGbps: tc.egress}}
		var da, db time.Duration
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); da, _ = a.fetch(context.Background(), 400, "/tier/l3") }()
		db, _ = b.fetch(context.Background(), 400, "/tier/l3")
		wg.Wait()
		if slow := min(da, db) >= alone*5/4; slow != tc.slow {
			t.Errorf("tier egress %v Gb/s: two fetches took %v and %v (alone %v), want shared %v", tc.egress, da, db, alone, tc.slow)
		}
	}
}

// TestDecodeSidePrefillSlowsCoRunningDecode: a prefill on a decode worker (here a local
// fallback prefill) shares the GPU with the running decode batch, so a request decoding
// meanwhile is slowed by the prefill's time (before: the prefill was free and parallel).
func TestDecodeSidePrefillSlowsCoRunningDecode(t *testing.T) {
	h := newHub()
	tm := Timing{PrefillTokensPerS: 1000, DecodePerToken: 60 * time.Millisecond, LinkGbps: 200, ModelBytesPerToken: 1, Scale: 1}
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, tm)
	local := func(rid string, in, maxNew int64) []byte {
		return body(rid, maxNew, false, kvcReq{Mode: "PD_FALLBACK", Role: "decode", InputTokens: in, Keep: bptr(false), LocalPrefill: bptr(true)})
	}
	ctx := context.Background()
	a := postAsync(t, ctx, d.url, local("a", 4, 5)) // 4 ms prefill, then 5 steps: 300 ms alone
	waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.decodeTokens) >= 1 })
	b := postAsync(t, ctx, d.url, local("b", 300, 1)) // a 300 ms prefill while A decodes
	ar, br := <-a, <-b
	if ar.r.status != 200 || br.r.status != 200 {
		t.Fatalf("A %d %s, B %d %s", ar.r.status, ar.r.code, br.r.status, br.r.code)
	}
	if e2e := ar.r.ans.MetaInfo.E2ELatency; e2e < 0.5 {
		t.Fatalf("A took %.3f s with B's 300 ms prefill on the same GPU: its decode steps did not wait for it (want >= 0.5 s, 0.3 s alone)", e2e)
	}
}

// TestDecodeMetaAccountsPhases: a decode worker's answer says where its time to the first token
// went (issue 20's recovery accounting): ttft_ms from the request's arrival, which holds its
// append-prefill, and gpu_wait_ms, the time its prefill waited for the running batch's decode
// step (B's 300 ms prefill arrives while A decodes 60 ms steps back to back).
func TestDecodeMetaAccountsPhases(t *testing.T) {
	h := newHub()
	tm := Timing{PrefillTokensPerS: 1000, DecodePerToken: 60 * time.Millisecond, LinkGbps: 200, ModelBytesPerToken: 1, Scale: 1}
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, tm)
	local := func(rid string, in, maxNew int64) []byte {
		return body(rid, maxNew, false, kvcReq{Mode: "PD_FALLBACK", Role: "decode", InputTokens: in, Keep: bptr(false), LocalPrefill: bptr(true)})
	}
	ctx := context.Background()
	a := postAsync(t, ctx, d.url, local("a", 4, 8))
	waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.decodeTokens) >= 1 })
	b := postAsync(t, ctx, d.url, local("b", 300, 1))
	ar, br := <-a, <-b
	if ar.r.status != 200 || br.r.status != 200 {
		t.Fatalf("A %d %s, B %d %s", ar.r.status, ar.r.code, br.r.status, br.r.code)
	}
	k := br.r.ans.MetaInfo.KVC
	if k.TTFTMS < k.PrefillMS+ms(tm.Decode()) || k.TTFTMS > br.r.ans.MetaInfo.E2ELatency*1000 {
		t.Fatalf("B: ttft_ms %.3f, want at least its prefill %.3f ms plus a decode step and at most its latency %.3f s", k.TTFTMS, k.PrefillMS, br.r.ans.MetaInfo.E2ELatency)
	}
	if k.GPUWaitMS <= 0 || k.GPUWaitMS > ms(tm.Decode())+50 {
		t.Fatalf("B: gpu_wait_ms %.3f, want the rest of A's 60 ms decode step its prefill waited for", k.GPUWaitMS)
	}
	if ka := ar.r.ans.MetaInfo.KVC; ka.TTFTMS <= 0 || ka.TTFTMS > ar.r.ans.MetaInfo.E2ELatency*1000 {
		t.Fatalf("A: ttft_ms %.3f outside (0, latency %.3f s]", ka.TTFTMS, ar.r.ans.MetaInfo.E2ELatency)
	}
}

// TestWatermarkModeNeverEvictsOnDemand: with EvictOnlyByRelease (E4's decode workers, which run
// SGLang streaming sessions) an idle session is not evicted for a request that needs its pages:
// the request waits in the prealloc queue until the sidecar's capacity release frees the
// session (before: kvc-sim evicted it at once, LRU), and the worker reports that demand to the
// sidecar (ReportDemand), which sees no other sign of it.
func TestWatermarkModeNeverEvictsOnDemand(t *testing.T) {
	for _, watermark := range []bool{false, true} {
		t.Run(map[bool]string{false: "lru", true: "watermark"}[watermark], func(t *testing.T) {
			h := newHub()
			p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
			d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 64, zeroTiming(), 10*time.Second)
			d.w.cfg.EvictOnlyByRelease = watermark
			seed := func(sess string, room int64) kvcReq {
				return kvcReq{Mode: "SEED", SessionID: sess, InputTokens: 40, Room: i64(room)}
			}
			if _, dr := pd(t, p, d, "a", 4, seed("a", 1)); dr.status != 200 {
				t.Fatalf("seed a: %d %s", dr.status, dr.code)
			}
			// b needs 11 of 16 pages; a holds 11 and is idle.
			done := make(chan result, 1)
			go func() { _, dr := pd(t, p, d, "b", 4, seed("b", 2)); done <- dr }()
			if !watermark {
				if dr := <-done; dr.status != 200 || dr.ans.MetaInfo.KVC.EvictedSessions != 1 {
					t.Fatalf("lru: b %d %s, evicted %d; want a evicted at once", dr.status, dr.code, dr.ans.MetaInfo.KVC.EvictedSessions)
				}
				for _, r := range d.sc.demandReports() { // capacity reports only (unevictable tokens)
					if r.GetWaitingRequests() != 0 || r.GetWaitingTokens() != 0 {
						t.Fatalf("lru: demand report %v; an engine that evicts reports no demand", r)
					}
				}
				return
			}
			waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.preallocWaits) >= 1 })
			if _, ok := sessionsOf(t, d)["a"]; !ok {
				t.Fatal("watermark: the engine evicted a for b")
			}
			// The sidecar is told what waits (b's 11 pages, 44 tokens) and what is free (5
			// pages): its release must see the demand, the pool being under no watermark it knows.
			firstDemand := func() *kvcv1.ReportDemandRequest {
				for _, r := range d.sc.demandReports() {
					if r.GetWaitingRequests() > 0 {
						return r
					}
				}
				return nil
			}
			waitFor(t, func() bool { return firstDemand() != nil })
			if got := firstDemand(); got.GetWaitingRequests() != 1 || got.GetWaitingTokens() != 44 || got.GetFreeTokens() != 20 {
				t.Fatalf("demand report %v; want 1 request, 44 tokens waiting, 20 free", got)
			}
			if _, err := d.w.releaseForSidecar("a", kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY); err != nil {
				t.Fatal(err)
			}
			if dr := <-done; dr.status != 200 {
				t.Fatalf("b after the sidecar released a: %d %s", dr.status, dr.code)
			}
			// b got its pages: the queue's demand is reported gone.
			reps := d.sc.demandReports()
			if last := reps[len(reps)-1]; last.GetWaitingRequests() != 0 || last.GetWaitingTokens() != 0 {
				t.Fatalf("last demand report %v; want none waiting", last)
			}
		})
	}
}

// TestDecodeRadixLivesInThePool: SGLang's decode radix cache is part of the decode KV pool
// (budget = free + evictable): a finished plain P/D turn's pages stay in the pool, a request
// that needs them evicts them least recently used first, and a turn that matches a cached
// prefix uses (and locks) those pages, allocating only the rest (before: the radix was a
// separate, free set of hashes and every turn's pages were freed).
func TestDecodeRadixLivesInThePool(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 64, zeroTiming(), 5*time.Second) // 16 pages of 4
	var err error
	if d.w.cfg.Baseline, err = NewBaseline(BaselineConfig{DecodeRadix: true}, 4); err != nil {
		t.Fatal(err)
	}
	d.w.prad = newPoolRadix(16)
	plain := func(room, in int64) kvcReq {
		return kvcReq{Mode: "PD_FALLBACK", InputTokens: in, Room: i64(room), Keep: bptr(false)}
	}
	steps := []struct {
		name        string
		rid         string
		room, in    int64
		cached      int64
		free, radix int64
	}{
		// 40 + 4 tokens: 11 pages, all full after the turn: they stay as the radix.
		{"a's KV stays in the pool", "a", 1, 40, 0, 5, 11},
		// Other content, 11 pages: 5 free + a's 6 least recently used (its deepest) evicted.
		{"b evicts a's leaves", "b", 2, 40, 0, 0, 16},
		// a's next turn (same content, 52 + 4): a's 5 remaining pages (20 tokens) are its prefix,
		// locked and used; 9 more pages come from b's least recently used.
		{"a's next turn reuses its prefix", "a", 3, 52, 20, 0, 16},
	}
	for _, st := range steps {
		_, dr := pd(t, p, d, st.rid, 4, plain(st.room, st.in))
		if dr.status != 200 {
			t.Fatalf("%s: %d %s", st.name, dr.status, dr.code)
		}
		s := d.w.stats()
		if got := dr.ans.MetaInfo.KVC.PrefixCachedTokens; got != st.cached || s.FreePages != st.free || s.RadixPages != st.radix {
			t.Fatalf("%s: cached %d, free %d, radix %d pages; want %d, %d, %d", st.name, got, s.FreePages, s.RadixPages, st.cached, st.free, st.radix)
		}
	}
}

// Locked radix pages (a running turn's prefix) are never evicted.
func TestPoolRadixLocks(t *testing.T) {
	r := newPoolRadix(8)
	for i := range 4 {
		r.adopt(uint64(i+1), int64(10+i))
	}
	locked := r.lockMatch([]uint64{1, 2, 9}, 8)
	if len(locked) != 2 || r.evictable() != 2 {
		t.Fatalf("locked %d, evictable %d; want 2, 2", len(locked), r.evictable())
	}
	if got := r.evict(4); len(got) != 2 || r.size() != 2 {
		t.Fatalf("evicted %v, %d left; want the 2 unlocked", got, r.size())
	}
	r.unlock(locked)
	if r.evictable() != 2 || !r.adopt(5, 20) || r.adopt(1, 21) {
		t.Fatalf("after unlock: evictable %d", r.evictable())
	}
}

// TestConcurrentSeedsShareTheDecodeNIC: two seeds received by one decode worker at the same time
// share its NIC, so each one's modeled link time is about twice what it is alone (before: an
// independent sleep of the whole link's time each).
func TestConcurrentSeedsShareTheDecodeNIC(t *testing.T) {
	h := newHub()
	tm := fidelityTiming()
	tm.PrefillOverhead = 0 // the two prefills end together
	p1 := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p1", 4096, tm)
	p2 := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p2", 4096, tm)
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, tm)
	d.w.cfg.LinkDir = t.TempDir()
	alone := ms(tm.Transfer(400)) // 200 ms
	var wg sync.WaitGroup
	got := make([]result, 2)
	for i, p := range []*testWorker{p1, p2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, got[i] = pd(t, p, d, "r", 1, kvcReq{Mode: "SEED", SessionID: []string{"a", "b"}[i], InputTokens: 400, Room: i64(int64(i + 1))})
		}()
	}
	wg.Wait()
	for i, r := range got {
		if r.status != 200 {
			t.Fatalf("seed %d: %d %s", i, r.status, r.code)
		}
		if m := r.ans.MetaInfo.KVC.TransferModelMS; m < 1.5*alone {
			t.Errorf("seed %d: modeled link time %v ms; alone %v ms, two at once must share the NIC", i, m, alone)
		}
	}
}

// TestWatermarkReleaseTakesAWaitingTurnsSession: in watermark mode a session whose only request
// is a direct turn still waiting in the prealloc queue (behind a reseed that needs the session's
// room) is released by the sidecar's capacity release — the SGLang plugin's
// release_for_capacity frees a slot whose turn is only queued — and the turn answers 409
// session_not_resident to be re-decided (before: the release was refused "in use", and the
// reseed at the head waited for room only the queued turn's own session could give, for the
// whole prealloc wait, with the turn behind it).
func TestWatermarkReleaseTakesAWaitingTurnsSession(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 64, zeroTiming(), 10*time.Second) // 16 pages of 4
	d.w.cfg.EvictOnlyByRelease = true
	if _, dr := pd(t, p, d, "a", 4, kvcReq{Mode: "SEED", SessionID: "a", InputTokens: 40, Room: i64(1)}); dr.status != 200 {
		t.Fatalf("seed a: %d %s", dr.status, dr.code)
	}
	kv := sessionsOf(t, d)["a"].KVLen
	// b needs 11 of 16 pages, a holds 11: b waits at the head of the queue.
	bDone := make(chan result, 1)
	go func() {
		_, dr := pd(t, p, d, "b", 4, kvcReq{Mode: "SEED", SessionID: "b", InputTokens: 40, Room: i64(2)})
		bDone <- dr
	}()
	waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.preallocWaits) >= 1 })
	// a's direct turn needs 2 more pages: it queues behind b, holding a.
	aDone := postAsync(t, context.Background(), d.url, body("a-2", 4, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "a", InputTokens: kv + 8, CachedTokens: kv, Keep: bptr(true)}))
	waitFor(t, func() bool {
		d.w.mu.Lock()
		defer d.w.mu.Unlock()
		s := d.w.sessions["a"]
		return s != nil && s.waiting == 1
	})
	if _, err := d.w.releaseForSidecar("a", kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY); err != nil {
		t.Fatalf("release of a session whose turn only waits for pages: %v", err)
	}
	if dr := <-bDone; dr.status != 200 {
		t.Fatalf("b after a's release: %d %s", dr.status, dr.code)
	}
	if r := (<-aDone).r; r.status != 409 || r.code != "session_not_resident" {
		t.Fatalf("a's waiting turn after its session's release: %d %s; want 409 session_not_resident", r.status, r.code)
	}
	// Nothing leaked: b's pages are all that is held.
	if st, held := d.w.stats(), sessionsOf(t, d); len(held) != 1 || st.FreePages != st.PageCount-11 {
		t.Fatalf("after: %d sessions, %d free of %d pages; want b's 11 held", len(held), st.FreePages, st.PageCount)
	}
}

// TestWatermarkReleaseSparesAWaitingTurnWhileAnotherIsIdle: a session whose direct turn waits
// for a few pages is not released for capacity while another session no request uses can be
// released instead — that release makes the room and the waiting turn runs on its resident KV
// (before: the release took the waiting turn's session, and the turn answered 409 to come back
// as a reseed of its whole context into the same full pool; issue 20).
func TestWatermarkReleaseSparesAWaitingTurnWhileAnotherIsIdle(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 64, zeroTiming(), 10*time.Second) // 16 pages of 4
	d.w.cfg.EvictOnlyByRelease = true
	for i, id := range []string{"a", "c"} {
		if _, dr := pd(t, p, d, id, 4, kvcReq{Mode: "SEED", SessionID: id, InputTokens: 20, Room: i64(int64(i + 1))}); dr.status != 200 {
			t.Fatalf("seed %s: %d %s", id, dr.status, dr.code)
		}
	}
	kv := sessionsOf(t, d)["a"].KVLen // 24 tokens, 6 pages each: 4 pages free
	// b needs 7 pages: it waits at the head of the queue.
	bDone := make(chan result, 1)
	go func() {
		_, dr := pd(t, p, d, "b", 4, kvcReq{Mode: "SEED", SessionID: "b", InputTokens: 24, Room: i64(3)})
		bDone <- dr
	}()
	waitFor(t, func() bool { return testutil.ToFloat64(d.w.m.preallocWaits) >= 1 })
	// a's direct turn needs 3 more pages: it queues behind b, holding a.
	aDone := postAsync(t, context.Background(), d.url, body("a-2", 4, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "a", InputTokens: kv + 8, CachedTokens: kv, Keep: bptr(true)}))
	waitFor(t, func() bool {
		d.w.mu.Lock()
		defer d.w.mu.Unlock()
		s := d.w.sessions["a"]
		return s != nil && s.waiting == 1
	})
	capacity := kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY
	if _, err := d.w.releaseForSidecar("a", capacity); err == nil || !strings.Contains(err.Error(), "waiting for pages") {
		t.Fatalf("release of a waiting turn's session with c idle: %v; want a refusal (waiting for pages)", err)
	}
	if freed, err := d.w.releaseForSidecar("c", capacity); err != nil || freed != kv {
		t.Fatalf("release of idle c: freed %d, %v; want %d", freed, err, kv)
	}
	if dr := <-bDone; dr.status != 200 {
		t.Fatalf("b after c's release: %d %s", dr.status, dr.code)
	}
	if r := (<-aDone).r; r.status != 200 {
		t.Fatalf("a's waiting turn after c's release: %d %s; want 200 on its resident KV", r.status, r.code)
	}
	if held := sessionsOf(t, d); len(held) != 2 || held["a"].KVLen <= kv {
		t.Fatalf("after: sessions %v; want a (grown past %d) and b", held, kv)
	}
}
