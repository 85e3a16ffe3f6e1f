package cluster

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A decode worker holding sessions dies: every one of its sessions with a snapshot becomes
// resident on another decode worker without a client request (re-homing: the router's
// RESEED_SNAPSHOT with reason REHOME, the sidecar's LoadSessionCommand into kvc-sim, which
// verifies every received byte), and each next turn is DIRECT_TO_D there on the whole snapshot.
// On the code before re-homing the sessions stay without residency until their next turn
// (which reseeds), so the wait below fails.
func TestRehomeDeadDecodeWorker(t *testing.T) {
	dir := binDir(t)
	work := t.TempDir()
	if d := os.Getenv("CLUSTER_IT_WORKDIR"); d != "" {
		work = d
	}
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c, err := Start(ctx, Config{
		BinDir: dir, WorkDir: work, Prefill: 1, Decode: 3, ControlPlanes: 1, Gateway: true, Log: &log,
		DecodeCapacityTokens: 16384, PrefillCapacityTokens: 65536,
		SimArgs: []string{"--time-scale", "0.05", "--layers", "4", "--bytes-per-token-per-buffer", "16"},
		Policy:  &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(16))},
	})
	if err != nil {
		t.Fatalf("start: %v\n%s", err, log.String())
	}
	defer func() { _ = c.Stop() }()

	// Nine sessions, one seed turn each; their snapshots reach the prefill store.
	texts := map[string]string{}
	on := map[string]string{}
	byD := map[string][]string{}
	for i := 0; i < 9; i++ {
		s := fmt.Sprintf("rh-%d", i)
		texts[s] = strings.Repeat(fmt.Sprintf("session %d words ", i), 60)
		r := generate(t, c.GatewayURL, s, texts[s])
		if r.status != http.StatusOK || r.header.Get("X-Kvc-Mode") != "SEED" {
			t.Fatalf("%s: %d %s %s\n%s", s, r.status, r.header.Get("X-Kvc-Mode"), r.body, logs(c))
		}
		d := r.header.Get("X-Kvc-Decode-Worker")
		on[s] = d
		byD[d] = append(byD[d], s)
		waitSnapshot(t, c, s, int64(r.meta["kvc"].(map[string]any)["kv_len_after"].(float64)))
	}
	victim := ""
	for d, ss := range byD {
		if victim == "" || len(ss) > len(byD[victim]) || (len(ss) == len(byD[victim]) && d < victim) {
			victim = d
		}
	}
	moved := byD[victim]
	t.Logf("killing %s, which holds %v", victim, moved)
	if err := c.Kill("sim-" + victim); err != nil {
		t.Fatal(err)
	}

	// Without any request: each of its sessions becomes resident on another READY decode worker.
	killed := time.Now()
	session := func(cl kvcv1.AdminServiceClient, ctx context.Context, s string) (*kvcv1.SessionRecord, error) {
		resp, err := cl.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: s})
		return resp.GetSession(), err
	}
	if err := c.retry(ctx, "sessions re-homed", func(ctx context.Context) error {
		return c.onLeader(ctx, func(ctx context.Context, cl kvcv1.AdminServiceClient) error {
			for _, s := range moved {
				rec, err := session(cl, ctx, s)
				if err != nil {
					return err
				}
				if d := rec.GetDecodeWorker(); d == "" || d == victim || rec.GetKvCommittedLen() < rec.GetSnapshot().GetSeqlen() {
					return errNotYet
				}
			}
			return nil
		})
	}); err != nil {
		t.Fatalf("%v\n%s", err, logs(c))
	}
	t.Logf("%d sessions of %s resident elsewhere %v after the kill", len(moved), victim, time.Since(killed).Round(time.Millisecond))

	// Their next turns find them resident: DIRECT_TO_D on the new worker, reusing the loaded KV
	// (kvc-sim checks the held prefix's bytes before it reuses them), no reseed.
	for _, s := range moved {
		r := generate(t, c.GatewayURL, s, texts[s]+" and one more question")
		k, _ := r.meta["kvc"].(map[string]any)
		if r.status != http.StatusOK || k == nil || k["verify_failures"] != float64(0) {
			t.Fatalf("%s after the kill: %d %s %v\n%s", s, r.status, r.body, r.meta, logs(c))
		}
		if m, d := r.header.Get("X-Kvc-Mode"), r.header.Get("X-Kvc-Decode-Worker"); m != "DIRECT_TO_D" || d == victim || d == "" {
			t.Fatalf("%s's next turn ran as %s (%s) on %s, want DIRECT_TO_D off %s", s, m, r.header.Get("X-Kvc-Reason"), d, victim)
		}
		if r.header.Get("X-Kvc-Cached-Tokens") == "0" {
			t.Fatalf("%s's next turn reused nothing: %v", s, r.meta)
		}
	}
	// The sessions elsewhere were not touched.
	for s, d := range on {
		if d == victim {
			continue
		}
		r := generate(t, c.GatewayURL, s, texts[s]+" and one more question")
		if r.status != http.StatusOK || r.header.Get("X-Kvc-Mode") != "DIRECT_TO_D" || r.header.Get("X-Kvc-Decode-Worker") != d {
			t.Fatalf("%s (on %s): %d %s on %s", s, d, r.status, r.header.Get("X-Kvc-Mode"), r.header.Get("X-Kvc-Decode-Worker"))
		}
	}
}
