package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvhints"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sidecar-decode/internal/decode"
)

// startSidecarAt is startSidecar on a given bridge socket (a restart reuses it).
func startSidecarAt(t *testing.T, role, id, cp, sock string, extra ...string) *sidecarProc {
	t.Helper()
	evlog := filepath.Join(t.TempDir(), "events.jsonl")
	args := append([]string{"--worker-id", id, "--bridge-socket", sock, "--event-log", evlog, "--transport", "tcp",
		"--transfer-conns", "2", "--log-level", "debug", "--heartbeat", "100ms", "--control-plane", cp}, extra...)
	p := start(t, id, bins["kvc-sidecar-"+role], args...)
	return &sidecarProc{proc: p, id: id, events: evlog, peerAddr: p.ReadyString("peer_addr"), httpAddr: p.ReadyString("http_addr"), transfer: p.ReadyString("transfer_endpoint")}
}

// startSim runs a kvc-sim worker next to the sidecar on sock; its pool lives in shmDir.
func startSim(t *testing.T, role, id, sock, shmDir string) *proc {
	t.Helper()
	if bins["kvc-sim"] == "" {
		t.Fatal("kvc-sim binary not available")
	}
	return start(t, "sim-"+id, bins["kvc-sim"], "--role", role, "--worker-id", id, "--bridge-socket", sock, "--http-addr", "127.0.0.1:0",
		"--kv-capacity-tokens", "8192", "--page-size", itoa(pageSize), "--layers", itoa(numLayers), "--bytes-per-token-per-buffer", itoa(tokenBytes),
		"--time-scale", "0.01", "--shm-dir", shmDir, "--log-level", "debug", "--bridge-wait", "30s")
}

// simPrefill is a prefill sidecar with a kvc-sim prefill worker beside it.
type simPrefill struct {
	sc  *sidecarProc
	url string
}

func startSimPrefill(t *testing.T, id, cp string) *simPrefill {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "p.sock")
	sc := startSidecarAt(t, "prefill", id, cp, sock, "--store-capacity-bytes", "8388608")
	sim := startSim(t, "prefill", id, sock, t.TempDir())
	return &simPrefill{sc: sc, url: "http://" + sim.ReadyString("http_addr")}
}

// postGenerate POSTs a /generate body and returns the status and the answer.
func postGenerate(url string, body map[string]any) (int, string, error) {
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+"/generate", "application/json", bytes.NewReader(b))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var out bytes.Buffer
	_, _ = out.ReadFrom(resp.Body)
	return resp.StatusCode, out.String(), nil
}

// seedSession runs one SEED turn of session s of n input tokens the way the gateway does: the
// prefill kvc-sim prefills and sends its KV (SendKV) while the decode kvc-sim at simURL
// receives it (PrepareReceive/WaitReceive, verified) and keeps the session.
func seedSession(t *testing.T, simURL string, p *simPrefill, s string, room, n int64) {
	t.Helper()
	var wg sync.WaitGroup
	var pCode int
	var pBody string
	var pErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		pCode, pBody, pErr = postGenerate(p.url, map[string]any{"rid": "p-" + s, "sampling_params": map[string]any{"max_new_tokens": 0},
			"kv_hints": hintsOf(&kvcv1.ExecutionPayload{Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, SessionId: s, InputTokens: n,
				Send: &kvcv1.ExecutionSend{Room: room}})})
	}()
	code, body, err := postGenerate(simURL, map[string]any{"rid": "d-" + s, "sampling_params": map[string]any{"max_new_tokens": 4},
		"session_params": map[string]any{"id": s},
		"kv_hints": hintsOf(&kvcv1.ExecutionPayload{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, SessionId: s, InputTokens: n,
			KeepSession: true, OpenSession: true,
			Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Room: room, PeerAddr: p.sc.peerAddr}})})
	wg.Wait()
	if err != nil || code != 200 || pErr != nil || pCode != 200 {
		t.Fatalf("seed %s: decode HTTP %d %s (%v); prefill HTTP %d %s (%v)", s, code, body, err, pCode, pBody, pErr)
	}
}

func sidecarSessions(t *testing.T, d *sidecarProc) map[string]int64 {
	var ss []decode.SessionInfo
	out := map[string]int64{}
	if code := getJSON(t, "http://"+d.httpAddr+"/v1/sessions", &ss); code != 200 {
		return out
	}
	for _, s := range ss {
		out[s.SessionID] = s.CommittedLen
	}
	return out
}

