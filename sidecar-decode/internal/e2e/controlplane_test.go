package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// cpProc is a kvc-controlplane replica.
type cpProc struct {
	*proc
	node  string
	addr  string
	admin kvcv1.AdminServiceClient
}

func startCP(t *testing.T, node string, endpoints []string) *cpProc {
	t.Helper()
	p := start(t, node, bins["kvc-controlplane"], "--node-id", node, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--etcd-endpoints", strings.Join(endpoints, ","), "--etcd-prefix", "/kvc-e2e/", "--election-ttl", "2s", "--flush-delay", "20ms")
	conn, err := grpc.NewClient(p.ReadyString("grpc_addr"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &cpProc{proc: p, node: node, addr: p.ReadyString("grpc_addr"), admin: kvcv1.NewAdminServiceClient(conn)}
}

// leaderOf waits until one of cps leads and returns it.
func leaderOf(t *testing.T, cps ...*cpProc) *cpProc {
	t.Helper()
	var l *cpProc
	waitFor(t, "a control-plane leader", 30*time.Second, func() bool {
		for _, c := range cps {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			r, err := c.admin.GetLeader(ctx, &kvcv1.GetLeaderRequest{})
			cancel()
			if err == nil && r.GetResponderIsLeader() {
				l = c
				return true
			}
		}
		return false
	})
	return l
}

// router is a gateway's Route stream.
type router struct {
	stream grpc.BidiStreamingClient[kvcv1.RouteRequest, kvcv1.RouteResponse]
	n      int
}

func newRouter(t *testing.T, addr string) *router {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); _ = conn.Close() })
	s, err := kvcv1.NewRouterServiceClient(conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return &router{stream: s}
}

func (r *router) query(t *testing.T, session string, turn int32, input, output int64) *kvcv1.RouteDecision {
	t.Helper()
	r.n++
	id := fmt.Sprintf("q%d", r.n)
	if err := r.stream.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{RequestId: id, SessionId: session,
		Turn: turn, InputTokens: input, MaxOutputTokens: output, MultiturnHint: true}}}); err != nil {
		t.Fatal(err)
	}
	m, err := r.stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	d := m.GetDecision()
	if d == nil || d.GetRequestId() != id {
		t.Fatalf("route answer %v", m)
	}
	return d
}

func (r *router) outcome(t *testing.T, d *kvcv1.RouteDecision, kvLen int64) {
	t.Helper()
	if err := r.stream.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{DecisionId: d.GetDecisionId(),
		Success: true, ErrorKind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE, KvLenAfter: kvLen, ExecutedMode: d.GetMode(), TtftUs: 1000, LatencyUs: 2000}}}); err != nil {
		t.Fatal(err)
	}
	m, err := r.stream.Recv()
	if err != nil || m.GetOutcomeAck().GetDecisionId() != d.GetDecisionId() {
		t.Fatalf("outcome ack %v %v", m, err)
	}
}

// dworker is a decode sidecar with its worker and the sessions the worker holds.
type dworker struct {
	sc    *sidecarProc
	w     *worker
	pages map[string][]int64
}

func (d *dworker) pagesFor(s string, n int64) []int64 {
	need := int((n+pageSize-1)/pageSize) - len(d.pages[s])
	if need > 0 {
		d.pages[s] = append(d.pages[s], d.w.alloc(need, 1)...)
	}
	return d.pages[s]
}

// compute fills tokens [from, to) of s (an append-prefill or decode) and commits [0, to).
func (d *dworker) compute(t *testing.T, s string, from, to int64) {
	t.Helper()
	pages := d.pagesFor(s, to)
	if err := kvpool.FillTokens(d.w.pool, kvpool.SessionSeed(s), pages, from, to); err != nil {
		t.Fatal(err)
	}
	if _, err := d.sc.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: s, CommittedLen: to, Pages: pages}); err != nil {
		t.Fatal(err)
	}
}

func (d *dworker) release(t *testing.T, s string) {
	t.Helper()
	if _, err := d.sc.bridge.ReleaseSession(ctxT(t, 5*time.Second), &kvcv1.ReleaseSessionRequest{SessionId: s, Reason: kvcv1.ReleaseReason_RELEASE_REASON_EVICTED}); err != nil {
		t.Fatal(err)
	}
	delete(d.pages, s) // the worker frees them (this allocator never reuses pages)
}

// receive carries out the decode side of a transfer (seed or snapshot) into fresh pages and
// checks that they hold the session's known bytes.
func (d *dworker) receive(t *testing.T, s string, dec *kvcv1.RouteDecision, kind kvcv1.TransferKind, tokens int64, send func()) *kvcv1.WaitReceiveResponse {
	t.Helper()
	res := d.receiveRaw(t, s, dec, kind, tokens, send)
	if res.GetOk() {
		if bad, err := kvpool.CheckTokens(d.w.pool, kvpool.SessionSeed(s), d.pages[s], 0, tokens); err != nil || bad != 0 {
			t.Fatalf("%s after %s transfer: %d tokens wrong (%v)", s, kind, bad, err)
		}
	}
	return res
}

