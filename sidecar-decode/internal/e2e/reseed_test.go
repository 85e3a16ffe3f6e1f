package e2e

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestReseedNoFullRepush (issue 15 item 3): after a RESEED_SNAPSHOT the new decode worker holds
// exactly what the store holds. The control plane names its snapshot target with that valid
// base, so its first push is an append of the tail that re-tags the store's entry to the new
// generation: the bytes on the wire are the append's, not the session's. The re-tagged entry
// equals D′'s KV byte for byte and serves the next reseed. Real processes: a kvc-controlplane
// on etcd, a prefill sidecar and two decode sidecars; the test plays the workers.
func TestReseedNoFullRepush(t *testing.T) {
	f := startReseedFixture(t)
	rt, p0, byID, session, waitSnapshot, pushes := f.rt, f.p0, f.byID, f.session, f.waitSnapshot, f.pushes
	const out = 16
	dA, L, gen1 := f.seedTurn0(out)

	// D releases S; turn 1 (an append of 100 tokens) reseeds from the snapshot onto D′.
	dA.release(t, "S")
	waitFor(t, "S not resident", 10*time.Second, func() bool { return session().GetDecodeWorker() == "" })
	const appendTok = 100
	dec := rt.query(t, "S", 1, L+appendTok, out)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || dec.GetSnapshotSeqlen() != L {
		t.Fatalf("turn 1: %s (%s), snapshot_seqlen %d", dec.GetMode(), dec.GetReason(), dec.GetSnapshotSeqlen())
	}
	dB := byID[dec.GetDecode().GetWorkerId()]
	before := len(pushes(dB))
	if res := dB.receive(t, "S", dec, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, L, nil); !res.GetOk() || res.GetBytes() != L*bpt {
		t.Fatalf("snapshot reseed: %v", res)
	}
	L2 := L + appendTok + out
	dB.compute(t, "S", L, L2) // D′ append-prefills the tail and decodes
	rt.outcome(t, dec, L2)
	gen2 := gen1 + 1 // the same leader: the next generation of its term
	if g := session().GetGeneration(); g != gen2 {
		t.Fatalf("generation after the reseed %d, want %d", g, gen2)
	}

	// The next push is the append [L, L2), tagged to re-tag the seed generation's entry as the
	// reseed's.
	waitSnapshot(L2, gen2)
	// the control plane hears of the snapshot from the store (the prefill sidecar), which may
	// be before the decode sidecar has logged its push and the store its ingest: wait for both
	waitFor(t, "D′'s push event", 10*time.Second, func() bool { return len(pushes(dB)) > before })
	waitFor(t, "the store's ingest event", 10*time.Second, func() bool {
		for _, e := range filterEvents(readEvents(t, p0.events), sidecar.EvRecvIngested, "S") {
			if e.Generation == gen2 {
				return true
			}
		}
		return false
	})
	sent := pushes(dB)[before:]
	if len(sent) != 1 {
		t.Fatalf("pushes after the reseed: %+v", sent)
	}
	p := sent[0]
	appendBytes, fullBytes := int64(L2-L)*bpt, int64(L2)*bpt
	if p.BaseLen != L || p.Tokens != L2-L || p.Generation != gen2 || p.Bytes != appendBytes || p.RetagFrom != gen1 {
		t.Fatalf("push after the reseed: base %d tokens %d generation %d bytes %d; want base %d tokens %d bytes %d (a full push: %d)",
			p.BaseLen, p.Tokens, p.Generation, p.Bytes, L, L2-L, appendBytes, fullBytes)
	}
	for _, e := range filterEvents(readEvents(t, dB.sc.events), sidecar.EvPushFailed, "S") {
		t.Fatalf("a push failed after the reseed (the re-tag was refused?): %+v", e)
	}
	ing := filterEvents(readEvents(t, p0.events), sidecar.EvRecvIngested, "S")
	if last := ing[len(ing)-1]; last.BaseLen != L || last.Tokens != L2-L || last.Generation != gen2 || last.Seqlen != L2 {
		t.Fatalf("store ingest after the reseed: %+v", last)
	}
	st := snapshotStatus(t, p0, "S")
	if !st.Exists || st.Seqlen != L2 || st.Generation != gen2 {
		t.Fatalf("store after the re-tag: %+v", st)
	}
	if got, want := snapshotKV(t, p0, "S"), kvBytes(dB.w, dB.pages["S"], L2); !bytes.Equal(got, want) {
		t.Fatalf("re-tagged snapshot differs from D′'s KV (%d vs %d bytes)", len(got), len(want))
	}
	// the decode sidecar's metrics count the re-tag and the bytes it did not send again
	_, metrics := httpText(t, "http://"+dB.sc.httpAddr+"/metrics")
	for _, want := range []string{"kvc_snapshot_retag_pushes_total 1\n", fmt.Sprintf("kvc_snapshot_retag_saved_bytes_total %g\n", float64(L*bpt))} {
		if !strings.Contains(metrics, want) {
			t.Fatalf("metrics without %q", want)
		}
	}
	t.Logf("push after a snapshot reseed: %d bytes on the wire (the %d-token append) instead of %d (the whole %d-token session): %d bytes (%.1f%%) saved",
		p.Bytes, L2-L, fullBytes, L2, fullBytes-p.Bytes, 100*float64(fullBytes-p.Bytes)/float64(fullBytes))

	// The re-tagged snapshot serves the next reseed (D′ lost the session).
	dB.release(t, "S")
	waitFor(t, "S not resident", 10*time.Second, func() bool { return session().GetDecodeWorker() == "" })
	dec = rt.query(t, "S", 2, L2+appendTok, out)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || dec.GetSnapshotSeqlen() != L2 {
		t.Fatalf("turn 2: %s (%s), snapshot_seqlen %d", dec.GetMode(), dec.GetReason(), dec.GetSnapshotSeqlen())
	}
	dC := byID[dec.GetDecode().GetWorkerId()]
	if res := dC.receive(t, "S", dec, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, L2, nil); !res.GetOk() {
		t.Fatalf("reseed from the re-tagged snapshot: %v", res)
	}
}

