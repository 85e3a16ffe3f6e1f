package store

import (
	"errors"
	"slices"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
)

// seq is the ids [from, from+n) (a made-up context whose id i is i+1000).
func seq(from, n int64) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(1000 + from + int64(i))
	}
	return out
}

func ingestIDs(t *testing.T, s *Store, sess string, gen uint64, base, tokens int64, retag uint64, ids []int32) View {
	t.Helper()
	r, err := s.ReserveIDs(sess, gen, base, tokens, "d0", "", CreditRequest{}, retag, ids)
	if err != nil {
		t.Fatalf("reserve %s %d+%d: %v", sess, base, tokens, err)
	}
	v, err := s.Commit(r.ID)
	if err != nil {
		t.Fatalf("commit: %v", err)
	}
	return v
}

// TestTokenIDsFollowTheEntry: the ids a push carries become the entry's when they cover
// [0, seqlen) — a full push, appends, a re-tag, a cut back — and an append without ids (or onto
// an entry without them) leaves the entry with none; IDBytes counts 4 bytes a held id, and
// reservations, aborts, evictions and releases keep it exact.
func TestTokenIDsFollowTheEntry(t *testing.T) {
	type step func(t *testing.T, s *Store)
	full := func(gen uint64, n int64, ids bool) step {
		return func(t *testing.T, s *Store) {
			var x []int32
			if ids {
				x = seq(0, n)
			}
			ingestIDs(t, s, "a", gen, 0, n, 0, x)
		}
	}
	from0 := func(gen uint64, base, n int64, retag uint64) step { // an append carrying [0, base+n)
		return func(t *testing.T, s *Store) { ingestIDs(t, s, "a", gen, base, n, retag, seq(0, base+n)) }
	}
	app := func(gen uint64, base, n int64, retag uint64, ids bool) step {
		return func(t *testing.T, s *Store) {
			var x []int32
			if ids {
				x = seq(base, n)
			}
			ingestIDs(t, s, "a", gen, base, n, retag, x)
		}
	}
	tests := []struct {
		name    string
		steps   []step
		gen     uint64
		seqlen  int64
		wantIDs int64 // ids expected for [0, wantIDs); 0: none
	}{
		{"full push with ids", []step{full(1, 10, true)}, 1, 10, 10},
		{"full push without ids", []step{full(1, 10, false)}, 1, 10, 0},
		{"appends with ids", []step{full(1, 10, true), app(1, 10, 5, 0, true), app(1, 15, 3, 0, true)}, 1, 18, 18},
		{"an append without ids drops them", []step{full(1, 10, true), app(1, 10, 5, 0, false)}, 1, 15, 0},
		{"an append with ids onto an entry without", []step{full(1, 10, false), app(1, 10, 5, 0, true)}, 1, 15, 0},
		{"a full push with ids replaces one without", []step{full(1, 10, false), full(2, 12, true)}, 2, 12, 12},
		{"a re-tag keeps them", []step{full(1, 10, true), app(2, 10, 4, 1, true)}, 2, 14, 14},
		{"a re-tag cut back cuts them", []step{full(1, 30, true), app(2, 10, 7, 1, true)}, 2, 17, 17},
		{"a shorter load of a longer entry", []step{full(1, 30, true)}, 1, 13, 13},
		{"an append from 0 onto an entry without (P's seed)", []step{full(1, 10, false), from0(1, 10, 5, 0)}, 1, 15, 15},
		{"an append from 0 onto an entry with ids", []step{full(1, 10, true), from0(1, 10, 5, 0)}, 1, 15, 15},
		{"a re-tag from 0", []step{full(1, 10, false), from0(2, 10, 4, 1)}, 2, 14, 14},
		{"a re-tag cut back from 0", []step{full(1, 30, false), from0(2, 10, 7, 1)}, 2, 17, 17},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, 16, nil, nil)
			for _, st := range tc.steps {
				st(t, s)
			}
			ids, v, err := s.TokenIDs("a", tc.gen, tc.seqlen)
			if err != nil {
				t.Fatal(err)
			}
			if tc.wantIDs == 0 {
				if ids != nil || v.HasIDs {
					t.Fatalf("want no ids, got %d (HasIDs %v)", len(ids), v.HasIDs)
				}
				if s.IDBytes() != 0 {
					t.Fatalf("IDBytes %d with no ids held", s.IDBytes())
				}
				return
			}
			if !slices.Equal(ids, seq(0, tc.wantIDs)) || !v.HasIDs {
				t.Fatalf("ids %v (HasIDs %v), want %v", ids, v.HasIDs, seq(0, tc.wantIDs))
			}
			if got, want := s.IDBytes(), 4*v.Seqlen; got != want {
				t.Fatalf("IDBytes %d, want %d (4 a token of the entry's %d)", got, want, v.Seqlen)
			}
		})
	}
}

