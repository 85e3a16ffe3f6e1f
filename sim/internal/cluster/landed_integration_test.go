package cluster

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestLocalClusterTransferSlotEndsWhenKVLands through every real process: a seed's KV lands on
// its decode worker, the decode sidecar reports TRANSFER_DONE for the decision's room, and the
// leading control plane ends the decision's transfer slot then — while the turn still decodes
// (its first token is out, 400 more to come, about 2 s), not at its outcome: the transfer no
// longer shuts the worker's LOCAL_LARGE_APPEND path
// (kvc_router_transfers_landed_total{result="released"}; before, no such signal was used and
// the slot held until the outcome).
func TestLocalClusterTransferSlotEndsWhenKVLands(t *testing.T) {
	dir := binDir(t)
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := Start(ctx, Config{
		BinDir: dir, WorkDir: t.TempDir(), Prefill: 1, Decode: 1, Gateway: true, Log: &log,
		DecodeCapacityTokens: 16384, PrefillCapacityTokens: 16384,
		SimArgs: []string{"--time-scale", "1", "--layers", "4", "--bytes-per-token-per-buffer", "16"},
	})
	if err != nil {
		t.Fatalf("start: %v\n%s", err, log.String())
	}
	defer func() { _ = c.Stop() }()
	released := func() float64 {
		var n float64
		for _, u := range c.ControlPlaneHTTP {
			n += cpCounter(t, u, `kvc_router_transfers_landed_total{result="released"}`)
		}
		return n
	}
	b, _ := json.Marshal(map[string]any{
		"text": strings.Repeat("lorem ipsum dolor sit amet ", 300), "stream": true, "session_params": map[string]any{"id": "tl-1"},
		"sampling_params": map[string]any{"max_new_tokens": 400, "ignore_eos": true},
	})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, c.GatewayURL+"/generate", strings.NewReader(string(b)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", "tl-1")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Kvc-Mode") != "SEED" {
		t.Fatalf("turn 1: %d %s\n%s", resp.StatusCode, resp.Header.Get("X-Kvc-Mode"), logs(c))
	}
	sc := bufio.NewScanner(resp.Body)
	if !sc.Scan() { // the first token: the KV has landed
		t.Fatalf("no first token: %v", sc.Err())
	}
	deadline := time.Now().Add(10 * time.Second)
	for released() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the seed's transfer slot did not end while it decoded (released %v)\n%s", released(), logs(c))
		}
		time.Sleep(5 * time.Millisecond) // polling the control plane's metrics
	}
	for sc.Scan() { // the rest of the turn, then its outcome
	}
	if n := released(); n != 1 {
		t.Fatalf("released %v after the outcome, want 1", n)
	}
}

// cpCounter is one series of a control plane's /metrics (0 when absent).
func cpCounter(t *testing.T, url, series string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	return 0
}