// TestReseedPrefixCutBack: a reseed that uses only a prefix of the snapshot (the new turn is
// shorter than the session's KV: a shrunken or edited context) leaves D′ holding [0, input) of a
// longer entry. D′'s first push re-tags that entry from base input: the store cuts the entry
// back to input and appends the tail, so the bytes on the wire are the tail's, not the
// session's. D′'s tail differs from the old entry's bytes past input (another seed), so the
// store's entry equals D′'s KV byte for byte only if the append overwrote them; the re-tagged
// snapshot then serves the next reseed.
func TestReseedPrefixCutBack(t *testing.T) {
	f := startReseedFixture(t)
	rt, p0, byID, session, waitSnapshot, pushes := f.rt, f.p0, f.byID, f.session, f.waitSnapshot, f.pushes
	dA, L, gen1 := f.seedTurn0(16)

	// D releases S; turn 1's prompt is 300 tokens shorter than the KV (mid-page: 3,716 = 232
	// pages + 4): the reseed writes the snapshot's prefix [0, input1) onto D′, which decodes 40
	// tokens of its own (another seed: they differ from the entry's bytes there).
	dA.release(t, "S")
	waitFor(t, "S not resident", 10*time.Second, func() bool { return session().GetDecodeWorker() == "" })
	input1, out1 := L-300, int64(40)
	dec := rt.query(t, "S", 1, input1, out1)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || dec.GetSnapshotSeqlen() != input1 {
		t.Fatalf("turn 1: %s (%s), snapshot_seqlen %d", dec.GetMode(), dec.GetReason(), dec.GetSnapshotSeqlen())
	}
	dB := byID[dec.GetDecode().GetWorkerId()]
	before := len(pushes(dB))
	if res := dB.receive(t, "S", dec, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, input1, nil); !res.GetOk() || res.GetBytes() != input1*bpt {
		t.Fatalf("snapshot reseed of the prefix: %v", res)
	}
	L2 := input1 + out1
	pages := dB.pagesFor("S", L2)
	if err := kvpool.FillTokens(dB.w.pool, kvpool.SessionSeed("S/edited"), pages, input1, L2); err != nil {
		t.Fatal(err)
	}
	if _, err := dB.sc.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: "S", CommittedLen: L2, Pages: pages}); err != nil {
		t.Fatal(err)
	}
	rt.outcome(t, dec, L2)
	gen2 := session().GetGeneration()
	if gen2 <= gen1 {
		t.Fatalf("generation after the reseed %d, want > %d", gen2, gen1)
	}

	// The next push appends [input1, L2) re-tagging generation 1's entry, which the store cuts
	// back to input1 first.
	waitSnapshot(L2, gen2)
	waitFor(t, "D′'s push event", 10*time.Second, func() bool { return len(pushes(dB)) > before })
	waitFor(t, "the store's ingest event", 10*time.Second, func() bool {
		for _, e := range filterEvents(readEvents(t, p0.events), sidecar.EvRecvIngested, "S") {
			if e.Generation == gen2 {
				return true
			}
		}
		return false
	})
	sent := pushes(dB)[before:]
	if len(sent) != 1 {
		t.Fatalf("pushes after the reseed: %+v", sent)
	}
	p := sent[0]
	tailBytes, fullBytes := int64(L2-input1)*bpt, int64(L2)*bpt
	if p.BaseLen != input1 || p.Tokens != L2-input1 || p.Generation != gen2 || p.Bytes != tailBytes || p.RetagFrom != gen1 {
		t.Fatalf("push after the prefix reseed: base %d tokens %d generation %d bytes %d retag_from %d; want base %d tokens %d bytes %d retag_from %d (a full push: %d bytes)",
			p.BaseLen, p.Tokens, p.Generation, p.Bytes, p.RetagFrom, input1, L2-input1, tailBytes, gen1, fullBytes)
	}
	for _, e := range filterEvents(readEvents(t, dB.sc.events), sidecar.EvPushFailed, "S") {
		t.Fatalf("a push failed after the reseed (the re-tag was refused?): %+v", e)
	}
	cuts := filterEvents(readEvents(t, p0.events), sidecar.EvCutBack, "S")
	if len(cuts) != 1 || cuts[0].BaseLen != L || cuts[0].Seqlen != input1 || cuts[0].Generation != gen1 {
		t.Fatalf("cut back events %+v, want one from %d to %d of generation %d", cuts, L, input1, gen1)
	}
	ing := filterEvents(readEvents(t, p0.events), sidecar.EvRecvIngested, "S")
	if last := ing[len(ing)-1]; last.BaseLen != input1 || last.Tokens != L2-input1 || last.Generation != gen2 || last.Seqlen != L2 {
		t.Fatalf("store ingest after the reseed: %+v", last)
	}
	st := snapshotStatus(t, p0, "S")
	if !st.Exists || st.Seqlen != L2 || st.Generation != gen2 {
		t.Fatalf("store after the cut back and re-tag: %+v", st)
	}
	kvB := kvBytes(dB.w, dB.pages["S"], L2)
	if got := snapshotKV(t, p0, "S"); !bytes.Equal(got, kvB) {
		t.Fatalf("re-tagged snapshot differs from D′'s KV (%d vs %d bytes)", len(got), len(kvB))
	}
	t.Logf("push after a prefix reseed (%d of the snapshot's %d tokens): %d bytes on the wire (the %d-token tail) instead of %d (the whole %d-token session)",
		input1, L, p.Bytes, L2-input1, fullBytes, L2)

	// The cut and re-tagged snapshot serves the next reseed (D′ lost the session).
	dB.release(t, "S")
	waitFor(t, "S not resident", 10*time.Second, func() bool { return session().GetDecodeWorker() == "" })
	dec = rt.query(t, "S", 2, L2+100, 16)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || dec.GetSnapshotSeqlen() != L2 {
		t.Fatalf("turn 2: %s (%s), snapshot_seqlen %d", dec.GetMode(), dec.GetReason(), dec.GetSnapshotSeqlen())
	}
	dC := byID[dec.GetDecode().GetWorkerId()]
	if res := dC.receiveRaw(t, "S", dec, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, L2, nil); !res.GetOk() {
		t.Fatalf("reseed from the cut and re-tagged snapshot: %v", res)
	}
	if got := kvBytes(dC.w, dC.pages["S"], L2); !bytes.Equal(got, kvB) {
		t.Fatal("the reseed from the re-tagged snapshot differs from D′'s KV")
	}
}

