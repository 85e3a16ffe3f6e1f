package store

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
)

// cutRec records OnCut calls as "session:generation:seqlen<was".
type cutRec struct{ got []string }

func (r *cutRec) fn(v View, was int64) {
	r.got = append(r.got, fmt.Sprintf("%s:%d:%d<%d", v.Session, v.Generation, v.Seqlen, was))
}

// TestRetagCutBack: a re-tag append whose base is shorter than the stored entry of the generation
// it re-tags (the reseed used only a prefix of the snapshot) cuts the entry back to its base and
// appends the tail, unless the entry is read or pinned. Page size 4; entry "a" of generation 1
// holds 30 tokens (8 pages) before every case.
func TestRetagCutBack(t *testing.T) {
	const pageBytes = 100
	tests := []struct {
		name   string
		pages  int64                        // store pages (16 when 0)
		before func(t *testing.T, s *Store) // after "a" is stored, before the re-tag
		base   int64                        // the re-tag append's base_len
		tokens int64                        // and tokens
		refuse error                        // the re-tag's refusal (nil: accepted)
		after  func(t *testing.T, s *Store, r Reservation, old View)
		// accepted: the reservation's first page, pages, the entry's pages and used pages right
		// after the reserve (before the commit)
		first, resPages, entryPages, used int64
		cuts                              []string
	}{
		{name: "mid-page base: the base's page is shared, the rest freed", base: 10, tokens: 7,
			first: 2, resPages: 3, entryPages: 3, used: 5, cuts: []string{"a:1:10<30"}},
		{name: "page-aligned base: only new pages", base: 8, tokens: 7,
			first: 2, resPages: 2, entryPages: 2, used: 4, cuts: []string{"a:1:8<30"}},
		{name: "a tail past the old seqlen", base: 10, tokens: 40,
			first: 2, resPages: 11, entryPages: 3, used: 13, cuts: []string{"a:1:10<30"}},
		{name: "a cut needs no eviction: the freed pages make room", pages: 10, before: func(t *testing.T, s *Store) {
			mustIngest(t, s, "b", 1, 0, 8) // the store is full
		}, base: 10, tokens: 7, first: 2, resPages: 3, entryPages: 3, used: 7, cuts: []string{"a:1:10<30"}},
		{name: "refused while a reseed reads the entry", before: func(t *testing.T, s *Store) {
			_, release, _ := s.Acquire("a")
			t.Cleanup(release)
		}, base: 10, tokens: 7, refuse: kvxfer.ErrBaseMismatch},
		{name: "refused while a reseed pins the entry", before: func(t *testing.T, s *Store) {
			s.Pin("a")
		}, base: 10, tokens: 7, refuse: kvxfer.ErrBaseMismatch},
		{name: "store full: no cut", pages: 10, before: func(t *testing.T, s *Store) {
			mustIngest(t, s, "b", 1, 0, 8)
			_, release, _ := s.Acquire("b") // not evictable
			t.Cleanup(release)
		}, base: 10, tokens: 34, refuse: kvxfer.ErrStoreFull},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pages := tc.pages
			if pages == 0 {
				pages = 16
			}
			rec, cuts := &evictRec{}, &cutRec{}
			s, err := New(Config{PageSize: 4, PageBytes: pageBytes, PageCount: pages, OnEvict: rec.fn, OnCut: cuts.fn})
			if err != nil {
				t.Fatal(err)
			}
			_, old := mustIngest(t, s, "a", 1, 0, 30)
			if tc.before != nil {
				tc.before(t, s)
			}
			usedBefore := s.UsedBytes()
			r, err := s.ReserveRetag("a", 2, tc.base, tc.tokens, "d1", "", CreditRequest{}, 1)
			if tc.refuse != nil {
				if !errors.Is(kvxfer.TypedPeerError(err), tc.refuse) {
					t.Fatalf("re-tag: %v, want %v", err, tc.refuse)
				}
				// nothing changed: the entry, the pages, no cut reported
				if v, _ := s.Get("a"); v.Seqlen != 30 || v.Generation != 1 || len(v.Pages) != 8 || fmt.Sprint(v.Pages) != fmt.Sprint(old.Pages) {
					t.Fatalf("a refused re-tag changed the entry: %+v", v)
				}
				if s.UsedBytes() != usedBefore || len(cuts.got) != 0 || s.Pending() != 0 {
					t.Fatalf("a refused re-tag: used %d (was %d), cuts %v, pending %d", s.UsedBytes(), usedBefore, cuts.got, s.Pending())
				}
				return
			}
			if err != nil {
				t.Fatalf("re-tag: %v", err)
			}
			if r.FirstPage != tc.first || int64(len(r.Pages)) != tc.resPages {
				t.Fatalf("reservation %+v, want first page %d and %d pages", r, tc.first, tc.resPages)
			}
			v, _ := s.Get("a")
			if v.Seqlen != tc.base || v.Generation != 1 || int64(len(v.Pages)) != tc.entryPages {
				t.Fatalf("entry during the ingest %+v, want [0, %d) of generation 1 in %d pages", v, tc.base, tc.entryPages)
			}
			for i, pg := range v.Pages {
				if pg != old.Pages[i] {
					t.Fatalf("the cut moved page %d: %v -> %v", i, old.Pages, v.Pages)
				}
			}
			if tc.base%4 != 0 && r.Pages[0] != old.Pages[tc.base/4] {
				t.Fatalf("the base's page %d is not the reservation's first: %v", old.Pages[tc.base/4], r.Pages)
			}
			if got := s.UsedBytes(); got != tc.used*pageBytes {
				t.Fatalf("used %d bytes, want %d pages", got, tc.used)
			}
			if fmt.Sprint(cuts.got) != fmt.Sprint(tc.cuts) || len(rec.got) != 0 {
				t.Fatalf("cuts %v (want %v), evictions %v", cuts.got, tc.cuts, rec.got)
			}
			c, err := s.Commit(r.ID)
			if err != nil {
				t.Fatal(err)
			}
			want := ceilDiv(tc.base+tc.tokens, 4)
			if c.Seqlen != tc.base+tc.tokens || c.Generation != 2 || c.Source != "d1" || int64(len(c.Pages)) != want {
				t.Fatalf("after the commit %+v, want [0, %d) of generation 2 in %d pages", c, tc.base+tc.tokens, want)
			}
			if got := s.UsedBytes(); got != tc.used*pageBytes {
				t.Fatalf("used %d bytes after the commit, want %d pages", got, tc.used)
			}
			// generation 2 appends as usual; releasing everything frees every page
			mustIngest(t, s, "a", 2, c.Seqlen, 2)
			s.Release("a")
			s.Release("b")
			if s.UsedBytes() != 0 {
				t.Fatalf("pages leaked: %d bytes used with nothing stored", s.UsedBytes())
			}
		})
	}
}

