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
// decode worker keeps the KV it holds and receives, and verifies, only the tail.
func TestLocalClusterPrefillFromSnapshot(t *testing.T) {
	dir := binDir(t)
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := Start(ctx, Config{
		BinDir: dir, WorkDir: t.TempDir(), Prefill: 1, Decode: 1, Gateway: true, Log: &log,
		DecodeCapacityTokens: 65536, PrefillCapacityTokens: 65536,
		SimArgs: []string{"--time-scale", "0.05", "--layers", "4", "--bytes-per-token-per-buffer", "16"},
		Policy:  &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(256))},
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
