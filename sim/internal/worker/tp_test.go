package worker

import (
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
)

// A tensor-parallel rank receives from the prefill rank of its own index.
func TestPrefillPeerByRank(t *testing.T) {
	tests := []struct {
		name         string
		rank, size   int32
		peer         string
		peers        []string
		want, errSub string
	}{
		{"no tensor parallelism", 0, 0, "p:1", nil, "p:1", ""},
		{"rank 0 of 2", 0, 2, "p0:1", []string{"p0:1", "p1:1"}, "p0:1", ""},
		{"rank 1 of 2", 1, 2, "p0:1", []string{"p0:1", "p1:1"}, "p1:1", ""},
		{"a list for a worker without tensor parallelism", 0, 0, "p0:1", []string{"p0:1", "p1:1"}, "", "has 2 ranks; this worker is rank 0 of tp_size 1"},
		{"unequal tensor parallelism", 1, 4, "p0:1", []string{"p0:1", "p1:1"}, "", "has 2 ranks; this worker is rank 1 of tp_size 4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &Worker{cfg: Config{TPRank: tt.rank, TPSize: tt.size}}
			got, err := w.prefillPeer(&plan{peer: tt.peer, peers: tt.peers})
			if tt.errSub != "" {
				if err == nil || err.status != 400 || !strings.Contains(err.msg, tt.errSub) {
					t.Fatalf("prefillPeer: %q, %v; want an error with %q", got, err, tt.errSub)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("prefillPeer: %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// Each rank's KV is its own shard: rank 0's content is the pattern every kvc-sim without tensor
// parallelism writes, and another rank's bytes do not verify as rank 0's (a transfer paired
// with the wrong rank is caught by the receiver's check).
func TestRankKeyShards(t *testing.T) {
	if rankKey(0) != contentKey || rankKey(1) == contentKey || rankKey(1) == rankKey(2) {
		t.Fatalf("keys %x %x %x", rankKey(0), rankKey(1), rankKey(2))
	}
	tok := make([]byte, 64)
	kvpool.FillTokenContent(tok, rankKey(1), 4242, 17, 3)
	if !kvpool.CheckTokenContent(tok, rankKey(1), 4242, 17, 3) || kvpool.CheckTokenContent(tok, rankKey(0), 4242, 17, 3) {
		t.Fatal("rank 1's shard verifies as rank 0's")
	}
}