// TestSidecarRestartReattach: kill -9 of a decode sidecar under a live kvc-sim worker with
// resident sessions; the restarted sidecar is ready, READY in the control plane and holds the
// sessions again within 5 s, without touching the worker (issue 16, finding 1), and the control
// plane names their snapshot targets again from the full resync. Also: the
// worker's pool file never shows in its shm directory (finding 6), even after kill -9.
func TestSidecarRestartReattach(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-controlplane"] == "" || bins["kvc-sim"] == "" {
		t.Fatal("kvc-controlplane or kvc-sim binary not available")
	}
	etcd := etcdtest.Start(t)
	cp := startCP(t, "cp-a", etcd.Endpoints())
	leaderOf(t, cp)
	p := startSimPrefill(t, "rp", cp.addr)
	sock := filepath.Join(t.TempDir(), "d.sock")
	shmDir := t.TempDir()
	d := startSidecarAt(t, "decode", "rd1", cp.addr, sock)
	sim := startSim(t, "decode", "rd1", sock, shmDir)
	simURL := "http://" + sim.ReadyString("http_addr")
	workerState := func() kvcv1.WorkerState {
		r, err := cp.admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
		if err != nil {
			return 0
		}
		for _, w := range r.GetWorkers() {
			if w.GetWorkerId() == "rd1" {
				return w.GetState()
			}
		}
		return 0
	}
	resident := func(s string) string {
		r, err := cp.admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: s})
		if err != nil {
			return ""
		}
		return r.GetSession().GetDecodeWorker()
	}
	waitFor(t, "rd1 READY", 20*time.Second, func() bool { return workerState() == kvcv1.WorkerState_WORKER_STATE_READY })
	if ents, _ := os.ReadDir(shmDir); len(ents) != 0 {
		t.Fatalf("kvc-sim's pool file is visible in its shm dir: %v", ents)
	}
	sessions := []string{"ra", "rb", "rc"}
	for i, s := range sessions {
		seedSession(t, simURL, p, s, int64(9100+i), int64(200+100*i))
	}
	before := sidecarSessions(t, d)
	if len(before) != 3 {
		t.Fatalf("sidecar holds %v before the kill", before)
	}
	waitFor(t, "sessions resident on rd1 in the control plane", 10*time.Second, func() bool {
		for _, s := range sessions {
			if resident(s) != "rd1" {
				return false
			}
		}
		return true
	})

	d.Kill() // kill -9: no goodbye to the worker or the control plane
	waitFor(t, "rd1 not READY after its sidecar died", 20*time.Second, func() bool { return workerState() != kvcv1.WorkerState_WORKER_STATE_READY })
	// KVC_E2E_SIDECAR_OUTAGE keeps the sidecar down longer (a duration): the worker's
	// reconnects back off meanwhile, and the bound still holds from the restart on.
	if v := os.Getenv("KVC_E2E_SIDECAR_OUTAGE"); v != "" {
		outage, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("KVC_E2E_SIDECAR_OUTAGE: %v", err)
		}
		time.Sleep(outage) // the outage is this test's input
	}
	bound := 5 * time.Second // docs/reliability.md: a sidecar restart recovers within 5 s of the process being back
	if v := os.Getenv("KVC_E2E_REATTACH_BOUND"); v != "" {
		var err error
		if bound, err = time.ParseDuration(v); err != nil {
			t.Fatalf("KVC_E2E_REATTACH_BOUND: %v", err)
		}
	}
	d2 := startSidecarAt(t, "decode", "rd1", cp.addr, sock)
	back := time.Now() // the process is back (its ready file is written when it serves)
	var readyAt, cpReadyAt, sessionsAt time.Duration
	waitFor(t, "the restarted sidecar ready, READY in the control plane, sessions resident again", bound, func() bool {
		if readyAt == 0 {
			if code, _ := httpText(t, "http://"+d2.httpAddr+"/readyz"); code == 200 {
				readyAt = time.Since(back)
			}
		}
		if sessionsAt == 0 && len(sidecarSessions(t, d2)) == 3 {
			sessionsAt = time.Since(back)
		}
		if cpReadyAt == 0 && workerState() == kvcv1.WorkerState_WORKER_STATE_READY {
			cpReadyAt = time.Since(back)
		}
		if readyAt == 0 || sessionsAt == 0 || cpReadyAt == 0 {
			return false
		}
		for _, s := range sessions {
			if resident(s) != "rd1" {
				return false
			}
		}
		return true
	})
	total := time.Since(back)
	after := sidecarSessions(t, d2)
	for s, n := range before {
		if after[s] != n {
			t.Fatalf("after the restart the sidecar holds %v; before %v", after, before)
		}
	}
	t.Logf("sidecar back → /readyz 200 in %v, sessions re-committed in %v, READY in the control plane in %v, residency reconciled in %v",
		readyAt.Round(time.Millisecond), sessionsAt.Round(time.Millisecond), cpReadyAt.Round(time.Millisecond), total.Round(time.Millisecond))
	fmt.Fprintf(os.Stderr, "reattach: readyz %v sessions %v cp_ready %v reconciled %v\n", readyAt, sessionsAt, cpReadyAt, total)

	// The control plane names the re-committed sessions' snapshot target again (the full
	// resync lists them without one; targets lived only in the dead sidecar's memory).
	waitFor(t, "snapshot targets named again after the restart", 5*time.Second, func() bool {
		var ss []decode.SessionInfo
		if getJSON(t, "http://"+d2.httpAddr+"/v1/sessions", &ss) != 200 || len(ss) != 3 {
			return false
		}
		for _, si := range ss {
			if si.PrefillWorker != "rp" {
				return false
			}
		}
		return true
	})

	// A direct-to-D turn of a re-committed session is served from its KV on the worker.
	code, answer, err := postGenerate(simURL, map[string]any{"rid": "r-ra-2", "sampling_params": map[string]any{"max_new_tokens": 2},
		"session_params": map[string]any{"id": "ra"},
		"kv_hints": hintsOf(&kvcv1.ExecutionPayload{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, SessionId: "ra",
			InputTokens: before["ra"] + 10, CachedTokens: before["ra"], KeepSession: true})})
	if err != nil || code != 200 {
		t.Fatalf("direct turn after the restart: HTTP %d %s (%v)", code, answer, err)
	}
	waitFor(t, "the direct turn's commit on the restarted sidecar", 5*time.Second, func() bool { return sidecarSessions(t, d2)["ra"] > before["ra"] })

	// SIGTERM: the sidecar ends the worker's command stream and exits without waiting out the
	// bridge's graceful-stop grace (5 s).
	stopAt := time.Now()
	_ = d2.Stop(10 * time.Second)
	if took := time.Since(stopAt); took > 3*time.Second {
		t.Fatalf("the sidecar took %v to stop with a watching worker", took)
	} else {
		t.Logf("sidecar stopped in %v with the worker watching", took.Round(time.Millisecond))
	}

	// kill -9 of the worker leaves no pool file behind.
	sim.Kill()
	ents, _ := os.ReadDir(shmDir)
	names := []string{}
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	if len(names) != 0 {
		t.Fatalf("kill -9 of kvc-sim left %v in its shm dir", names)
	}
}