// receiveRaw is receive without the check of the bytes.
func (d *dworker) receiveRaw(t *testing.T, s string, dec *kvcv1.RouteDecision, kind kvcv1.TransferKind, tokens int64, send func()) *kvcv1.WaitReceiveResponse {
	t.Helper()
	delete(d.pages, s)
	pages := d.pagesFor(s, tokens)
	if _, err := d.sc.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: dec.GetBootstrapRoom(), SessionId: s,
		Kind: kind, Pages: pages, Tokens: tokens, SourcePeerAddr: dec.GetPrefill().GetPeerAddr()}); err != nil {
		t.Fatal(err)
	}
	if send != nil {
		send()
	}
	res, err := d.sc.bridge.WaitReceive(ctxT(t, 20*time.Second), &kvcv1.WaitReceiveRequest{Room: dec.GetBootstrapRoom(), TimeoutMs: 15000})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func TestWithControlPlane(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-controlplane"] == "" {
		t.Fatal("kvc-controlplane binary not available")
	}
	etcd := etcdtest.Start(t)
	a := startCP(t, "cp-a", etcd.Endpoints())
	lead := leaderOf(t, a)
	b := startCP(t, "cp-b", etcd.Endpoints())
	if _, err := lead.admin.UpdatePolicy(ctxT(t, 5*time.Second), &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{
		SnapshotDeltaTokens: ptr(int64(64)), TailToleranceTokens: ptr(int64(512))}}); err != nil {
		t.Fatal(err)
	}
	cps := a.addr + "," + b.addr
	const storePages = 40
	p0 := startSidecar(t, "prefill", "p0", cps, "--store-capacity-bytes", itoa(storePages*2*numLayers*itemLen))
	d1 := &dworker{sc: startSidecar(t, "decode", "d1", cps), pages: map[string][]int64{}}
	d2 := &dworker{sc: startSidecar(t, "decode", "d2", cps), pages: map[string][]int64{}}
	pw := newWorker(t, p0, 1024)
	d1.w, d2.w = newWorker(t, d1.sc, 1024), newWorker(t, d2.sc, 1024)
	byID := map[string]*dworker{"d1": d1, "d2": d2}
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
	rt := newRouter(t, lead.addr)

	// seed does a SEED or RESEED_PREFILL: P "prefills" [0, input) and sends it, D decodes output.
	seed := func(s string, dec *kvcv1.RouteDecision, input, output int64) *dworker {
		t.Helper()
		d := byID[dec.GetDecode().GetWorkerId()]
		ppages := pw.alloc(int((input+pageSize-1)/pageSize), 1)
		if err := kvpool.FillTokens(pw.pool, kvpool.SessionSeed(s), ppages, 0, input); err != nil {
			t.Fatal(err)
		}
		res := d.receive(t, s, dec, kvcv1.TransferKind_TRANSFER_KIND_SEED, input, func() {
			if _, err := p0.bridge.SendKV(ctxT(t, 10*time.Second), &kvcv1.SendKVRequest{Room: dec.GetBootstrapRoom(), SessionId: s,
				Pages: ppages, Last: true, Tokens: input}); err != nil {
				t.Fatal(err)
			}
		})
		if !res.GetOk() {
			t.Fatalf("seed transfer: %v", res)
		}
		d.compute(t, s, input, input+output)
		rt.outcome(t, dec, input+output)
		return d
	}
	waitSnapshot := func(s string, seqlen int64) {
		t.Helper()
		waitFor(t, fmt.Sprintf("snapshot of %s at %d on the control plane", s, seqlen), 20*time.Second, func() bool {
			r, err := lead.admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: s})
			return err == nil && r.GetSession().GetSnapshot().GetSeqlen() == seqlen && r.GetSession().GetSnapshot().GetPrefillWorker() == "p0"
		})
	}
	mode := func(d *kvcv1.RouteDecision, want kvcv1.RouteMode) {
		t.Helper()
		if d.GetMode() != want {
			t.Fatalf("decision %s (%s), want %s", d.GetMode(), d.GetReason(), want)
		}
	}

	// Session A: seed, one direct-to-D turn; snapshots follow every commit.
	const A = "sess-A"
	dec := rt.query(t, A, 0, 150, 10)
	mode(dec, kvcv1.RouteMode_ROUTE_MODE_SEED)
	dA := seed(A, dec, 150, 10)
	waitSnapshot(A, 160)
	dec = rt.query(t, A, 1, 230, 8)
	mode(dec, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D)
	if dec.GetDecode().GetWorkerId() != dA.sc.id {
		t.Fatalf("direct-to-D went to %s, session is on %s", dec.GetDecode().GetWorkerId(), dA.sc.id)
	}
	dA.compute(t, A, 160, 238)
	rt.outcome(t, dec, 238)
	waitSnapshot(A, 238)

	t.Run("D released: RESEED_SNAPSHOT writes the snapshot into D' and P does not prefill", func(t *testing.T) {
		dA.release(t, A)
		waitFor(t, "A not resident", 10*time.Second, func() bool {
			r, err := lead.admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: A})
			return err == nil && r.GetSession().GetDecodeWorker() == ""
		})
		dec := rt.query(t, A, 2, 260, 8)
		mode(dec, kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT)
		if dec.GetSnapshotSeqlen() != 238 || dec.GetPrefill().GetWorkerId() != "p0" {
			t.Fatalf("reseed decision %v", dec)
		}
		dNew := byID[dec.GetDecode().GetWorkerId()]
		res := dNew.receive(t, A, dec, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, 238, nil)
		if !res.GetOk() || res.GetBytes() != 238*bpt {
			t.Fatalf("snapshot reseed: %v", res)
		}
		dNew.compute(t, A, 238, 268) // D' append-prefills the tail and decodes
		rt.outcome(t, dec, 268)
		hits := filterEvents(readEvents(t, p0.events), sidecar.EvBypassHit, A)
		if len(hits) != 1 || hits[0].Room != dec.GetBootstrapRoom() {
			t.Fatalf("bypass hits %+v", hits)
		}
		dA = dNew
		waitSnapshot(A, 268) // the new residency (a new generation) is snapshotted again
	})

	t.Run("store full: LRU eviction by bytes, SNAPSHOT_EVICTED, next reseed is RESEED_PREFILL", func(t *testing.T) {
		for _, s := range []string{"sess-B", "sess-C"} {
			dec := rt.query(t, s, 0, 290, 10)
			mode(dec, kvcv1.RouteMode_ROUTE_MODE_SEED)
			seed(s, dec, 290, 10)
			waitSnapshot(s, 300)
		}
		// the store logs the eviction as it makes room; wait for the line rather than assume
		// it is written before sess-C's snapshot reaches the control plane
		waitFor(t, "A's snapshot evicted for capacity (store event)", 10*time.Second, func() bool {
			ev := filterEvents(readEvents(t, p0.events), sidecar.EvEvicted, A)
			return len(ev) > 0 && ev[len(ev)-1].Reason == "capacity"
		})
		waitFor(t, "A's snapshot gone on the control plane", 10*time.Second, func() bool {
			r, err := lead.admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: A})
			return err == nil && r.GetSession().GetSnapshot() == nil
		})
		dA.release(t, A)
		waitFor(t, "A not resident", 10*time.Second, func() bool {
			r, err := lead.admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: A})
			return err == nil && r.GetSession().GetDecodeWorker() == ""
		})
		dec := rt.query(t, A, 3, 290, 8)
		mode(dec, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL)
		dA = seed(A, dec, 290, 8)
	})

	t.Run("leader killed: sidecars re-home, resync, residency matches the sidecars", func(t *testing.T) {
		other := a
		if lead == a {
			other = b
		}
		lead.Kill()
		newLead := leaderOf(t, other)
		waitFor(t, "every sidecar re-homed", 30*time.Second, func() bool {
			r, err := newLead.admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
			n := 0
			for _, w := range r.GetWorkers() {
				if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY && w.GetConnectedTo() == newLead.node {
					n++
				}
			}
			return err == nil && n == 3
		})
		type res struct {
			d string
			n int64
		}
		truth := map[string]res{}
		for id, d := range byID {
			var ss []struct {
				SessionID    string `json:"session_id"`
				CommittedLen int64  `json:"committed_len"`
			}
			getJSON(t, "http://"+d.sc.httpAddr+"/v1/sessions", &ss)
			for _, s := range ss {
				truth[s.SessionID] = res{id, s.CommittedLen}
			}
		}
		if len(truth) != 3 {
			t.Fatalf("sidecars hold %v", truth)
		}
		waitFor(t, "residency equal to the sidecars' truth", 10*time.Second, func() bool {
			r, err := newLead.admin.ListSessions(ctxT(t, time.Second), &kvcv1.ListSessionsRequest{PageSize: 100})
			if err != nil {
				return false
			}
			got := map[string]res{}
			for _, s := range r.GetSessions() {
				if s.GetDecodeWorker() != "" {
					got[s.GetSessionId()] = res{s.GetDecodeWorker(), s.GetKvCommittedLen()}
				}
			}
			if len(got) != len(truth) {
				return false
			}
			for k, v := range truth {
				if got[k] != v {
					return false
				}
			}
			return true
		})
		// and the new leader routes on it: A is resident where the sidecar says
		rt2 := newRouter(t, newLead.addr)
		dec := rt2.query(t, A, 4, 300, 4)
		mode(dec, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D)
		if dec.GetDecode().GetWorkerId() != truth[A].d {
			t.Fatalf("direct-to-D to %s, A is on %s", dec.GetDecode().GetWorkerId(), truth[A].d)
		}
	})
}

func ptr[T any](v T) *T { return &v }

var _ = json.Marshal
var _ = os.Getenv
var _ = filepath.Join
