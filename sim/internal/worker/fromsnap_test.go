package worker

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestPrefillFromStoreSim: a large append served by prefill from the snapshot — P loads the
// session's snapshot prefix (whole pages) from its store, verifies every loaded token, and
// prefills only the tail; D keeps the prefix it holds (receive_from) and receives only the pages
// past it, verified; the session's KV is the whole context afterwards. A corrupted load fails
// with kv_verify_failed; a load the store cannot serve prefills the whole context.
func TestPrefillFromStoreSim(t *testing.T) {
	h := newHub()
	tm := zeroTiming()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, tm)
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	const perToken = 48 // 3 layers × K and V × 8 bytes
	// Seed: 101 tokens + 10 decoded = 111 committed: the store's snapshot (hub) has 111.
	if pr, dr := pd(t, p, d, "r1", 10, kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 101, Room: i64(1)}); pr.status != 200 || dr.status != 200 {
		t.Fatalf("seed: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	commits, _ := d.sc.snapshotOf()
	seedPages := commits[0].GetPages()
	before := testutil.ToFloat64(p.w.m.prefillTokens)

	// Large append to 300 tokens: load 111 (108 in whole pages), D keeps 108 of its 111.
	pr, dr := pd(t, p, d, "r2", 5, kvcReq{Mode: "PD_FALLBACK", SessionID: "s1", InputTokens: 300, Room: i64(2), Keep: bptr(true),
		LoadPrefix: 111, ReceiveFrom: 111})
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("large append from the snapshot: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	pk, dk := pr.ans.MetaInfo.KVC, dr.ans.MetaInfo.KVC
	if pk.LoadedTokens != 108 || pk.LoadVerifiedBytes != 108*perToken || pk.LoadedBytes != 108*perToken || pk.PrefillTokens != 192 || pk.LoadMiss {
		t.Fatalf("prefill meta %+v: want 108 tokens loaded and verified, 192 prefilled", pk)
	}
	if dk.ReceivedFrom != 108 || dk.ReceivedBytes != 192*perToken || dk.VerifiedBytes != 192*perToken || dk.VerifyFailures != 0 || dk.KVLenAfter != 305 {
		t.Fatalf("decode meta %+v: want the 192 tokens past 108 received and verified", dk)
	}
	if got := testutil.ToFloat64(p.w.m.prefillTokens) - before; got != 192 {
		t.Fatalf("P's GPU prefilled %v tokens, want the tail's 192", got)
	}
	if got := testutil.ToFloat64(p.w.m.storeLoadTokens); got != 108 {
		t.Fatalf("kvc_sim_store_load_tokens_total %v, want 108", got)
	}
	// The prefix cache's hit rate counts the cache alone: the loaded prefix is neither a hit
	// nor a prompt token it could have served (the seed's 101 and the tail's 192 are).
	if hit, prompt := testutil.ToFloat64(p.w.m.prefillCacheHitTokens), testutil.ToFloat64(p.w.m.prefillPromptTokens); hit != 0 || prompt != 101+192 {
		t.Fatalf("prefix cache hit / prompt tokens %v / %v, want 0 / %d", hit, prompt, 101+192)
	}
	commits, releases := d.sc.snapshotOf()
	if len(releases) != 0 || len(commits) != 2 || commits[1].GetCommittedLen() != 305 {
		t.Fatalf("commits %v releases %v", commits, releases)
	}
	pages := commits[1].GetPages()
	for i, pg := range seedPages {
		if pages[i] != pg {
			t.Fatalf("page %d of the prefix moved from %d to %d", i, pg, pages[i])
		}
	}
	if bad, err := kvpool.CheckContent(d.w.mem, contentKey, (&plan{seedKey: "s1"}).tokenIDs(305), pages, 0, 305); err != nil || bad != 0 {
		t.Fatalf("session KV after the large append: %d bad slots, %v", bad, err)
	}

	// A load that does not verify fails the prefill half.
	h.corruptLoad = true
	pr, _ = pd(t, p, d, "r3", 5, kvcReq{Mode: "PD_FALLBACK", SessionID: "s1", InputTokens: 500, Room: i64(3), Keep: bptr(true),
		LoadPrefix: 305, ReceiveFrom: 305})
	h.corruptLoad = false
	if pr.status != http.StatusInternalServerError || pr.code != "kv_verify_failed" {
		t.Fatalf("corrupted load: P %d %s", pr.status, pr.code)
	}

	// The store has no snapshot of s2: P prefills the whole context.
	pr, dr = pd(t, p, d, "r4", 0, kvcReq{Mode: "SEED", SessionID: "s2", InputTokens: 200, Room: i64(4), LoadPrefix: 100})
	if pr.status != 200 || dr.status != 200 || !pr.ans.MetaInfo.KVC.LoadMiss || pr.ans.MetaInfo.KVC.PrefillTokens != 200 ||
		dr.ans.MetaInfo.KVC.VerifiedBytes != 200*perToken {
		t.Fatalf("load miss: P %d %+v, D %d %s", pr.status, pr.ans.MetaInfo.KVC, dr.status, dr.code)
	}

	// D holding less of the prompt than receive_from, or not the session at all, refuses: the
	// KV would not be whole.
	for _, c := range []struct{ session string }{{"s1"}, {"s9"}} {
		_, dr = pd(t, p, d, "r5-"+c.session, 0, kvcReq{Mode: "PD_FALLBACK", SessionID: c.session, InputTokens: 900, Room: i64(int64(5 + c.session[1])), Keep: bptr(true),
			ReceiveFrom: 800})
		if dr.status != http.StatusConflict || dr.code != "session_not_resident" {
			t.Fatalf("receive_from past the held KV of %s: D %d %s", c.session, dr.status, dr.code)
		}
	}
}

// TestStoreLoadModeledBesideTheRealCopy: the modeled load from the store (the fetch lane's flow
// into this node) is under way while the sidecar copies the pages, so the real copy and check
// are not added to the modeled time (before, the flow joined only after LoadFromStore and the
// check returned: the gate below waited in vain). A load the store cannot serve leaves no flow.
func TestStoreLoadModeledBesideTheRealCopy(t *testing.T) {
	h := newHub()
	tm := DefaultTiming()
	tm.PrefillTokensPerS, tm.PrefillOverhead, tm.DecodePerToken = 1e9, 0, 0
	tm.LinkGbps, tm.ModelBytesPerToken = 1, 4<<20 // 108 loaded tokens: ~3.6 s modeled at 125 MB/s
	tm.Scale = 0.1                                // ~0.36 s of wall time
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, tm)
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	if pr, dr := pd(t, p, d, "r1", 10, kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 101, Room: i64(1)}); pr.status != 200 || dr.status != 200 {
		t.Fatalf("seed: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	flowing := make(chan bool, 1)
	h.mu.Lock()
	h.loadGate = func() {
		deadline := time.Now().Add(5 * time.Second)
		for p.w.inbound.count() == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		flowing <- p.w.inbound.count() > 0
	}
	h.mu.Unlock()
	pr, dr := pd(t, p, d, "r2", 5, kvcReq{Mode: "PD_FALLBACK", SessionID: "s1", InputTokens: 300, Room: i64(2), Keep: bptr(true),
		LoadPrefix: 111, ReceiveFrom: 111})
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("large append from the snapshot: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	if !<-flowing {
		t.Fatal("the modeled load had not started while the sidecar copied the pages")
	}
	if pk := pr.ans.MetaInfo.KVC; pk.LoadedTokens != 108 || pk.FetchMS <= 0 {
		t.Fatalf("prefill meta %+v: want 108 tokens loaded and a modeled fetch", pk)
	}
	// A miss (no snapshot of s2): the flow is withdrawn, the whole context prefilled.
	h.mu.Lock()
	h.loadGate = nil
	h.mu.Unlock()
	pr, _ = pd(t, p, d, "r3", 0, kvcReq{Mode: "SEED", SessionID: "s2", InputTokens: 200, Room: i64(3), LoadPrefix: 100})
	if pr.status != 200 || !pr.ans.MetaInfo.KVC.LoadMiss || pr.ans.MetaInfo.KVC.FetchMS != 0 || p.w.inbound.count() != 0 {
		t.Fatalf("load miss: P %d %+v, inbound flows %d", pr.status, pr.ans.MetaInfo.KVC, p.w.inbound.count())
	}
}

// TestReceiveModeledBesideTheRealCopy: a decode worker's modeled transfer runs beside the real
// work it stands for, not after it: a snapshot's flow is on this node's link while the store's
// push still copies the pages (before, it started only after the copy and the check of every
// received slot, whose wall time — 3.3x at time scale 0.3 — every reseed paid on top); a seed's
// flow starts at the end of the real transfer (the sender starts after P's prefill) beside the
// check; a failed receive withdraws the flow.
func TestReceiveModeledBesideTheRealCopy(t *testing.T) {
	h := newHub()
	tm := DefaultTiming()
	tm.PrefillTokensPerS, tm.PrefillOverhead, tm.DecodePerToken = 1e9, 0, 0
	tm.LinkGbps, tm.ModelBytesPerToken = 1, 4<<20 // 160 received tokens: ~5.4 s modeled at 125 MB/s
	tm.Scale = 0.05                               // ~0.27 s of wall time
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d0 := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, tm)
	d1 := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d1", 4096, tm)
	pr, dr := pd(t, p, d0, "r1", 10, kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 150, Room: i64(1)})
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("seed: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	if k := dr.ans.MetaInfo.KVC; k.TransferModelMS <= 0 || k.VerifiedBytes != 150*48 {
		t.Fatalf("seed meta %+v: want a modeled transfer and every slot verified", k)
	}
	flowing := make(chan bool, 1)
	h.mu.Lock()
	h.pushGate = func() {
		deadline := time.Now().Add(2 * time.Second) // below the hub's 5 s receive wait
		for d1.w.inbound.count() == 0 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		flowing <- d1.w.inbound.count() > 0
	}
	h.mu.Unlock()
	res := post(t, context.Background(), d1.url, body("r2", 3, false,
		kvcReq{Mode: "RESEED_SNAPSHOT", Role: "decode", SessionID: "s1", InputTokens: 170, CachedTokens: 160, Room: i64(2), Seqlen: 160}))
	if res.status != 200 {
		t.Fatalf("reseed: %d %s", res.status, res.code)
	}
	if !<-flowing {
		t.Fatal("the modeled transfer had not started while the store's push copied the pages")
	}
	if k := res.ans.MetaInfo.KVC; k.VerifiedBytes != 160*48 || k.VerifyFailures != 0 || k.TransferModelMS <= 0 || k.TransferMS < k.TransferModelMS {
		t.Fatalf("reseed meta %+v", k)
	}
	// A push that fails (no snapshot of s2): the flow leaves the link, the turn fails.
	h.mu.Lock()
	h.pushGate = nil
	h.mu.Unlock()
	res = post(t, context.Background(), d1.url, body("r3", 3, false,
		kvcReq{Mode: "RESEED_SNAPSHOT", Role: "decode", SessionID: "s2", InputTokens: 170, CachedTokens: 160, Room: i64(3), Seqlen: 160}))
	if res.status == 200 || d1.w.inbound.count() != 0 {
		t.Fatalf("failed reseed: %d %s, inbound flows %d", res.status, res.code, d1.w.inbound.count())
	}
}