// TestPrefillSidecarRestartReattach: kill -9 of a prefill sidecar under a live kvc-sim prefill
// worker; the restarted sidecar gets the pool again from the worker's watcher and is READY in
// the control plane within 5 s.
func TestPrefillSidecarRestartReattach(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-controlplane"] == "" || bins["kvc-sim"] == "" {
		t.Fatal("kvc-controlplane or kvc-sim binary not available")
	}
	etcd := etcdtest.Start(t)
	cp := startCP(t, "cp-a", etcd.Endpoints())
	leaderOf(t, cp)
	sock := filepath.Join(t.TempDir(), "p.sock")
	p := startSidecarAt(t, "prefill", "rp1", cp.addr, sock, "--store-capacity-bytes", "8388608")
	startSim(t, "prefill", "rp1", sock, t.TempDir())
	ready := func() bool {
		r, err := cp.admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
		if err != nil {
			return false
		}
		for _, w := range r.GetWorkers() {
			if w.GetWorkerId() == "rp1" {
				return w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY
			}
		}
		return false
	}
	waitFor(t, "rp1 READY", 20*time.Second, ready)
	var st1 sidecar.Status
	getJSON(t, "http://"+p.httpAddr+"/v1/status", &st1)
	p.Kill()
	waitFor(t, "rp1 not READY after its sidecar died", 20*time.Second, func() bool { return !ready() })
	p2 := startSidecarAt(t, "prefill", "rp1", cp.addr, sock, "--store-capacity-bytes", "8388608")
	back := time.Now()
	waitFor(t, "the restarted prefill sidecar READY", 5*time.Second, func() bool {
		code, _ := httpText(t, "http://"+p2.httpAddr+"/readyz")
		return code == 200 && ready()
	})
	var st sidecar.Status
	if code := getJSON(t, "http://"+p2.httpAddr+"/v1/status", &st); code != 200 || !st.PoolRegistered || !st.Watcher.Connected ||
		!st.Watcher.AttachAcked || st.SidecarInstance == st1.SidecarInstance || st.SidecarInstance == "" {
		t.Fatalf("status after the restart %+v (before %+v)", st, st1)
	}
	t.Logf("prefill sidecar back → ready and READY in the control plane in %v", time.Since(back).Round(time.Millisecond))
}

// hintsOf is the kv_hints envelope carrying p, as the gateway sends it.
func hintsOf(p *kvcv1.ExecutionPayload) *kvhints.Envelope {
	env, err := kvhints.Build("m", p)
	if err != nil {
		panic(err)
	}
	return env
}