// TestRetagCutBackEnds: a cut stands whatever becomes of its reservation. Aborted or expired,
// the entry is [0, base) of the old generation in its pages (never claiming the overwritten
// tokens), and a retry of the re-tag appends onto it without cutting again.
func TestRetagCutBackEnds(t *testing.T) {
	for _, end := range []string{"abort", "expiry", "entry released"} {
		t.Run(end, func(t *testing.T) {
			clock := time.Unix(1000, 0)
			cuts := &cutRec{}
			s, err := New(Config{PageSize: 4, PageBytes: 100, PageCount: 16, ReserveTimeout: time.Second, OnCut: cuts.fn,
				Now: func() time.Time { return clock }})
			if err != nil {
				t.Fatal(err)
			}
			_, old := mustIngest(t, s, "a", 1, 0, 30)
			r, err := s.ReserveRetag("a", 2, 10, 7, "d1", "", CreditRequest{}, 1)
			if err != nil {
				t.Fatal(err)
			}
			switch end {
			case "abort":
				if err := s.Abort(r.ID); err != nil {
					t.Fatal(err)
				}
			case "expiry":
				clock = clock.Add(2 * time.Second)
				if in := s.Expire(); len(in) != 1 || in[0].ID != r.ID {
					t.Fatalf("expired %+v", in)
				}
			case "entry released":
				s.Release("a")
				if _, err := s.Commit(r.ID); !errors.Is(kvxfer.TypedPeerError(err), kvxfer.ErrSnapshotChanged) {
					t.Fatalf("commit onto a released entry: %v", err)
				}
				if s.UsedBytes() != 0 {
					t.Fatalf("pages leaked: %d bytes", s.UsedBytes())
				}
				return
			}
			v, ok := s.Get("a")
			if !ok || v.Seqlen != 10 || v.Generation != 1 || len(v.Pages) != 3 || fmt.Sprint(v.Pages) != fmt.Sprint(old.Pages[:3]) {
				t.Fatalf("entry after the %s: %+v", end, v)
			}
			if s.UsedBytes() != 300 {
				t.Fatalf("used %d bytes after the %s, want 3 pages", s.UsedBytes(), end)
			}
			// a reseed of more than [0, base) finds it short (the read path refuses it); the
			// retry appends onto the cut entry
			r, err = s.ReserveRetag("a", 2, 10, 7, "d1", "", CreditRequest{}, 1)
			if err != nil {
				t.Fatalf("retry: %v", err)
			}
			if c, err := s.Commit(r.ID); err != nil || c.Seqlen != 17 || c.Generation != 2 || len(c.Pages) != 5 {
				t.Fatalf("retry's commit %+v %v", c, err)
			}
			if len(cuts.got) != 1 || cuts.got[0] != "a:1:10<30" || s.UsedBytes() != 500 {
				t.Fatalf("cuts %v, used %d", cuts.got, s.UsedBytes())
			}
		})
	}
}

