package cluster

import (
	"fmt"
	"net/http"
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
	c, _ := startCluster(t, Config{
		Prefill: 1, Decode: 1, DecodeCapacityTokens: 16384, PrefillCapacityTokens: 16384,
		SimArgs: []string{"--time-scale", "1", "--layers", "4", "--bytes-per-token-per-buffer", "16"},
	})
	released := func() float64 {
		var n float64
		for _, u := range c.ControlPlaneHTTP {
			n += counter(t, u, `kvc_router_transfers_landed_total{result="released"}`)
		}
		return n
	}
	decoding := false
	r := send(t, c.GatewayURL, "tl-1", request{text: strings.Repeat("lorem ipsum dolor sit amet ", 300), maxNew: 400, ignoreEOS: true,
		afterChunks: 1, during: func(h http.Header) { // the first token: the KV has landed
			decoding = true
			if h.Get("X-Kvc-Mode") != "SEED" {
				t.Fatalf("turn 1 ran as %s (%s)", h.Get("X-Kvc-Mode"), h.Get("X-Kvc-Reason"))
			}
			waitWithin(t, 10*time.Second, func() bool { return released() == 1 }, func() string {
				return fmt.Sprintf("the seed's transfer slot did not end while it decoded (released %v)", released())
			})
		}})
	if r.status != http.StatusOK || !decoding || !r.done { // the rest of the turn, then its outcome
		t.Fatalf("turn 1: %d, a first token %v, done %v: %s", r.status, decoding, r.done, r.body)
	}
	if n := released(); n != 1 {
		t.Fatalf("released %v after the outcome, want 1", n)
	}
}
