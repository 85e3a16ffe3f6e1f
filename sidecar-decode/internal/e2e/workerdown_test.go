package e2e

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// mortalWorker is a decode worker process as its sidecar sees it: a bridge connection of its
// own and an HTTP /health (the sidecar's --worker-url). die closes the connection (what the
// kernel does when the process exits) and fails /health.
type mortalWorker struct {
	*dworker
	alive  atomic.Bool
	health *httptest.Server
	conn   *grpc.ClientConn
}

func startMortal(t *testing.T, id, cps string) *mortalWorker {
	t.Helper()
	m := &mortalWorker{}
	m.alive.Store(true)
	m.health = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if !m.alive.Load() {
			http.Error(w, "gone", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	}))
	t.Cleanup(m.health.Close)
	sc := startSidecar(t, "decode", id, cps, "--worker-url", m.health.URL, "--worker-health-interval", "100ms", "--worker-health-threshold", "3")
	m.dworker = &dworker{sc: sc, pages: map[string][]int64{}}
	m.connect(t)
	return m
}

// ownBridge gives sc's worker a bridge connection of its own (closing it is the worker dying).
func ownBridge(t *testing.T, sc *sidecarProc) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sc.Ready()["bridge_socket"].(string), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	sc.bridge = kvcv1.NewWorkerBridgeServiceClient(conn)
	return conn
}

// connect is the worker (re)starting: a new bridge connection and a new KV pool.
func (m *mortalWorker) connect(t *testing.T) {
	t.Helper()
	m.conn = ownBridge(t, m.sc)
	m.alive.Store(true)
	m.w = newWorker(t, m.sc, 1024)
	m.pages = map[string][]int64{}
}

func (m *mortalWorker) die() {
	m.alive.Store(false)
	_ = m.conn.Close()
}

