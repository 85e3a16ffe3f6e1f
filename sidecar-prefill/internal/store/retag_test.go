package store

import (
	"errors"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
)

// TestRetag: after a snapshot reseed (generation 1's snapshot of 10 tokens now lives on D′ as
// generation 2), D′'s first push is an append from 10 that re-tags the entry to generation 2:
// only the new tokens' pages are reserved, the old pages stay, and the entry is generation 2.
func TestRetag(t *testing.T) {
	s := newStore(t, 16, nil, nil)
	_, v1 := mustIngest(t, s, "a", 1, 0, 10) // pages for [0,12)
	r, err := s.ReserveRetag("a", 2, 10, 7, "d1", "", CreditRequest{}, 1)
	if err != nil {
		t.Fatalf("retag reserve: %v", err)
	}
	// tokens [10,17): the tail of page 2 and two new pages
	if r.FirstPage != 2 || len(r.Pages) != 3 || r.Pages[0] != v1.Pages[2] {
		t.Fatalf("retag reservation %+v, entry pages %v", r, v1.Pages)
	}
	if v, _ := s.Get("a"); v.Generation != 1 || v.Seqlen != 10 {
		t.Fatalf("before the commit the entry is still generation 1 of 10 tokens: %+v", v)
	}
	v2, in, err := s.CommitIngest(r.ID)
	if err != nil {
		t.Fatal(err)
	}
	if v2.Generation != 2 || v2.Seqlen != 17 || v2.Source != "d1" || len(v2.Pages) != 5 || in.BaseLen != 10 || in.Tokens != 7 {
		t.Fatalf("after the re-tag: %+v (ingest %+v)", v2, in)
	}
	for i := range v1.Pages {
		if v2.Pages[i] != v1.Pages[i] {
			t.Fatalf("re-tag moved page %d: %v -> %v", i, v1.Pages, v2.Pages)
		}
	}
	// generation 2 appends as usual now; a retry of the re-tag (its answer lost) too
	mustRetag := func(base, tokens int64, from uint64) {
		t.Helper()
		r, err := s.ReserveRetag("a", 2, base, tokens, "d1", "", CreditRequest{}, from)
		if err != nil {
			t.Fatalf("append %d+%d (retag from %d): %v", base, tokens, from, err)
		}
		if _, err := s.Commit(r.ID); err != nil {
			t.Fatal(err)
		}
	}
	mustRetag(17, 3, 1)
	mustRetag(20, 4, 0)
	if v, _ := s.Get("a"); v.Generation != 2 || v.Seqlen != 24 {
		t.Fatalf("after the appends: %+v", v)
	}
}

// TestPeerErrorReasons: every refusal a pusher's retry decision depends on carries its
// PeerError reason (and what the store holds) in the status details.
func TestPeerErrorReasons(t *testing.T) {
	s := newStore(t, 8, nil, nil)
	mustIngest(t, s, "a", 2, 0, 10)
	busy, err := s.Reserve("b", 1, 0, 4, "d0")
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		do     func() error
		want   error
		seqlen int64
		gen    uint64
	}{
		{"append at the wrong base", func() error { _, err := s.Reserve("a", 2, 8, 4, "d0"); return err }, kvxfer.ErrBaseMismatch, 10, 2},
		{"append with nothing stored", func() error { _, err := s.Reserve("z", 1, 8, 4, "d0"); return err }, kvxfer.ErrBaseMismatch, 0, 0},
		{"append of another generation", func() error { _, err := s.Reserve("a", 3, 10, 4, "d0"); return err }, kvxfer.ErrBaseMismatch, 10, 2},
		{"re-tag from a generation not stored", func() error {
			_, err := s.ReserveRetag("a", 3, 10, 4, "d0", "", CreditRequest{}, 1)
			return err
		}, kvxfer.ErrBaseMismatch, 10, 2},
		{"re-tag past the stored seqlen", func() error { // (a base below it cuts back: TestRetagCutBack)
			_, err := s.ReserveRetag("a", 3, 11, 4, "d0", "", CreditRequest{}, 2)
			return err
		}, kvxfer.ErrBaseMismatch, 10, 2},
		{"older generation", func() error { _, err := s.Reserve("a", 1, 0, 4, "d0"); return err }, kvxfer.ErrGenerationStale, 10, 2},
		{"ingest in flight", func() error { _, err := s.Reserve("b", 1, 0, 4, "d0"); return err }, kvxfer.ErrIngestBusy, 0, 0},
		{"larger than the store", func() error { _, err := s.Reserve("c", 1, 0, 400, "d0"); return err }, kvxfer.ErrStoreFull, 0, 0},
		{"unknown credit", func() error {
			_, err := s.ReserveCredit("c", 1, 0, 4, "d0", "w", CreditRequest{Use: 1, ID: 99})
			return err
		}, kvxfer.ErrCreditRefused, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := kvxfer.TypedPeerError(tc.do())
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			var pe *kvxfer.PeerError
			if !errors.As(err, &pe) || pe.Detail.GetStoredSeqlen() != tc.seqlen || pe.Detail.GetStoredGeneration() != tc.gen {
				t.Fatalf("detail %+v, want stored seqlen %d generation %d", pe.Detail, tc.seqlen, tc.gen)
			}
		})
	}
	if err := s.Abort(busy.ID); err != nil {
		t.Fatal(err)
	}
	// a commit whose entry changed under it (replaced by a newer generation's full push)
	r, err := s.Reserve("a", 2, 10, 2, "d0")
	if err != nil {
		t.Fatal(err)
	}
	// a newer generation's full push cannot start while the append is in flight (busy); the
	// entry is removed instead (released), which the commit finds
	s.Release("a")
	if _, err := s.Commit(r.ID); !errors.Is(kvxfer.TypedPeerError(err), kvxfer.ErrSnapshotChanged) {
		t.Fatalf("commit onto a released entry: %v", err)
	}
}