// TestTokenIDsBounds: ids must match the range (count, sign) or nothing is reserved; the
// lookup names what is stored when it cannot answer; IDBytes returns to 0 when everything
// left the store.
func TestTokenIDsBounds(t *testing.T) {
	s := newStore(t, 8, nil, nil)
	for _, ids := range [][]int32{seq(0, 9), seq(0, 11), {1, 2, 3, 4, 5, 6, 7, 8, 9, -1}} {
		if _, err := s.ReserveIDs("a", 1, 0, 10, "d0", "", CreditRequest{}, 0, ids); code(err) != codes.InvalidArgument {
			t.Fatalf("reserve with %d ids: %v, want InvalidArgument", len(ids), err)
		}
	}
	ingestIDs(t, s, "x", 1, 0, 4, 0, nil)
	// an append of 6 from 4 takes 6 ids (its range) or 10 (from 0), nothing else
	for _, ids := range [][]int32{seq(0, 5), seq(0, 7), seq(0, 9), seq(0, 11), append(seq(0, 9), -3)} {
		if _, err := s.ReserveIDs("x", 1, 4, 6, "d0", "", CreditRequest{}, 0, ids); code(err) != codes.InvalidArgument {
			t.Fatalf("append with %d ids: %v, want InvalidArgument", len(ids), err)
		}
	}
	s.Release("x")
	if s.Pending() != 0 || s.UsedBytes() != 0 || s.IDBytes() != 0 {
		t.Fatalf("a refused reserve left pending %d, used %d, id bytes %d", s.Pending(), s.UsedBytes(), s.IDBytes())
	}
	if _, _, err := s.TokenIDs("a", 1, 4); code(err) != codes.NotFound {
		t.Fatalf("no entry: %v", err)
	}
	ingestIDs(t, s, "a", 1, 0, 10, 0, seq(0, 10))
	for _, c := range []struct {
		gen    uint64
		seqlen int64
	}{{2, 10}, {1, 11}} {
		_, _, err := s.TokenIDs("a", c.gen, c.seqlen)
		var pe *kvxfer.PeerError
		if code(err) != codes.FailedPrecondition || !errors.As(kvxfer.TypedPeerError(err), &pe) || pe.Detail.GetStoredSeqlen() != 10 || pe.Detail.GetStoredGeneration() != 1 {
			t.Fatalf("gen %d seqlen %d: %v, want FAILED_PRECONDITION naming generation 1 of 10 tokens", c.gen, c.seqlen, err)
		}
	}
	if _, _, err := s.TokenIDs("a", 1, 0); code(err) != codes.InvalidArgument {
		t.Fatalf("seqlen 0: %v", err)
	}
	// a reservation's ids count until it ends; an abort returns them
	r, err := s.ReserveIDs("a", 1, 10, 6, "d0", "", CreditRequest{}, 0, seq(10, 6))
	if err != nil {
		t.Fatal(err)
	}
	if got := s.IDBytes(); got != 4*16 {
		t.Fatalf("IDBytes %d with an entry of 10 and a reservation of 6", got)
	}
	if err := s.Abort(r.ID); err != nil {
		t.Fatal(err)
	}
	if got := s.IDBytes(); got != 40 {
		t.Fatalf("IDBytes %d after the abort, want 40", got)
	}
	if got := s.IDCapacityBytes(); got != 4*8*4 {
		t.Fatalf("IDCapacityBytes %d", got)
	}
	// eviction by a full push of another session, then a release
	ingestIDs(t, s, "b", 1, 0, 30, 0, seq(0, 30)) // 8 pages: "a" is evicted
	if _, ok := s.Get("a"); ok {
		t.Fatal("a was not evicted")
	}
	if got := s.IDBytes(); got != 120 {
		t.Fatalf("IDBytes %d after the eviction, want 120", got)
	}
	s.Release("b")
	if got := s.IDBytes(); got != 0 {
		t.Fatalf("IDBytes %d after the release", got)
	}
}
