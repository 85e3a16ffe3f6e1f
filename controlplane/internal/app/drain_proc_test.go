package app

import (
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvhints"
	"github.com/kvcentric/kvcentric/pkg/launch"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Real processes for the drain test: the sidecars and kvc-sim, built from this tree (or taken
// from $KVC_BIN_DIR). They are binaries, not imports: the modules stay independent.
var (
	procBinsOnce    sync.Once
	procBins        map[string]string
	procBinsErr     error
	procBinsCleanup = func() {} // removes what procBinaries built; run by TestMain
)

// TestMain fails the package's tests when a goroutine they started is still running at the end
// (with time for the stopped etcd members' connections to close), then removes the binaries it
// built.
func TestMain(m *testing.M) {
	etcdtest.VerifyTestMain(m, func() { procBinsCleanup() })
}

// procBinaries finds or builds (once, for the tests that run processes) the binaries.
func procBinaries(t *testing.T) map[string]string {
	t.Helper()
	procBinsOnce.Do(func() {
		procBins, procBinsCleanup, procBinsErr = launch.Binaries(os.Getenv("KVC_BIN_DIR"), map[string]string{
			"kvc-sidecar-decode":  "../../../sidecar-decode",
			"kvc-sidecar-prefill": "../../../sidecar-prefill",
			"kvc-sim":             "../../../sim",
			"kvc-controlplane":    "../..",
		})
	})
	if procBinsErr != nil {
		t.Fatal(procBinsErr)
	}
	return procBins
}

// proc is a running binary.
type proc struct{ *launch.Process }

func (p *proc) str(k string) string { return p.ReadyString(k) }

// startProc runs bin with args and --ready-file, waits for the ready file and stops the
// process (SIGTERM, then SIGKILL) when the test ends.
func startProc(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	return &proc{launch.StartT(t, launch.Spec{Name: name, Bin: bin, Args: args}, 30*time.Second)}
}

// simNode is a sidecar with a kvc-sim worker on its bridge socket.
type simNode struct {
	sidecar, sim *proc
	url          string
}

func startSimNode(t *testing.T, bins map[string]string, role, id, cp string, sidecarArgs ...string) *simNode {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "bridge.sock")
	args := append([]string{"--worker-id", id, "--bridge-socket", sock, "--transport", "tcp", "--transfer-conns", "2",
		"--heartbeat", "100ms", "--control-plane", cp, "--insecure", "--log-level", "debug"}, sidecarArgs...)
	sc := startProc(t, id, bins["kvc-sidecar-"+role], args...)
	sim := startProc(t, "sim-"+id, bins["kvc-sim"], "--role", role, "--worker-id", id, "--bridge-socket", sock,
		"--http-addr", "127.0.0.1:0", "--kv-capacity-tokens", "8192", "--page-size", "16", "--layers", "4",
		"--bytes-per-token-per-buffer", "64", "--time-scale", "0.01", "--shm-dir", t.TempDir(), "--log-level", "debug", "--bridge-wait", "30s")
	return &simNode{sidecar: sc, sim: sim, url: "http://" + sim.str("http_addr")}
}

func postJSON(url string, body map[string]any) (int, string, error) {
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	_, _ = out.ReadFrom(resp.Body)
	return resp.StatusCode, out.String(), nil
}

// seed runs one SEED turn of session s (n input tokens) the way the gateway does: the prefill
// kvc-sim prefills and sends the KV while the decode kvc-sim receives it and keeps the session.
func seed(t *testing.T, d, p *simNode, s string, room, n int64) {
	t.Helper()
	var wg sync.WaitGroup
	var pCode int
	var pBody string
	var pErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		env, _ := kvhints.Build("p-"+s, &kvcv1.ExecutionPayload{Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, SessionId: s,
			InputTokens: n, Send: &kvcv1.ExecutionSend{Room: room}})
		pCode, pBody, pErr = postJSON(p.url+"/generate", map[string]any{"rid": "p-" + s, "sampling_params": map[string]any{"max_new_tokens": 0},
			"kv_hints": env})
	}()
	env, _ := kvhints.Build("d-"+s, &kvcv1.ExecutionPayload{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, SessionId: s, InputTokens: n,
		KeepSession: true, OpenSession: true,
		Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Room: room, PeerAddr: p.sidecar.str("peer_addr")}})
	code, body, err := postJSON(d.url+"/generate", map[string]any{"rid": "d-" + s, "sampling_params": map[string]any{"max_new_tokens": 4},
		"session_params": map[string]any{"id": s}, "kv_hints": env})
	wg.Wait()
	if err != nil || code != 200 || pErr != nil || pCode != 200 {
		t.Fatalf("seed %s: decode %d %s (%v); prefill %d %s (%v)", s, code, body, err, pCode, pBody, pErr)
	}
}

