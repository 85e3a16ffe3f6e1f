package cluster

import (
	"bufio"
	"context"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

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
	dir := binDir(t)
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := Start(ctx, Config{
		BinDir: dir, WorkDir: t.TempDir(), Prefill: 1, Decode: 1, Gateway: true, Log: &log,
		DecodeCapacityTokens: 65536, PrefillCapacityTokens: 65536,
		SimArgs: []string{"--time-scale", "0.05", "--layers", "4", "--bytes-per-token-per-buffer", "16"},
		Policy:  &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(256)), LocalAppendMaxTokens: ptr(int64(0))},
	})
	if err != nil {
		t.Fatalf("start: %v\n%s", err, log.String())
	}
	defer func() { _ = c.Stop() }()
	const perToken = 4 * 2 * 16                                  // layers × K and V × bytes per token per buffer
	text := strings.Repeat("lorem ipsum dolor sit amet ", 2_450) // ~16K tokens
	r1 := generate(t, c.GatewayURL, "fs-1", text)
	k1, _ := r1.meta["kvc"].(map[string]any)
	if r1.status != http.StatusOK || r1.header.Get("X-Kvc-Mode") != "SEED" || k1 == nil {
		t.Fatalf("turn 1: %d %s %s\n%s", r1.status, r1.header.Get("X-Kvc-Mode"), r1.body, logs(c))
	}
	held := int64(k1["kv_len_after"].(float64))
	if held < 15_000 {
		t.Fatalf("turn 1 holds %d tokens, want ~16K", held)
	}
	waitSnapshot(t, c, "fs-1", held)
	var p Worker
	for _, w := range c.Workers {
		if w.Role == "prefill" {
			p = w
		}
	}
	before := simCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total")

	text2 := text + strings.Repeat(" a large tool output", 1_800) // ~9K tokens more
	r2 := generate(t, c.GatewayURL, "fs-1", text2)
	k2, _ := r2.meta["kvc"].(map[string]any)
	if r2.status != http.StatusOK || k2 == nil {
		t.Fatalf("turn 2: %d %s\n%s", r2.status, r2.body, logs(c))
	}
	if m, why := r2.header.Get("X-Kvc-Mode"), r2.header.Get("X-Kvc-Reason"); m != "PD_FALLBACK" || why != "REAL_LARGE_APPEND" {
		t.Fatalf("turn 2 ran as %s (%s), want the large append", m, why)
	}
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
	loaded := simCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total") - before
	if int64(loaded) != held/16*16 {
		t.Fatalf("P loaded %v tokens from its store, want the snapshot's %d whole-page tokens", loaded, held/16*16)
	}
	t.Logf("turn 2: %d tokens on a session holding %d: P loaded %v from its store, D received %v bytes from token %v",
		input, held, loaded, k2["received_bytes"], from)
	if bad := simCounter(t, p.WorkerURL, "kvc_sim_verify_failures_total"); bad != 0 {
		t.Fatalf("P: %v loaded slots failed verification", bad)
	}

	// Turn 3: local large appends on (the default limit), the decode worker idle.
	if err := c.ApplyPolicy(ctx, &kvcv1.Policy{LocalAppendMaxTokens: ptr(int64(16384))}); err != nil {
		t.Fatal(err)
	}
	held2 := int64(k2["kv_len_after"].(float64))
	// The control plane has turn 2's outcome (its reservation on D released: D's batch is empty).
	waitFor(t, func() bool {
		n := 0.0
		for _, u := range c.ControlPlaneHTTP {
			n += sumCounter(t, u, "kvc_router_outcomes_total")
		}
		return n >= 2
	}, func() string { return "the control plane never had turn 2's outcome" })
	loads := simCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total")
	text3 := text2 + strings.Repeat(" another large tool output", 1_500) // ~9K tokens more
	r3 := generate(t, c.GatewayURL, "fs-1", text3)
	k3, _ := r3.meta["kvc"].(map[string]any)
	if r3.status != http.StatusOK || k3 == nil {
		t.Fatalf("turn 3: %d %s\n%s", r3.status, r3.body, logs(c))
	}
	if m, why := r3.header.Get("X-Kvc-Mode"), r3.header.Get("X-Kvc-Reason"); m != "DIRECT_TO_D" || why != "LOCAL_LARGE_APPEND" {
		t.Fatalf("turn 3 ran as %s (%s), want DIRECT_TO_D (LOCAL_LARGE_APPEND)", m, why)
	}
	input3 := int64(r3.meta["prompt_tokens"].(float64))
	out3 := int64(r3.meta["completion_tokens"].(float64))
	recv3, _ := k3["received_bytes"].(float64)
	if input3-held2 <= 8_192 || r3.header.Get("X-Kvc-Cached-Tokens") != strconv.FormatInt(held2, 10) ||
		recv3 != 0 || int64(k3["kv_len_after"].(float64)) != input3+out3 {
		t.Fatalf("turn 3 (%d tokens, %d held): cached %s, received %v bytes, kv_len_after %v; want the append prefilled on D",
			input3, held2, r3.header.Get("X-Kvc-Cached-Tokens"), k3["received_bytes"], k3["kv_len_after"])
	}
	if got := simCounter(t, p.WorkerURL, "kvc_sim_store_load_tokens_total"); got != loads {
		t.Fatalf("P loaded %v tokens from its store for turn 3, want none", got-loads)
	}
	t.Logf("turn 3: %d tokens on a session holding %d: prefilled on D (%s), nothing received or loaded", input3, held2,
		r3.header.Get("X-Kvc-Reason"))
}

// sumCounter sums every series of one counter on a /metrics page (0 when the page has none).
func sumCounter(t *testing.T, url, name string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		if f, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64); err == nil {
			sum += f
		}
	}
	return sum
}

// simCounter reads one unlabelled counter from a kvc-sim's /metrics.
func simCounter(t *testing.T, url, name string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("%s not in %s/metrics", name, url)
	return 0
}
