package e2e

import (
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLargeAppendFromSnapshot (issue 20 item 2): a turn with a 9K-token tail on a 16K-token
// session is served by prefill from the snapshot. Real processes — a kvc-controlplane on etcd, a
// prefill sidecar and a decode sidecar; the test plays the workers. The decision is the large
// append on the session's own D with load_prefix_tokens = the snapshot (on its holder) and
// receive_from = what D holds; P's sidecar loads the snapshot's 16K tokens from its store into
// P's pages (every byte checked against the session's known bytes), P "prefills" only the
// tail, and D receives only the tail's pages (the bytes on the wire are the tail's) and then
// holds the whole context, every byte verified.
func TestLargeAppendFromSnapshot(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-controlplane"] == "" {
		t.Fatal("kvc-controlplane binary not available")
	}
	const (
		pages  = 2048 // 32K tokens per pool
		prefix = 16_384
		out    = 16
		tail   = 9_216
	)
	etcd := etcdtest.Start(t)
	lead := leaderOf(t, startCP(t, "cp-f", etcd.Endpoints()))
	if _, err := lead.admin.UpdatePolicy(ctxT(t, 5*time.Second), &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{
		// Local large appends off: this is the large append that P prefills from the snapshot.
		SnapshotDeltaTokens: ptr(int64(256)), LocalAppendMaxTokens: ptr(int64(0))}}); err != nil {
		t.Fatal(err)
	}
	p0 := startSidecar(t, "prefill", "p0", lead.addr, "--store-capacity-bytes", itoa(pages*2*numLayers*itemLen))
	d := &dworker{sc: startSidecar(t, "decode", "d1", lead.addr), pages: map[string][]int64{}}
	pw := newWorker(t, p0, 2*pages) // the seed's pages stay allocated: the turn-1 prefill takes others
	d.w = newWorker(t, d.sc, pages)
	waitFor(t, "two ready workers", 20*time.Second, func() bool {
		r, err := lead.admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
		n := 0
		for _, w := range r.GetWorkers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return err == nil && n == 2
	})
	rt := newRouter(t, lead.addr)
	session := func() *kvcv1.SessionRecord {
		r, err := lead.admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: "S"})
		if err != nil {
			return nil
		}
		return r.GetSession()
	}
	seed := kvpool.SessionSeed("S")

	// Turn 0: a 16K-token seed, 16 decoded; D's push makes the snapshot on p0.
	dec := rt.query(t, "S", 0, prefix, out)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("turn 0: %s (%s)", dec.GetMode(), dec.GetReason())
	}
	seedPages := pw.alloc(prefix/pageSize, 1)
	if err := kvpool.FillTokens(pw.pool, seed, seedPages, 0, prefix); err != nil {
		t.Fatal(err)
	}
	if res := d.receive(t, "S", dec, kvcv1.TransferKind_TRANSFER_KIND_SEED, prefix, func() {
		if _, err := p0.bridge.SendKV(ctxT(t, 20*time.Second), &kvcv1.SendKVRequest{Room: dec.GetBootstrapRoom(), SessionId: "S",
			Pages: seedPages, Last: true, Tokens: prefix}); err != nil {
			t.Fatal(err)
		}
	}); !res.GetOk() {
		t.Fatalf("seed: %v", res)
	}
	L := int64(prefix + out)
	d.compute(t, "S", prefix, L)
	rt.outcome(t, dec, L)
	gen := session().GetGeneration()
	waitFor(t, "S's snapshot on p0", 30*time.Second, func() bool {
		sn := session().GetSnapshot()
		return sn.GetSeqlen() == L && sn.GetGeneration() == gen && sn.GetPrefillWorker() == "p0"
	})

	// Turn 1: a 9K-token tail, over the direct limit: the large append from the snapshot.
	input := L + tail
	dec = rt.query(t, "S", 1, input, out)
	e := dec.GetExecution()
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || dec.GetReason() != kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND ||
		dec.GetPrefill().GetWorkerId() != "p0" || dec.GetDecode().GetWorkerId() != "d1" {
		t.Fatalf("turn 1: %s (%s) on %s/%s", dec.GetMode(), dec.GetReason(), dec.GetPrefill().GetWorkerId(), dec.GetDecode().GetWorkerId())
	}
	if e.GetLoadPrefixTokens() != L || e.GetLoadGeneration() != gen || e.GetReceiveFrom() != L || !e.GetKeepSession() {
		t.Fatalf("turn 1's plan %v: want load_prefix_tokens %d of generation %d, receive_from %d", e, L, gen, L)
	}
	// P: load [0, L) from the store into fresh pages (other pages than the seed's), verify it,
	// "prefill" only the tail.
	ppages := pw.alloc(int((input+pageSize-1)/pageSize), 1)
	load, err := p0.bridge.LoadFromStore(ctxT(t, 20*time.Second), &kvcv1.LoadFromStoreRequest{SessionId: "S",
		Generation: e.GetLoadGeneration(), Tokens: e.GetLoadPrefixTokens(), Pages: ppages[:L/pageSize]})
	if err != nil {
		t.Fatal(err)
	}
	if load.GetTokens() != L || load.GetBytes() != L*bpt || load.GetGeneration() != gen {
		t.Fatalf("load %v: want %d tokens, %d bytes", load, L, L*bpt)
	}
	if bad, err := kvpool.CheckTokens(pw.pool, seed, ppages, 0, L); err != nil || bad != 0 {
		t.Fatalf("the loaded prefix: %d tokens wrong (%v)", bad, err)
	}
	if err := kvpool.FillTokens(pw.pool, seed, ppages, L, input); err != nil { // the tail's prefill
		t.Fatal(err)
	}
	// D keeps [0, L) and receives the rest: P sends from page L/pageSize on.
	held := append([]int64(nil), d.pages["S"]...)
	dpages := d.pagesFor("S", input)
	from := e.GetReceiveFrom() / pageSize
	if _, err := d.sc.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: dec.GetBootstrapRoom(), SessionId: "S",
		Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Pages: dpages, Tokens: input, SourcePeerAddr: dec.GetPrefill().GetPeerAddr()}); err != nil {
		t.Fatal(err)
	}
	sent, err := p0.bridge.SendKV(ctxT(t, 20*time.Second), &kvcv1.SendKVRequest{Room: dec.GetBootstrapRoom(), SessionId: "S",
		Pages: ppages[from:], FirstPage: from, Last: true, Tokens: input})
	if err != nil {
		t.Fatal(err)
	}
	res, err := d.sc.bridge.WaitReceive(ctxT(t, 20*time.Second), &kvcv1.WaitReceiveRequest{Room: dec.GetBootstrapRoom(), TimeoutMs: 15000})
	if err != nil || !res.GetOk() {
		t.Fatalf("suffix receive: %v %v", res, err)
	}
	if want := tail * int64(bpt); sent.GetBytes() != want || res.GetBytes() != want {
		t.Fatalf("bytes on the wire: sent %d, received %d; want the tail's %d", sent.GetBytes(), res.GetBytes(), want)
	}
	for i, pg := range held {
		if dpages[i] != pg {
			t.Fatalf("D's page %d of the held prefix moved", i)
		}
	}
	if bad, err := kvpool.CheckTokens(d.w.pool, seed, dpages, 0, input); err != nil || bad != 0 {
		t.Fatalf("D's session after the suffix receive: %d tokens wrong (%v)", bad, err)
	}
	d.compute(t, "S", input, input+out)
	rt.outcome(t, dec, input+out)
	waitFor(t, "S committed at the new length", 10*time.Second, func() bool {
		s := session()
		return s.GetKvCommittedLen() == input+out && s.GetDecodeWorker() == "d1"
	})
	if n := len(filterEvents(readEvents(t, p0.events), sidecar.EvStoreLoad, "S")); n != 1 {
		t.Fatalf("%d snapshot_store_load events of S, want 1", n)
	}
}