// A decode worker process dies while its sidecar stays up: the control plane must take that
// GPU out of routing and the next turn of a session resident there is reseeded from its
// snapshot on another decode worker, not sent to the dead one.
func TestWorkerProcessDeath(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-controlplane"] == "" {
		t.Fatal("kvc-controlplane binary not available")
	}
	etcd := etcdtest.Start(t)
	cp := startCP(t, "cp-a", etcd.Endpoints())
	leaderOf(t, cp)
	if _, err := cp.admin.UpdatePolicy(ctxT(t, 5*time.Second), &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{
		SnapshotDeltaTokens: ptr(int64(64)), TailToleranceTokens: ptr(int64(512))}}); err != nil {
		t.Fatal(err)
	}
	p0 := startSidecar(t, "prefill", "p0", cp.addr, "--store-capacity-bytes", itoa(64*2*numLayers*itemLen))
	pconn := ownBridge(t, p0)
	pw := newWorker(t, p0, 1024)
	byID := map[string]*mortalWorker{"d1": startMortal(t, "d1", cp.addr), "d2": startMortal(t, "d2", cp.addr)}
	workers := func() map[string]*kvcv1.Worker {
		r, err := cp.admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
		out := map[string]*kvcv1.Worker{}
		if err == nil {
			for _, w := range r.GetWorkers() {
				out[w.GetWorkerId()] = w
			}
		}
		return out
	}
	waitFor(t, "three ready workers", 20*time.Second, func() bool {
		n := 0
		for _, w := range workers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return n == 3
	})
	rt := newRouter(t, cp.addr)
	session := func(s string) *kvcv1.SessionRecord {
		r, err := cp.admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: s})
		if err != nil {
			return nil
		}
		return r.GetSession()
	}

	// Session A: seeded on some D, one commit later its snapshot (160 tokens) is on p0.
	const A = "sess-A"
	dec := rt.query(t, A, 0, 150, 10)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("first turn %s (%s)", dec.GetMode(), dec.GetReason())
	}
	dead := byID[dec.GetDecode().GetWorkerId()]
	ppages := pw.alloc(10, 1)
	if err := kvpool.FillTokens(pw.pool, kvpool.SessionSeed(A), ppages, 0, 150); err != nil {
		t.Fatal(err)
	}
	res := dead.receive(t, A, dec, kvcv1.TransferKind_TRANSFER_KIND_SEED, 150, func() {
		if _, err := p0.bridge.SendKV(ctxT(t, 10*time.Second), &kvcv1.SendKVRequest{Room: dec.GetBootstrapRoom(), SessionId: A,
			Pages: ppages, Last: true, Tokens: 150}); err != nil {
			t.Fatal(err)
		}
	})
	if !res.GetOk() {
		t.Fatalf("seed: %v", res)
	}
	dead.compute(t, A, 150, 160)
	rt.outcome(t, dec, 160)
	waitFor(t, "A's snapshot at 160 on p0", 20*time.Second, func() bool {
		s := session(A)
		return s.GetSnapshot().GetSeqlen() == 160 && s.GetSnapshot().GetPrefillWorker() == "p0" && s.GetDecodeWorker() == dead.sc.id
	})
	if d := rt.query(t, A, 1, 170, 5); d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.GetDecode().GetWorkerId() != dead.sc.id {
		t.Fatalf("before the death: %s to %s", d.GetMode(), d.GetDecode().GetWorkerId())
	} else {
		rt.outcome(t, d, 160) // not executed: nothing changes on D
	}

	// Before it dies the worker reports requests waiting for pages: the sidecar's gauges and the
	// control plane's view of its load carry them.
	if _, err := dead.sc.bridge.ReportDemand(ctxT(t, 5*time.Second), &kvcv1.ReportDemandRequest{WaitingRequests: 2, WaitingTokens: 300,
		FreeTokens: 100, RunningRequests: 1, UnevictableTokens: 160}); err != nil {
		t.Fatal(err)
	}
	demandIs := func(what string, sc *sidecarProc, waiting, tokens, reported int) {
		t.Helper()
		want := []string{fmt.Sprintf("\nkvc_sidecar_prealloc_waiting_requests %d\n", waiting), fmt.Sprintf("\nkvc_sidecar_prealloc_waiting_tokens %d\n", tokens),
			fmt.Sprintf("\nkvc_sidecar_demand_reported %d\n", reported)}
		var last string
		waitFor(t, what+": the demand gauges", 5*time.Second, func() bool {
			_, last = httpText(t, "http://"+sc.httpAddr+"/metrics")
			for _, w := range want {
				if !strings.Contains(last, w) {
					return false
				}
			}
			return true
		})
		waitFor(t, what+": the control plane's view of the load", 20*time.Second, func() bool {
			l := workers()[sc.id].GetLoad()
			return l.GetWaitingRequests() == int32(waiting) && l.GetPreallocQueueDepth() == int32(waiting)
		})
	}
	demandIs("before the death", dead.sc, 2, 300, 1)

	// The worker process dies; its sidecar stays up and connected.
	died := time.Now()
	dead.die()
	waitFor(t, "the dead worker WORKER_DOWN in the admin listing", 20*time.Second, func() bool {
		w := workers()[dead.sc.id]
		return w.GetState() == kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN && w.GetWorkerDownSinceUnixMs() > 0 &&
			strings.Contains(w.GetWorkerDownReason(), "bridge connection closed") && w.GetConnectedTo() != ""
	})
	t.Logf("worker death to WORKER_DOWN on the control plane: %v (admin polled every 10 ms); reason %q",
		time.Since(died).Round(time.Millisecond), workers()[dead.sc.id].GetWorkerDownReason())
	if s := session(A); s.GetDecodeWorker() != "" || s.GetPreviousDecodeWorker() != dead.sc.id {
		t.Fatalf("A still resident on the dead worker: %v", s)
	}
	var metrics string
	waitFor(t, "kvc_sidecar_worker_up 0", 5*time.Second, func() bool {
		resp, err := http.Get("http://" + dead.sc.httpAddr + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		metrics = string(b)
		return strings.Contains(metrics, "\nkvc_sidecar_worker_up 0\n")
	})
	if !strings.Contains(metrics, `kvc_sidecar_worker_down_total{cause="bridge"} 1`) {
		t.Fatalf("worker_down_total not counted:\n%s", metrics)
	}
	// Its demand died with it: nothing waits there, in the gauges or the load report (the
	// control plane gets one at once on the transition), and the forgotten report is counted.
	demandIs("worker down", dead.sc, 0, 0, 0)
	if w := workers()[dead.sc.id].GetLoad(); w.GetRunningRequests() != 0 || w.GetUnevictableTokens() != 0 {
		t.Fatalf("the dead worker's load still carries its requests: %v", w)
	}
	if _, m := httpText(t, "http://"+dead.sc.httpAddr+"/metrics"); !strings.Contains(m, "\nkvc_sidecar_demand_forgotten_total 1\n") {
		t.Fatal("kvc_sidecar_demand_forgotten_total is not 1")
	}

	// Next turn of A: reseeded from p0's snapshot onto the other D, verified byte for byte.
	dec = rt.query(t, A, 2, 200, 8)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || dec.GetDecode().GetWorkerId() == dead.sc.id ||
		dec.GetPrefill().GetWorkerId() != "p0" || dec.GetSnapshotSeqlen() != 160 {
		t.Fatalf("after the death: %s (%s) to %s via %s, seqlen %d", dec.GetMode(), dec.GetReason(), dec.GetDecode().GetWorkerId(),
			dec.GetPrefill().GetWorkerId(), dec.GetSnapshotSeqlen())
	}
	other := byID[dec.GetDecode().GetWorkerId()]
	res = other.receive(t, A, dec, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, 160, nil)
	if !res.GetOk() || res.GetBytes() != 160*bpt {
		t.Fatalf("snapshot reseed onto %s: %v", other.sc.id, res)
	}
	other.compute(t, A, 160, 208)
	rt.outcome(t, dec, 208)
	waitFor(t, "A resident on the live D", 10*time.Second, func() bool { return session(A).GetDecodeWorker() == other.sc.id })

	// New sessions avoid the dead worker, even though it is the emptier one now.
	for i := 0; i < 3; i++ {
		d := rt.query(t, fmt.Sprintf("new-%d", i), 0, 100, 10)
		if d.GetDecode().GetWorkerId() == dead.sc.id {
			t.Fatalf("new session %d sent to the dead worker: %s", i, d.GetMode())
		}
	}

	// The worker restarts and registers its pool again: READY, and it takes new sessions.
	dead.connect(t)
	waitFor(t, "the restarted worker READY", 20*time.Second, func() bool {
		w := workers()[dead.sc.id]
		return w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY && w.GetWorkerDownReason() == "" && w.GetWorkerDownSinceUnixMs() == 0
	})
	// Back up, it has not reported its demand yet: none counts.
	demandIs("restarted, no report yet", dead.sc, 0, 0, 0)
	if d := rt.query(t, "after-restart", 0, 100, 10); d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED || d.GetDecode().GetWorkerId() != dead.sc.id {
		t.Fatalf("after the restart a new session went %s to %s; the restarted worker is the emptiest", d.GetMode(), d.GetDecode().GetWorkerId())
	}
	// Its first report counts again (and its queue drains).
	for _, n := range []int32{1, 0} {
		if _, err := dead.sc.bridge.ReportDemand(ctxT(t, 5*time.Second), &kvcv1.ReportDemandRequest{WaitingRequests: n, WaitingTokens: 50 * int64(n),
			FreeTokens: 10 * int64(n)}); err != nil {
			t.Fatal(err)
		}
		demandIs(fmt.Sprintf("the restarted worker's report of %d waiting", n), dead.sc, int(n), 50*int(n), 1)
	}

	// The prefill worker dies: p0 prefills nothing more, but its snapshot store is the
	// sidecar's memory, so it still reseeds A (whose new residency was snapshotted at 208).
	waitFor(t, "A's snapshot at 208 on p0", 20*time.Second, func() bool {
		s := session(A)
		return s.GetSnapshot().GetSeqlen() == 208 && s.GetSnapshot().GetPrefillWorker() == "p0"
	})
	_ = pconn.Close()
	waitFor(t, "p0 WORKER_DOWN", 20*time.Second, func() bool {
		return workers()["p0"].GetState() == kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN
	})
	if s := session(A); s.GetSnapshot().GetSeqlen() != 208 {
		t.Fatalf("A's snapshot lost with p0's worker: %v", s.GetSnapshot())
	}
	if d := rt.query(t, "no-prefill", 0, 100, 10); d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK ||
		d.GetReason() != kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER || d.GetPrefill() != nil {
		t.Fatalf("a new session with the only P down: %s (%s) via %v", d.GetMode(), d.GetReason(), d.GetPrefill().GetWorkerId())
	}
	other.release(t, A)
	waitFor(t, "A not resident", 10*time.Second, func() bool { return session(A).GetDecodeWorker() == "" })
	dec = rt.query(t, A, 3, 220, 8)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || dec.GetPrefill().GetWorkerId() != "p0" || dec.GetSnapshotSeqlen() != 208 {
		t.Fatalf("A with p0's worker down: %s (%s) via %s, seqlen %d", dec.GetMode(), dec.GetReason(), dec.GetPrefill().GetWorkerId(), dec.GetSnapshotSeqlen())
	}
	to := byID[dec.GetDecode().GetWorkerId()]
	res = to.receive(t, A, dec, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, 208, nil)
	if !res.GetOk() || res.GetBytes() != 208*bpt {
		t.Fatalf("snapshot reseed from p0 with its worker down: %v", res)
	}
}
