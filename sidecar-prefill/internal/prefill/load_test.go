package prefill

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLoadFromStore: the prefill from the snapshot copies the snapshot's prefix from the store
// into other pages of the worker's pool, byte for byte (every token of every buffer holds the
// session's known bytes afterwards, and nothing past the prefix is written); a load of another
// generation, of more tokens than the store holds, or of a session it does not hold is refused
// with its stable code and reason, and bad requests are INVALID_ARGUMENT.
func TestLoadFromStore(t *testing.T) {
	ctx := context.Background()
	s, _, logw, pool := seedSidecar(t, Config{})
	seed := kvpool.SessionSeed("s")
	// The session's snapshot (generation 1, 14 tokens) from pages 0-3, through a store seed.
	if err := kvpool.FillTokens(pool, seed, []int64{0, 1, 2, 3}, 0, 14); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SendKV(ctx, seedChunk(5, []int64{0, 1, 2, 3}, 0, true)); err != nil {
		t.Fatal(err)
	}
	dst := []int64{6, 4, 7} // the worker's pages for tokens [0, 12), in token order
	resp, err := s.LoadFromStore(ctx, &kvcv1.LoadFromStoreRequest{SessionId: "s", Generation: 1, Tokens: 12, Pages: dst})
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetTokens() != 12 || resp.GetSeqlen() != 14 || resp.GetGeneration() != 1 || resp.GetBytes() != 12*2*8 {
		t.Fatalf("answer %v", resp)
	}
	if bad, err := kvpool.CheckTokens(pool, seed, dst, 0, 12); err != nil || bad != 0 {
		t.Fatalf("loaded pages: %d of 24 slots wrong (%v)", bad, err)
	}
	if bad, _ := kvpool.CheckTokens(pool, seed, []int64{0, 0, 0, 5}, 12, 14); bad == 0 {
		t.Fatal("page 5 holds the snapshot's tokens 12-13: the load wrote past its prefix")
	}
	var loads int
	for _, e := range logw.events(t) {
		if e.Event == sidecar.EvStoreLoad && e.Session == "s" && e.Tokens == 12 {
			loads++
		}
	}
	if loads != 1 {
		t.Fatalf("%d store loads logged", loads)
	}
	tests := []struct {
		name   string
		req    *kvcv1.LoadFromStoreRequest
		code   codes.Code
		reason kvcv1.PeerErrorReason
	}{
		{"another generation", &kvcv1.LoadFromStoreRequest{SessionId: "s", Generation: 2, Tokens: 12, Pages: dst}, codes.FailedPrecondition, kvcv1.PeerErrorReason_PEER_ERROR_REASON_SNAPSHOT_CHANGED},
		{"more than the store holds", &kvcv1.LoadFromStoreRequest{SessionId: "s", Tokens: 16, Pages: []int64{4, 5, 6, 7}}, codes.FailedPrecondition, kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH},
		{"no snapshot", &kvcv1.LoadFromStoreRequest{SessionId: "t", Tokens: 4, Pages: []int64{4}}, codes.NotFound, 0},
		{"pages do not cover the tokens", &kvcv1.LoadFromStoreRequest{SessionId: "s", Tokens: 12, Pages: []int64{4, 5}}, codes.InvalidArgument, 0},
		{"a page outside the pool", &kvcv1.LoadFromStoreRequest{SessionId: "s", Tokens: 4, Pages: []int64{99}}, codes.OutOfRange, 0},
		{"no tokens", &kvcv1.LoadFromStoreRequest{SessionId: "s", Pages: []int64{4}}, codes.InvalidArgument, 0},
		{"no session", &kvcv1.LoadFromStoreRequest{Tokens: 4, Pages: []int64{4}}, codes.InvalidArgument, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := s.LoadFromStore(ctx, tt.req)
			if status.Code(err) != tt.code {
				t.Fatalf("%v, want %s", err, tt.code)
			}
			if tt.reason != 0 {
				var pe *kvxfer.PeerError
				if !errors.As(kvxfer.TypedPeerError(err), &pe) || pe.Reason() != tt.reason {
					t.Fatalf("%v: want reason %s", err, tt.reason)
				}
			}
		})
	}
}

// TestLoadWriteGuard: the write guard lets this sidecar's own segment write into its worker's
// pool (the load's copy out of the store) and nobody else; other memory stays under the
// store's guard.
func TestLoadWriteGuard(t *testing.T) {
	s, _, _, _ := seedSidecar(t, Config{})
	g := s.writeGuard(s.Store())
	self := s.eng.SegmentName()
	rs := *s.poolRanges.Load()
	if len(rs) != 2 {
		t.Fatalf("%d pool ranges, want 2 (K and V)", len(rs))
	}
	tests := []struct {
		name    string
		peer    string
		addr, n uint64
		ok      bool
	}{
		{"own segment into the pool", self, rs[1].lo + 8, 16, true},
		{"own segment, the pool's last bytes", self, rs[0].hi - 8, 8, true},
		{"another peer into the pool", "10.0.0.9:1", rs[0].lo, 8, false},
		{"own segment past the pool", self, rs[1].hi - 8, 16, false},
		{"own segment, wrapping", self, rs[0].lo, ^uint64(0), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := g(tt.peer, tt.addr, tt.n); (err == nil) != tt.ok {
				t.Fatalf("guard: %v, want ok=%v", err, tt.ok)
			}
		})
	}
}