// reseedFixture: a kvc-controlplane on etcd (snapshot delta 256 tokens, tail tolerance 512), a
// prefill sidecar p0 with its store and two decode sidecars d1, d2, each with a test worker;
// session "S" is the one the reseed tests move around.
type reseedFixture struct {
	t    *testing.T
	lead *cpProc
	rt   *router
	p0   *sidecarProc
	pw   *worker
	byID map[string]*dworker
}

func startReseedFixture(t *testing.T) *reseedFixture {
	t.Helper()
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-controlplane"] == "" {
		t.Fatal("kvc-controlplane binary not available")
	}
	etcd := etcdtest.Start(t)
	lead := leaderOf(t, startCP(t, "cp-r", etcd.Endpoints()))
	if _, err := lead.admin.UpdatePolicy(ctxT(t, 5*time.Second), &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{
		SnapshotDeltaTokens: ptr(int64(256)), TailToleranceTokens: ptr(int64(512))}}); err != nil {
		t.Fatal(err)
	}
	p0 := startSidecar(t, "prefill", "p0", lead.addr, "--store-capacity-bytes", itoa(1024*2*numLayers*itemLen))
	d1 := &dworker{sc: startSidecar(t, "decode", "d1", lead.addr), pages: map[string][]int64{}}
	d2 := &dworker{sc: startSidecar(t, "decode", "d2", lead.addr), pages: map[string][]int64{}}
	f := &reseedFixture{t: t, lead: lead, p0: p0, pw: newWorker(t, p0, 1024), byID: map[string]*dworker{"d1": d1, "d2": d2}}
	d1.w, d2.w = newWorker(t, d1.sc, 1024), newWorker(t, d2.sc, 1024)
	waitFor(t, "three ready workers", 20*time.Second, func() bool {
		r, err := lead.admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
		n := 0
		for _, w := range r.GetWorkers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return err == nil && n == 3
	})
	f.rt = newRouter(t, lead.addr)
	return f
}