func simHolds(t *testing.T, n *simNode) map[string]bool {
	t.Helper()
	resp, err := http.Get(n.url + "/kvc/sessions")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Sessions []struct {
			SessionID string `json:"session_id"`
		} `json:"sessions"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, s := range body.Sessions {
		out[s.SessionID] = true
	}
	return out
}

// TestDrainRealProcesses drains a live decode worker — real sidecar processes, kvc-sim
// workers, real etcd — holding three sessions seeded from a prefill kvc-sim and never given a
// snapshot target: the drain names one for each, the decode sidecar pushes each session's
// KV to the prefill sidecar's store, and each session is released only once its snapshot is
// usable — on the worker too (kvc-sim no longer holds it). Their next turns are routed to the
// other decode worker as RESEED_SNAPSHOT: nothing is lost. (Each snapshot covers the whole
// committed length: the pushes ran after the target was named, snapshot_delta_tokens is 64.)
func TestDrainRealProcesses(t *testing.T) {
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
	p1 := startSimNode(t, bins, "prefill", "p1", c.grpcAddr, "--store-capacity-bytes", "8388608")
	d1 := startSimNode(t, bins, "decode", "d1", c.grpcAddr)
	startSimNode(t, bins, "decode", "d2", c.grpcAddr)
	waitFor(t, "workers ready", func() bool {
		r, err := c.admin.ListWorkers(ctx, &kvcv1.ListWorkersRequest{})
		n := 0
		for _, w := range r.GetWorkers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return err == nil && n == 3
	})
	lens := map[string]int64{"s-1": 300, "s-2": 500, "s-3": 700}
	room := int64(9000)
	for _, s := range []string{"s-1", "s-2", "s-3"} {
		room++
		seed(t, d1, p1, s, room, lens[s])
	}
	var committed map[string]int64
	waitFor(t, "three sessions resident on d1", func() bool {
		r, err := c.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{WorkerId: "d1"})
		committed = map[string]int64{}
		for _, s := range r.GetSessions() {
			if s.GetKvCommittedLen() >= lens[s.GetSessionId()] {
				committed[s.GetSessionId()] = s.GetKvCommittedLen()
			}
		}
		return err == nil && len(committed) == 3
	})
	if held := simHolds(t, d1); len(held) != 3 {
		t.Fatalf("d1's worker holds %v", held)
	}

	if _, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d1"}); err != nil {
		t.Fatal(err)
	}
	var st *kvcv1.DrainStatus
	waitFor(t, "drain finished", func() bool {
		r, err := c.admin.GetDrainStatus(ctx, &kvcv1.GetDrainStatusRequest{WorkerId: "d1"})
		st = r.GetStatus()
		return err == nil && !st.GetActive()
	})
	if st.GetSessionsAtStart() != 3 || st.GetMovedWithSnapshot() != 3 || st.GetMovedWithoutSnapshot() != 0 || st.GetSessionsLeft() != 0 {
		t.Fatalf("drain status %v", st)
	}
	for s, n := range committed {
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: s})
		if err != nil || r.GetSession().GetDecodeWorker() != "" || r.GetSession().GetSnapshot().GetPrefillWorker() != "p1" ||
			r.GetSession().GetSnapshot().GetSeqlen() < n {
			t.Fatalf("%s after the drain (committed %d): %v %v", s, n, r.GetSession(), err)
		}
	}
	waitFor(t, "d1's worker released every session", func() bool { return len(simHolds(t, d1)) == 0 })

	route, err := kvcv1.NewRouterServiceClient(c.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for s, n := range committed {
		if err := route.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
			RequestId: s, SessionId: s, Turn: 1, InputTokens: n + 50, MaxOutputTokens: 16}}}); err != nil {
			t.Fatal(err)
		}
		m, err := route.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if d := m.GetDecision(); d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || d.GetDecode().GetWorkerId() != "d2" {
			t.Fatalf("%s next turn: %v %v to %s", s, d.GetMode(), d.GetReason(), d.GetDecode().GetWorkerId())
		}
	}
	if strings.Contains(d1.sidecar.Log(), "control plane's release not carried out") {
		t.Fatal("a release did not reach d1's worker")
	}
}