// TestRetagCutBackOnlyRetag: only a re-tag cuts back; a plain append below the stored seqlen, a
// re-tag from a generation not stored and a re-tag not older than the push stay base mismatches.
func TestRetagCutBackOnlyRetag(t *testing.T) {
	s := newStore(t, 16, nil, nil)
	mustIngest(t, s, "a", 2, 0, 30)
	for _, tc := range []struct {
		name       string
		gen, retag uint64
	}{
		{"plain append", 2, 0},
		{"plain append naming its own generation", 2, 2},
		{"re-tag from another generation", 3, 1},
		{"re-tag from a newer generation", 1, 2},
	} {
		_, err := s.ReserveRetag("a", tc.gen, 10, 7, "d1", "", CreditRequest{}, tc.retag)
		if err == nil || !(errors.Is(kvxfer.TypedPeerError(err), kvxfer.ErrBaseMismatch) || errors.Is(kvxfer.TypedPeerError(err), kvxfer.ErrGenerationStale)) {
			t.Fatalf("%s: %v", tc.name, err)
		}
	}
	if v, _ := s.Get("a"); v.Seqlen != 30 || v.Generation != 2 || s.UsedBytes() != 800 {
		t.Fatalf("entry changed: %+v, used %d", v, s.UsedBytes())
	}
}

// TestWriteGuardCutBack: after a cut the writable bytes are exactly the append's tokens: in the
// base's page the tokens ≥ base, the new pages up to base+tokens; the committed tokens below base
// and the freed pages are not writable.
func TestWriteGuardCutBack(t *testing.T) {
	s := newGuardedStore(t, nil)
	_, old := mustIngest(t, s, "a", 1, 0, 14) // pages 0..3
	r, err := s.ReserveRetag("a", 2, 6, 3, "d1", "A", CreditRequest{}, 1)
	if err != nil {
		t.Fatal(err)
	}
	shared, next := old.Pages[1], r.Pages[1] // tokens [4, 8) and [8, 12)
	if r.Pages[0] != shared || len(r.Pages) != 2 {
		t.Fatalf("reservation %+v, entry pages %v", r, old.Pages)
	}
	var freed int64 = -1
	for _, pg := range old.Pages[2:] {
		if pg != next {
			freed = pg
		}
	}
	for _, tt := range []struct {
		name   string
		addr   uint64
		n      uint64
		refuse string
	}{
		{"the base's page from base", gAddr(0, shared, 2), 2 * gTB, ""},
		{"the new page's first token", gAddr(1, next, 0), gTB, ""},
		{"a token below base in the base's page", gAddr(0, shared, 1), gTB, "not inside"},
		{"the committed first page", gAddr(0, old.Pages[0], 0), gTB, "not inside"},
		{"past base+tokens", gAddr(0, next, 0), 2 * gTB, "runs past"},
		{"a page the cut freed", gAddr(0, freed, 0), gTB, "not inside"},
	} {
		err := s.CheckWrite("A", tt.addr, tt.n)
		if tt.refuse == "" && err != nil || tt.refuse != "" && (err == nil || !strings.Contains(err.Error(), tt.refuse)) {
			t.Fatalf("%s: %v (want refusal %q)", tt.name, err, tt.refuse)
		}
	}
	if _, err := s.Commit(r.ID); err != nil {
		t.Fatal(err)
	}
	for pg := range s.gpages {
		if g := s.gpages[pg].Load(); g != nil {
			t.Fatalf("page %d still writable with nothing in flight", pg)
		}
	}
}
