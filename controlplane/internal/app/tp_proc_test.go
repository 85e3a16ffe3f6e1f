package app

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// startRank runs rank rank of size of the tensor-parallel worker group: a sidecar with
// --tp-group and a kvc-sim registering its pool as that rank (its KV is the rank's own shard).
func startRank(t *testing.T, bins map[string]string, role, group, cp string, rank, size int, sidecarArgs ...string) *simNode {
	t.Helper()
	id := fmt.Sprintf("%s%d", group, rank)
	dir := t.TempDir()
	sock := filepath.Join(dir, "bridge.sock")
	args := append([]string{"--worker-id", id, "--bridge-socket", sock, "--transport", "tcp", "--transfer-conns", "2",
		"--heartbeat", "100ms", "--control-plane", cp, "--insecure", "--log-level", "debug", "--tp-group", group}, sidecarArgs...)
	sc := startProc(t, id, bins["kvc-sidecar-"+role], args...)
	sim := startProc(t, "sim-"+id, bins["kvc-sim"], "--role", role, "--worker-id", id, "--bridge-socket", sock,
		"--http-addr", "127.0.0.1:0", "--kv-capacity-tokens", "8192", "--page-size", "16", "--layers", "4",
		"--bytes-per-token-per-buffer", "64", "--time-scale", "0.01", "--shm-dir", t.TempDir(), "--log-level", "debug", "--bridge-wait", "30s",
		"--tp-rank", strconv.Itoa(rank), "--tp-size", strconv.Itoa(size))
	return &simNode{sidecar: sc, sim: sim, url: "http://" + sim.str("http_addr")}
}

// kvcMeta is what a kvc-sim answer says about the KV it received.
type kvcMeta struct {
	KVLenAfter     int64 `json:"kv_len_after"`
	ReceivedBytes  int64 `json:"received_bytes"`
	VerifiedBytes  int64 `json:"verified_bytes"`
	VerifyFailures int64 `json:"verify_failures"`
}

// generate posts a /generate with the decision's payload in SGLang's kv_hints envelope, as the
// gateway does, and returns the status, the body and the answer's kvc meta.
func generate(url, rid string, maxNew int, payload *kvcv1.ExecutionPayload) (int, string, kvcMeta) {
	env, err := kvhints.Build(rid, payload)
	if err != nil {
		return 0, err.Error(), kvcMeta{}
	}
	body := map[string]any{"rid": rid, "stream": false, "sampling_params": map[string]any{"max_new_tokens": maxNew}, "kv_hints": env}
	if s := payload.GetSend(); s != nil {
		body["bootstrap_room"] = s.GetRoom()
	}
	if payload.GetKeepSession() {
		body["session_params"] = map[string]any{"id": payload.GetSessionId()} // the session's streaming session on D
	}
	code, out, err := postJSON(url+"/generate", body)
	if err != nil {
		return 0, err.Error(), kvcMeta{}
	}
	var ans struct {
		MetaInfo struct {
			KVC kvcMeta `json:"kvc"`
		} `json:"meta_info"`
	}
	_ = json.Unmarshal([]byte(out), &ans)
	return code, out, ans.MetaInfo.KVC
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v: %s", url, err, b)
	}
}

// decodeTargets is what each decode rank's sidecar says its session pushes to.
func decodeTarget(t *testing.T, n *simNode, session string) (prefill string, pushed int64) {
	t.Helper()
	var ss []struct {
		SessionID     string `json:"session_id"`
		PrefillWorker string `json:"prefill_worker"`
		LastPushedLen int64  `json:"last_pushed_len"`
	}
	getJSON(t, "http://"+n.sidecar.str("http_addr")+"/v1/sessions", &ss)
	for _, s := range ss {
		if s.SessionID == session {
			return s.PrefillWorker, s.LastPushedLen
		}
	}
	return "", 0
}

