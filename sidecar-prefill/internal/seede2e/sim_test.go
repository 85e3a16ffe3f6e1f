package seede2e

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// simGenerate posts a /generate body to a kvc-sim worker, as the gateway builds it (the decision
// in SGLang's kv_hints envelope), and returns the answer's meta_info.kvc.
func simGenerate(t *testing.T, url string, payload *kvcv1.ExecutionPayload, extra map[string]any) map[string]any {
	t.Helper()
	env, err := kvhints.Build("m1", payload)
	if err != nil {
		t.Fatal(err)
	}
	b := map[string]any{"rid": "r1", "text": "hello", "stream": false, "sampling_params": map[string]any{"max_new_tokens": 4},
		"kv_hints": env}
	for k, v := range extra {
		b[k] = v
	}
	raw, _ := json.Marshal(b)
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Post(url+"/generate", "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", url, resp.StatusCode, body)
	}
	var ans struct {
		MetaInfo struct {
			KVC map[string]any `json:"kvc"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal(body, &ans); err != nil {
		t.Fatalf("answer %s: %v", body, err)
	}
	return ans.MetaInfo.KVC
}

// TestSimSeedThroughStore: kvc-sim follows the store-seed contract with real sidecars: its P
// (kv_hints to_store, generation) sends the prompt into its sidecar's store and answers; its D
// (a SEED with snapshot_seqlen and a room of its own) loads it from the store and verifies every
// byte against the session's known pattern.
func TestSimSeedThroughStore(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-sim"] == "" {
		t.Fatal("kvc-sim not built")
	}
	p0 := startSidecar(t, "prefill", "p0", "--store-capacity-bytes", "67108864")
	d1 := startSidecar(t, "decode", "d1")
	sim := func(role, id string, sc *sidecarProc) string {
		r := startProc(t, "sim-"+id, bins["kvc-sim"], "--role", role, "--worker-id", id, "--bridge-socket", sc.str("bridge_socket"),
			"--shm-dir", t.TempDir(), "--kv-capacity-tokens", "4096", "--time-scale", "0.01", "--layers", "4")
		if u, _ := r["http_addr"].(string); u != "" {
			return "http://" + u
		}
		t.Fatalf("kvc-sim ready file %v", r)
		return ""
	}
	purl, durl := sim("prefill", "p0", p0), sim("decode", "d1", d1)
	const input = 200
	peer := p0.str("peer_addr")
	k := simGenerate(t, purl, &kvcv1.ExecutionPayload{Mode: kvcv1.RouteMode_ROUTE_MODE_SEED, Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL,
		SessionId: "S", InputTokens: input, Send: &kvcv1.ExecutionSend{Room: 77, StoreGeneration: 1}}, map[string]any{"bootstrap_room": 77})
	const bpt = 2 * 4 * 16 // kvc-sim: 4 layers, 16 bytes per token per buffer
	if sent, _ := k["sent_bytes"].(float64); int64(sent) != input*bpt {
		t.Fatalf("P's meta %v, want %d bytes sent", k, input*bpt)
	}
	st, err := p0.bridge.SnapshotStatus(ctxT(t, time.Second), &kvcv1.SnapshotStatusRequest{SessionId: "S"})
	if err != nil || !st.GetExists() || st.GetSeqlen() != input || st.GetGeneration() != 1 {
		t.Fatalf("store: %v %v", st, err)
	}
	k = simGenerate(t, durl, &kvcv1.ExecutionPayload{Mode: kvcv1.RouteMode_ROUTE_MODE_SEED, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE,
		SessionId: "S", InputTokens: input, KeepSession: true, OpenSession: true,
		Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Room: 78, PeerAddr: peer, Tokens: input}},
		map[string]any{"session_params": map[string]any{"id": "S"}})
	recv, _ := k["received_bytes"].(float64)
	ver, _ := k["verified_bytes"].(float64)
	bad, _ := k["verify_failures"].(float64)
	kv, _ := k["kv_len_after"].(float64)
	if int64(recv) != input*bpt || int64(ver) != input*bpt || bad != 0 || int64(kv) != input+4 {
		t.Fatalf("D's meta %v: want %d bytes received and verified, kv_len_after %d", k, input*bpt, input+4)
	}
}
