package cluster

import (
	"fmt"
	"net/http"
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
	c, ctx := startCluster(t, Config{Prefill: 1, Decode: 3, ControlPlanes: 1, Policy: &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(16))}})

	// Nine sessions, one seed turn each; their snapshots reach the prefill store.
	texts := map[string]string{}
	on := map[string]string{}
	byD := map[string][]string{}
	for i := 0; i < 9; i++ {
		s := fmt.Sprintf("rh-%d", i)
		texts[s] = strings.Repeat(fmt.Sprintf("session %d words ", i), 60)
		r := firstTurn(t, c, c.GatewayURL, s, "SEED", request{text: texts[s]})
		d := r.header.Get("X-Kvc-Decode-Worker")
		on[s] = d
		byD[d] = append(byD[d], s)
	}
	victim, moved := killMostHeld(t, c, byD)

	// Without any request: each of its sessions becomes resident on another READY decode worker.
	killed := time.Now()
	waitRehomed(t, ctx, c, victim, moved)
	t.Logf("%d sessions of %s resident elsewhere %v after the kill", len(moved), victim, time.Since(killed).Round(time.Millisecond))

	// Their next turns find them resident: DIRECT_TO_D on the new worker, reusing the loaded KV
	// (kvc-sim checks the held prefix's bytes before it reuses them), no reseed.
	for _, s := range moved {
		r := generate(t, c.GatewayURL, s, texts[s]+" and one more question")
		k := served(t, s+"'s next turn", r, "DIRECT_TO_D", "")
		if d := r.header.Get("X-Kvc-Decode-Worker"); k["verify_failures"] != float64(0) || d == victim || d == "" {
			t.Fatalf("%s's next turn on %q, want off %s, verified: %v", s, d, victim, r.meta)
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