// session is S's record on the control plane (nil when it has none).
func (f *reseedFixture) session() *kvcv1.SessionRecord {
	r, err := f.lead.admin.GetSession(ctxT(f.t, time.Second), &kvcv1.GetSessionRequest{SessionId: "S"})
	if err != nil {
		return nil
	}
	return r.GetSession()
}

// waitSnapshot waits until the control plane records S's snapshot on p0 at seqlen, generation gen.
func (f *reseedFixture) waitSnapshot(seqlen int64, gen uint64) {
	f.t.Helper()
	waitFor(f.t, fmt.Sprintf("snapshot of S at %d, generation %d", seqlen, gen), 20*time.Second, func() bool {
		sn := f.session().GetSnapshot()
		return sn.GetSeqlen() == seqlen && sn.GetGeneration() == gen && sn.GetPrefillWorker() == "p0"
	})
}

// pushes are d's D->P pushes of S logged as sent.
func (f *reseedFixture) pushes(d *dworker) []sidecar.Event {
	return filterEvents(readEvents(f.t, d.sc.events), sidecar.EvPushSent, "S")
}

// seedTurn0 runs S's turn 0 (a SEED of 4,000 tokens, out decoded on some D), waits for its
// full push to make the snapshot and has D release S; it returns that D, the session's length
// L and its generation (the first of the leader's generation term, not 1: docs/decisions.md).
func (f *reseedFixture) seedTurn0(out int64) (*dworker, int64, uint64) {
	t := f.t
	t.Helper()
	const input0 = 4000
	dec := f.rt.query(t, "S", 0, input0, out)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("turn 0: %s (%s)", dec.GetMode(), dec.GetReason())
	}
	dA := f.byID[dec.GetDecode().GetWorkerId()]
	ppages := f.pw.alloc(int((input0+pageSize-1)/pageSize), 1)
	if err := kvpool.FillTokens(f.pw.pool, kvpool.SessionSeed("S"), ppages, 0, input0); err != nil {
		t.Fatal(err)
	}
	if res := dA.receive(t, "S", dec, kvcv1.TransferKind_TRANSFER_KIND_SEED, input0, func() {
		if _, err := f.p0.bridge.SendKV(ctxT(t, 10*time.Second), &kvcv1.SendKVRequest{Room: dec.GetBootstrapRoom(), SessionId: "S",
			Pages: ppages, Last: true, Tokens: input0}); err != nil {
			t.Fatal(err)
		}
	}); !res.GetOk() {
		t.Fatalf("seed: %v", res)
	}
	dA.compute(t, "S", input0, input0+out)
	f.rt.outcome(t, dec, input0+out)
	L := int64(input0) + out
	gen := f.session().GetGeneration()
	if gen == 0 {
		t.Fatal("no generation after the seed")
	}
	f.waitSnapshot(L, gen)
	return dA, L, gen
}
