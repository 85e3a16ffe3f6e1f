package cluster

import (
	"strconv"
	"strings"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLocalClusterPrefillFromSnapshot (issue 20 item 2) through every real process — etcd, the
// control-plane pair, the gateway, the sidecars and kvc-sim workers: a session of ~16K tokens
// whose next turn appends ~9K (over the direct limit) is served as the large append from the
// snapshot. The prefill worker loads the session's snapshot prefix from its sidecar's store
// (every loaded byte verified; kvc_sim_store_load_tokens_total) and prefills only the rest; the
// decode worker keeps the KV it holds and receives, and verifies, only the tail. Then, with
// local large appends on, the next ~9K-token append is prefilled by the session's idle decode
// worker itself (DIRECT_TO_D / LOCAL_LARGE_APPEND): nothing received, nothing loaded on P, the
// session grown on D by the whole append.
func TestLocalClusterPrefillFromSnapshot(t *testing.T) {
	c, ctx := startCluster(t, Config{
		Prefill: 1, Decode: 1, DecodeCapacityTokens: 65536, PrefillCapacityTokens: 65536,
		Policy: &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(256)), LocalAppendMaxTokens: ptr(int64(0))},
	})
	const perToken = simLayers * 2 * simBytesPerTokenPerBuffer   // K and V
	text := strings.Repeat("lorem ipsum dolor sit amet ", 2_450) // ~16K tokens
	r1 := generate(t, c.GatewayURL, "fs-1", text)
	served(t, "turn 1", r1, "SEED", "")
	held := r1.kvLenAfter()
	if held < 15_000 {
		t.Fatalf("turn 1 holds %d tokens, want ~16K", held)
	}
	waitSnapshot(t, c, "fs-1", held)
	p := prefillWorker(t, c)
	before := shownCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total")

	text2 := text + strings.Repeat(" a large tool output", 1_800) // ~9K tokens more
	r2 := generate(t, c.GatewayURL, "fs-1", text2)
	k2 := served(t, "turn 2, the large append", r2, "PD_FALLBACK", "REAL_LARGE_APPEND")
	input := int64(r2.meta["prompt_tokens"].(float64))
	from, _ := k2["received_from"].(float64)
	if int64(from) != held/16*16 || input-held < 8_000 {
		t.Fatalf("turn 2 (%d tokens): D received from %v, want %d (what it held, in whole pages)", input, from, held/16*16)
	}
	if k2["verify_failures"] != float64(0) || k2["received_bytes"] != k2["verified_bytes"] ||
		int64(k2["received_bytes"].(float64)) != (input-int64(from))*perToken {
		t.Fatalf("turn 2: D received %v bytes, verified %v (%v failures); want the tail's %d", k2["received_bytes"],
			k2["verified_bytes"], k2["verify_failures"], (input-int64(from))*perToken)
	}
	loaded := shownCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total") - before
	if int64(loaded) != held/16*16 {
		t.Fatalf("P loaded %v tokens from its store, want the snapshot's %d whole-page tokens", loaded, held/16*16)
	}
	t.Logf("turn 2: %d tokens on a session holding %d: P loaded %v from its store, D received %v bytes from token %v",
		input, held, loaded, k2["received_bytes"], from)
	if bad := shownCounter(t, p.WorkerURL, "kvc_sim_verify_failures_total"); bad != 0 {
		t.Fatalf("P: %v loaded slots failed verification", bad)
	}

	// Turn 3: local large appends on (the default limit), the decode worker idle.
	if err := c.ApplyPolicy(ctx, &kvcv1.Policy{LocalAppendMaxTokens: ptr(int64(16384))}); err != nil {
		t.Fatal(err)
	}
	held2 := r2.kvLenAfter()
	// The control plane has turn 2's outcome (its reservation on D released: D's batch is empty).
	waitFor(t, func() bool {
		n := 0.0
		for _, u := range c.ControlPlaneHTTP {
			n += counter(t, u, "kvc_router_outcomes_total")
		}
		return n >= 2
	}, func() string { return "the control plane never had turn 2's outcome" })
	loads := shownCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total")
	text3 := text2 + strings.Repeat(" another large tool output", 1_500) // ~9K tokens more
	r3 := generate(t, c.GatewayURL, "fs-1", text3)
	k3 := served(t, "turn 3", r3, "DIRECT_TO_D", "LOCAL_LARGE_APPEND")
	input3 := int64(r3.meta["prompt_tokens"].(float64))
	out3 := int64(r3.meta["completion_tokens"].(float64))
	recv3, _ := k3["received_bytes"].(float64)
	if input3-held2 <= 8_192 || r3.header.Get("X-Kvc-Cached-Tokens") != strconv.FormatInt(held2, 10) ||
		recv3 != 0 || int64(k3["kv_len_after"].(float64)) != input3+out3 {
		t.Fatalf("turn 3 (%d tokens, %d held): cached %s, received %v bytes, kv_len_after %v; want the append prefilled on D",
			input3, held2, r3.header.Get("X-Kvc-Cached-Tokens"), k3["received_bytes"], k3["kv_len_after"])
	}
	if got := shownCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total"); got != loads {
		t.Fatalf("P loaded %v tokens from its store for turn 3, want none", got-loads)
	}
	t.Logf("turn 3: %d tokens on a session holding %d: prefilled on D (%s), nothing received or loaded", input3, held2,
		r3.header.Get("X-Kvc-Reason"))
}
