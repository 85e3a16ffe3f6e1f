package seede2e

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/launch"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// waitFor polls cond (another process's state) until it holds or d passes.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	launch.WaitForT(t, what, d, 10*time.Millisecond, cond)
}

// TestSeedThroughStoreWithControlPlane: the whole control path of a SEED through the prefill
// store, with real processes — a kvc-controlplane (embedded etcd) with seed_through_store on, a
// prefill and a decode sidecar connected to it; the test plays the gateway (the Route stream)
// and both workers. The decision names the store generation and a load room; P's seed lands in
// its store and the control plane records it as the session's snapshot; D loads a page-aligned
// prefix from the store, prefills the rest and decodes; after the outcome D's snapshot target is
// P with the seed as valid base, so D's first push is the append of its new tokens onto the
// seed's snapshot, not the whole session.
func TestSeedThroughStoreWithControlPlane(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	ready := startProc(t, "cp", bins["kvc-controlplane"], "--node-id", "cp0", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--data-dir", filepath.Join(t.TempDir(), "etcd"), "--embedded-etcd-client-addr", "127.0.0.1:0", "--embedded-etcd-peer-addr", "127.0.0.1:0",
		"--flush-delay", "20ms", "--insecure")
	cpAddr, _ := ready["grpc_addr"].(string)
	conn, err := grpc.NewClient(cpAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	admin := kvcv1.NewAdminServiceClient(conn)
	waitFor(t, "the control plane leading", 30*time.Second, func() bool {
		r, err := admin.GetLeader(ctxT(t, time.Second), &kvcv1.GetLeaderRequest{})
		return err == nil && r.GetResponderIsLeader()
	})
	const delta = 16
	if _, err := admin.UpdatePolicy(ctxT(t, 5*time.Second), &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{
		SeedThroughStore: proto.Bool(true), SnapshotDeltaTokens: proto.Int64(delta)}}); err != nil {
		t.Fatal(err)
	}
	p0 := startSidecar(t, "prefill", "p0", "--control-plane", cpAddr, "--store-capacity-bytes", fmt.Sprint(256*2*numLayers*itemLen))
	d1 := startSidecar(t, "decode", "d1", "--control-plane", cpAddr)
	pw, dw := newPool(t, p0, 64), newPool(t, d1, 64)
	waitFor(t, "two ready workers", 20*time.Second, func() bool {
		r, err := admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
		n := 0
		for _, w := range r.GetWorkers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return err == nil && n == 2
	})
	session := func() *kvcv1.SessionRecord {
		r, err := admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: "S"})
		if err != nil {
			return nil
		}
		return r.GetSession()
	}

	// The gateway's query: a new session's SEED through the store.
	rctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	rs, err := kvcv1.NewRouterServiceClient(conn).Route(rctx)
	if err != nil {
		t.Fatal(err)
	}
	const input, out = 100, 32
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{RequestId: "q0", SessionId: "S",
		InputTokens: input, MaxOutputTokens: out, MultiturnHint: true}}}); err != nil {
		t.Fatal(err)
	}
	m, err := rs.Recv()
	if err != nil {
		t.Fatal(err)
	}
	dec := m.GetDecision()
	ex := dec.GetExecution()
	gen := ex.GetStoreGeneration() // the generation the session takes with this seed (the leader's term's first)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED || gen == 0 || ex.GetStoreLoadRoom() == 0 ||
		ex.GetStoreLoadRoom() == dec.GetBootstrapRoom() || dec.GetPrefill().GetWorkerId() != "p0" || dec.GetDecode().GetWorkerId() != "d1" {
		t.Fatalf("decision %v", dec)
	}

	// P: the prompt's KV, two chunks into its own store.
	ppages := seq(10, 7, 1)
	if err := kvpool.FillTokens(pw, kvpool.SessionSeed("S"), ppages, 0, input); err != nil {
		t.Fatal(err)
	}
	for i, c := range [][]int64{ppages[:3], ppages[3:]} {
		if _, err := p0.bridge.SendKV(ctxT(t, 10*time.Second), &kvcv1.SendKVRequest{Room: dec.GetBootstrapRoom(), SessionId: "S", Pages: c,
			FirstPage: int64(3 * i), Last: i == 1, Tokens: input, Generation: gen, ToStore: true}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the seed as the session's snapshot", 10*time.Second, func() bool {
		sn := session().GetSnapshot()
		return sn.GetPrefillWorker() == "p0" && sn.GetSeqlen() == input && sn.GetGeneration() == gen
	})

	// D (after P answered): loads 6 whole pages from the store in the load room, prefills the
	// rest of the prompt itself, decodes, commits.
	const load = (input - 1) / pageSize * pageSize
	dpages := seq(20, 9, 1)
	if _, err := d1.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: ex.GetStoreLoadRoom(), SessionId: "S",
		Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Pages: dpages[:load/pageSize], Tokens: load, SourcePeerAddr: dec.GetPrefill().GetPeerAddr()}); err != nil {
		t.Fatal(err)
	}
	w, err := d1.bridge.WaitReceive(ctxT(t, 20*time.Second), &kvcv1.WaitReceiveRequest{Room: ex.GetStoreLoadRoom(), TimeoutMs: 15000})
	if err != nil || !w.GetOk() || w.GetBytes() != load*bpt {
		t.Fatalf("load: %v %v", w, err)
	}
	if bad, err := kvpool.CheckTokens(dw, kvpool.SessionSeed("S"), dpages, 0, load); err != nil || bad != 0 {
		t.Fatalf("D after the load: %d tokens wrong (%v)", bad, err)
	}
	const L = input + out
	if err := kvpool.FillTokens(dw, kvpool.SessionSeed("S"), dpages, load, L); err != nil {
		t.Fatal(err)
	}
	// The commit carries the session's token ids: the store's entry (P's seed, pushed without
	// ids) takes them with D's first push, an append that sends them from token 0.
	ids := make([]int32, L)
	for i := range ids {
		ids[i] = int32(90000 + i)
	}
	if _, err := d1.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: "S", CommittedLen: L, Pages: dpages, TokenIds: ids}); err != nil {
		t.Fatal(err)
	}
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{DecisionId: dec.GetDecisionId(),
		Success: true, KvLenAfter: L, ExecutedMode: dec.GetMode(), TtftUs: 1000, LatencyUs: 2000}}}); err != nil {
		t.Fatal(err)
	}
	if m, err := rs.Recv(); err != nil || m.GetOutcomeAck().GetDecisionId() != dec.GetDecisionId() {
		t.Fatalf("outcome ack %v %v", m, err)
	}

	// D's first push: the append [input, L) onto the seed's snapshot, of the same generation.
	waitFor(t, "the snapshot at L", 10*time.Second, func() bool {
		sn := session().GetSnapshot()
		return sn.GetPrefillWorker() == "p0" && sn.GetSeqlen() == L && sn.GetGeneration() == gen
	})
	pushes := events(t, d1.events, sidecar.EvPushSent, "S")
	if len(pushes) != 1 {
		t.Fatalf("pushes: %+v", pushes)
	}
	if p := pushes[0]; p.BaseLen != input || p.Tokens != out || p.Generation != gen || p.Bytes != out*bpt || p.RetagFrom != 0 {
		t.Fatalf("first push: base %d tokens %d generation %d bytes %d retag %d; want the %d-token append (%d bytes, a full push: %d)",
			p.BaseLen, p.Tokens, p.Generation, p.Bytes, p.RetagFrom, out, out*bpt, L*bpt)
	}
	st, err := p0.bridge.SnapshotStatus(ctxT(t, time.Second), &kvcv1.SnapshotStatusRequest{SessionId: "S"})
	if err != nil || st.GetSeqlen() != L || st.GetGeneration() != gen {
		t.Fatalf("store: %v %v", st, err)
	}
	if rec := session(); rec.GetDecodeWorker() != "d1" || rec.GetGeneration() != gen {
		t.Fatalf("session %v", rec)
	}
	pconn, err := grpc.NewClient(p0.str("peer_addr"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pconn.Close() })
	tok, err := kvcv1.NewTransferPeerServiceClient(pconn).SnapshotTokens(ctxT(t, 5*time.Second),
		&kvcv1.SnapshotTokensRequest{SessionId: "S", Generation: gen, Seqlen: L})
	if err != nil || !slices.Equal(tok.GetTokenIds(), ids) {
		t.Fatalf("the store's ids after D's append onto P's seed: %d of %d (%v)", len(tok.GetTokenIds()), L, err)
	}
	t.Logf("first push after a store seed: %d bytes (the %d-token append) instead of %d (the whole %d-token session)", pushes[0].Bytes, out, L*bpt, L)
}