// route asks the leader for one decision on a Route stream.
func route(t *testing.T, rs kvcv1.RouterService_RouteClient, q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
	t.Helper()
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: q}}); err != nil {
		t.Fatal(err)
	}
	m, err := rs.Recv()
	if err != nil || m.GetDecision() == nil {
		t.Fatalf("query %s: %v %v", q.GetRequestId(), m, err)
	}
	return m.GetDecision()
}

func reportOutcome(t *testing.T, rs kvcv1.RouterService_RouteClient, d *kvcv1.RouteDecision, kvLen int64) {
	t.Helper()
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
		DecisionId: d.GetDecisionId(), Success: true, ErrorKind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE,
		TtftUs: 1000, LatencyUs: 2000, KvLenAfter: kvLen, ExecutedMode: d.GetMode()}}}); err != nil {
		t.Fatal(err)
	}
	if m, err := rs.Recv(); err != nil || m.GetOutcomeAck().GetDecisionId() != d.GetDecisionId() {
		t.Fatalf("outcome ack: %v %v", m, err)
	}
}

// execRanks carries a decision out the way the gateway and SGLang do with tensor parallelism:
// every rank of a worker gets the same request (SGLang's scheduler broadcasts it to its ranks),
// each rank of D takes the prefill rank of its own index from prefill_peer_addrs. It returns
// each decode rank's kvc meta.
func execRanks(t *testing.T, d *kvcv1.RouteDecision, session string, input int64, pRanks, dRanks []*simNode) []kvcMeta {
	t.Helper()
	var peers []string
	for _, r := range d.GetPrefill().GetTpRanks() {
		peers = append(peers, r.GetPeerAddr())
	}
	e := d.GetExecution()
	base := func(role kvcv1.WorkerRole) *kvcv1.ExecutionPayload {
		return &kvcv1.ExecutionPayload{Mode: d.GetMode(), Role: role, SessionId: session, InputTokens: input,
			DecisionId: d.GetDecisionId(), CachedTokens: d.GetCachedTokens()}
	}
	var wg sync.WaitGroup
	errs := make(chan string, 2*len(dRanks))
	metas := make([]kvcMeta, len(dRanks))
	for r := range dRanks {
		if d.GetExecution().GetCallPrefill() {
			wg.Add(1)
			go func() {
				defer wg.Done()
				pl := base(kvcv1.WorkerRole_WORKER_ROLE_PREFILL)
				pl.Send = &kvcv1.ExecutionSend{Room: d.GetBootstrapRoom()}
				if code, body, _ := generate(pRanks[r].url, fmt.Sprintf("p-%s-%d", d.GetDecisionId(), r), 0, pl); code != 200 {
					errs <- fmt.Sprintf("prefill rank %d: %d %s", r, code, body)
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			pl := base(kvcv1.WorkerRole_WORKER_ROLE_DECODE)
			pl.KeepSession, pl.OpenSession = true, e.GetOpenSession()
			if e.GetTransfer() != kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED {
				pl.Receive = &kvcv1.ExecutionReceive{Kind: e.GetTransfer(), Room: d.GetBootstrapRoom(),
					PeerAddr: d.GetPrefill().GetPeerAddr(), PeerAddrs: peers, Tokens: input}
			}
			if e.GetTransfer() == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
				pl.Receive.Tokens = d.GetSnapshotSeqlen()
			}
			code, body, meta := generate(dRanks[r].url, fmt.Sprintf("d-%s-%d", d.GetDecisionId(), r), 4, pl)
			if code != 200 {
				errs <- fmt.Sprintf("decode rank %d: %d %s", r, code, body)
			}
			metas[r] = meta
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	if t.Failed() {
		t.FailNow()
	}
	return metas
}

func listed(t *testing.T, c *cp) map[string]*kvcv1.Worker {
	t.Helper()
	r, err := c.admin.ListWorkers(t.Context(), &kvcv1.ListWorkersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*kvcv1.Worker{}
	for _, w := range r.GetWorkers() {
		out[w.GetWorkerId()] = w
	}
	return out
}

// TestTensorParallelRealProcesses runs a TP=2 prefill group and a TP=2 decode group — a real
// sidecar process and a kvc-sim registering as its rank for each of the 4 GPUs — against the
// real control plane (embedded etcd, gRPC on port 0). Each group is one routable worker named by
// its rank 0. A SEED routed to it is carried out rank by rank: decode rank r receives prefill
// rank r's shard (kvc-sim verifies every byte against its own rank's pattern; another rank's
// shard would not verify, and the sidecars refuse a cross-rank offer). The outcome's snapshot
// target reaches both decode ranks, each naming its own prefill rank, and each pushes its shard
// there; the group's snapshot is what both hold. A drain releases the session on both ranks; its
// next turn is a RESEED_SNAPSHOT whose push_snapshot reaches both prefill ranks and whose
// bytes, from each rank's store, verify on the decode rank of the same index. Hellos that
// disagree with the connected group are refused with stable codes and a TPError detail; a
// prefill group of another tp_size is listed as unpaired. Finally one decode rank's sidecar
// dies: the group is not routable and its resident session is not sent there.
func TestTensorParallelRealProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("runs real sidecar and kvc-sim processes")
	}
	bins := procBinaries(t)
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a", func(o *Options) { o.DrainSnapshotWait = 20 * time.Second })
	c.waitLeader(t)
	ctx := t.Context()
	delta := int64(64)
	if _, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{SnapshotDeltaTokens: &delta}}); err != nil {
		t.Fatal(err)
	}
	var pr, dr [2]*simNode
	for r := range 2 {
		pr[r] = startRank(t, bins, "prefill", "p-a", c.grpcAddr, r, 2, "--store-capacity-bytes", "8388608")
		dr[r] = startRank(t, bins, "decode", "d-a", c.grpcAddr, r, 2)
	}
	waitFor(t, "both groups ready", func() bool {
		ws := listed(t, c)
		return ws["p-a0"].GetState() == kvcv1.WorkerState_WORKER_STATE_READY && ws["d-a0"].GetState() == kvcv1.WorkerState_WORKER_STATE_READY
	})
	ws := listed(t, c)
	for _, g := range []string{"p-a", "d-a"} {
		u, r1 := ws[g+"0"], ws[g+"1"]
		if len(u.GetTpRanks()) != 2 || u.GetTpRanks()[1].GetWorkerId() != g+"1" || u.GetTpRanks()[1].GetPeerAddr() != r1.GetPeerAddr() ||
			u.GetTpProblem() != "" || r1.GetTpRank() != 1 || r1.GetTpSize() != 2 || r1.GetTpGroup() != g || len(r1.GetTpRanks()) != 0 {
			t.Fatalf("group %s listed as %v and %v", g, u, r1)
		}
	}

	// Hellos that disagree with the connected group: stable codes, a TPError detail, counted.
	sc := kvcv1.NewSidecarServiceClient(c.conn)
	refused := []struct {
		h         *kvcv1.Hello
		code      codes.Code
		reason    kvcv1.TPErrorReason
		conflicts string
	}{
		{&kvcv1.Hello{WorkerId: "d-bad", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, TpGroup: "d-a", TpRank: 1, TpSize: 4},
			codes.FailedPrecondition, kvcv1.TPErrorReason_TP_ERROR_REASON_SIZE_MISMATCH, "d-a0"},
		{&kvcv1.Hello{WorkerId: "d-dup", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, TpGroup: "d-a", TpRank: 1, TpSize: 2},
			codes.AlreadyExists, kvcv1.TPErrorReason_TP_ERROR_REASON_RANK_TAKEN, "d-a1"},
	}
	for _, x := range refused {
		stream, err := sc.Connect(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: x.h}}); err != nil {
			t.Fatal(err)
		}
		_, err = stream.Recv()
		st := status.Convert(err)
		var detail *kvcv1.TPError
		for _, d := range st.Details() {
			if te, ok := d.(*kvcv1.TPError); ok {
				detail = te
			}
		}
		if st.Code() != x.code || detail.GetReason() != x.reason || detail.GetConflictingWorkerId() != x.conflicts || !strings.Contains(st.Message(), "tensor parallelism") {
			t.Fatalf("hello %s: %v (detail %v)", x.h.GetWorkerId(), err, detail)
		}
	}
	if ws := listed(t, c); ws["d-bad"] != nil || ws["d-dup"] != nil || ws["d-a0"].GetState() != kvcv1.WorkerState_WORKER_STATE_READY {
		t.Fatal("a refused hello changed the workers")
	}
	metrics := httpGetText(t, "http://"+c.httpAddr+"/metrics")
	for _, reason := range []string{"tp_size_mismatch", "tp_rank_taken"} {
		if !strings.Contains(metrics, `kvc_cp_stream_messages_rejected_total{reason="`+reason+`"} 1`) {
			t.Fatalf("no %s rejection counted", reason)
		}
	}
	// A prefill group of another tp_size: connected, listed, never paired (unequal TP).
	{
		sctx, cancel := context.WithCancel(ctx)
		stream, err := sc.Connect(sctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{WorkerId: "p-b0",
			Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, TpGroup: "p-b", TpSize: 4, PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1"}}}); err != nil {
			t.Fatal(err)
		}
		if m, err := stream.Recv(); err != nil || m.GetWelcome() == nil {
			t.Fatalf("p-b0 welcome: %v %v", m, err)
		}
		waitFor(t, "p-b0 listed as unpaired", func() bool {
			return strings.Contains(listed(t, c)["p-b0"].GetTpProblem(), "no decode worker with tp_size 4 (theirs: 2)")
		})
		cancel()
		waitFor(t, "p-b0 gone", func() bool { return listed(t, c)["p-b0"].GetState() == kvcv1.WorkerState_WORKER_STATE_UNREACHABLE })
		if _, err := c.admin.ForgetWorker(ctx, &kvcv1.ForgetWorkerRequest{WorkerId: "p-b0"}); err != nil {
			t.Fatal(err)
		}
	}

	// SEED: routed to the groups, carried out rank to rank.
	rs, err := kvcv1.NewRouterServiceClient(c.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	const session = "s-tp"
	input := int64(300)
	d := route(t, rs, &kvcv1.RouteQuery{RequestId: "q1", SessionId: session, InputTokens: input, MaxOutputTokens: 16, MultiturnHint: true})
	if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED || d.GetDecode().GetWorkerId() != "d-a0" || d.GetPrefill().GetWorkerId() != "p-a0" ||
		len(d.GetDecode().GetTpRanks()) != 2 || len(d.GetPrefill().GetTpRanks()) != 2 || d.GetPrefill().GetTpRanks()[1].GetPeerAddr() != pr[1].sidecar.str("peer_addr") {
		t.Fatalf("seed decision %v", d)
	}
	metas := execRanks(t, d, session, input, pr[:], dr[:])
	for r, m := range metas {
		if m.ReceivedBytes <= 0 || m.VerifyFailures != 0 || m.VerifiedBytes <= 0 || m.KVLenAfter != metas[0].KVLenAfter {
			t.Fatalf("decode rank %d received %+v", r, m)
		}
	}
	reportOutcome(t, rs, d, metas[0].KVLenAfter)
	// Each decode rank was named its own prefill rank and pushed its shard there; the group's
	// snapshot is what both hold.
	waitFor(t, "both ranks pushed", func() bool {
		for r := range 2 {
			p, pushed := decodeTarget(t, dr[r], session)
			if p != fmt.Sprintf("p-a%d", r) || pushed < input {
				return false
			}
		}
		return true
	})
	for r := range 2 {
		var st struct {
			Exists bool   `json:"exists"`
			Seqlen int64  `json:"seqlen"`
			Source string `json:"source_worker"`
		}
		getJSON(t, "http://"+pr[r].sidecar.str("http_addr")+"/v1/sessions/"+session+"/snapshot_status", &st)
		if !st.Exists || st.Source != fmt.Sprintf("d-a%d", r) || st.Seqlen < input {
			t.Fatalf("prefill rank %d's store: %+v", r, st)
		}
	}
	var rec *kvcv1.SessionRecord
	waitFor(t, "the session resident on the group with the group's snapshot", func() bool {
		g, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: session})
		rec = g.GetSession()
		return err == nil && rec.GetDecodeWorker() == "d-a0" && rec.GetSnapshot().GetPrefillWorker() == "p-a0" && rec.GetSnapshot().GetSeqlen() >= input
	})

	// A drain moves the session off the group: released on both ranks' workers.
	if _, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d-a1"}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("drain of rank 1: %v", err)
	}
	if _, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d-a0"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both ranks' workers released the session", func() bool { return !simHolds(t, dr[0])[session] && !simHolds(t, dr[1])[session] })
	if _, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d-a0", Undrain: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the group routable again", func() bool { return listed(t, c)["d-a0"].GetState() == kvcv1.WorkerState_WORKER_STATE_READY })

	// The next turn reseeds from the snapshot: each prefill rank writes its store's shard into
	// the decode rank of its index, which verifies it.
	next := rec.GetKvCommittedLen() + 40
	d = route(t, rs, &kvcv1.RouteQuery{RequestId: "q2", SessionId: session, Turn: 1, InputTokens: next, MaxOutputTokens: 16})
	if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || d.GetDecode().GetWorkerId() != "d-a0" || d.GetPrefill().GetWorkerId() != "p-a0" {
		t.Fatalf("next turn %v %v to %s", d.GetMode(), d.GetReason(), d.GetDecode().GetWorkerId())
	}
	metas = execRanks(t, d, session, next, pr[:], dr[:])
	for r, m := range metas {
		if m.ReceivedBytes <= 0 || m.VerifyFailures != 0 {
			t.Fatalf("decode rank %d reseeded %+v", r, m)
		}
	}
	reportOutcome(t, rs, d, metas[0].KVLenAfter)
	waitFor(t, "resident on the group again", func() bool {
		g, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: session})
		return err == nil && g.GetSession().GetDecodeWorker() == "d-a0"
	})

	// One decode rank's sidecar dies: the group is out of routing, its session not sent there.
	dr[1].sidecar.Kill()
	waitFor(t, "the decode group unreachable", func() bool {
		u := listed(t, c)["d-a0"]
		return u.GetState() == kvcv1.WorkerState_WORKER_STATE_UNREACHABLE && strings.Contains(u.GetTpProblem(), "rank 1 (d-a1) unreachable")
	})
	if d := route(t, rs, &kvcv1.RouteQuery{RequestId: "q3", SessionId: session, Turn: 2, InputTokens: next + 60, MaxOutputTokens: 16}); d.GetDecode().GetWorkerId() == "d-a0" ||
		d.GetMode() == kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.GetReason() != kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE {
		t.Fatalf("resident session with a rank down: %v %v to %q", d.GetMode(), d.GetReason(), d.GetDecode().GetWorkerId())
	}
	if d := route(t, rs, &kvcv1.RouteQuery{RequestId: "q4", SessionId: "s-new", InputTokens: 100, MaxOutputTokens: 16, MultiturnHint: true}); d.GetDecode().GetWorkerId() == "d-a0" ||
		d.GetMode() == kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("new session with a rank down: %v to %q", d.GetMode(), d.GetDecode().GetWorkerId())
	}
}

func httpGetText(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}
