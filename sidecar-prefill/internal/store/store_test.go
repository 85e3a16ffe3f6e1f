package store

import (
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

type evictRec struct {
	mu  sync.Mutex
	got []string
}

func (r *evictRec) fn(v View, reason string) {
	r.mu.Lock()
	r.got = append(r.got, v.Session+":"+reason)
	r.mu.Unlock()
}

func newStore(t *testing.T, pages int64, rec *evictRec, now func() time.Time) *Store {
	t.Helper()
	cfg := Config{PageSize: 4, PageBytes: 100, PageCount: pages, Now: now, ReserveTimeout: time.Second}
	if rec != nil {
		cfg.OnEvict = rec.fn
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustIngest(t *testing.T, s *Store, sess string, gen uint64, base, tokens int64) (Reservation, View) {
	t.Helper()
	r, err := s.Reserve(sess, gen, base, tokens, "d0")
	if err != nil {
		t.Fatalf("reserve %s %d+%d: %v", sess, base, tokens, err)
	}
	v, err := s.Commit(r.ID)
	if err != nil {
		t.Fatalf("commit: %v", err)
	}
	return r, v
}

func code(err error) codes.Code { return status.Code(err) }

func TestIncrementalIngest(t *testing.T) {
	s := newStore(t, 16, nil, nil)
	r, v := mustIngest(t, s, "a", 1, 0, 6) // pages for tokens [0,8)
	if v.Seqlen != 6 || len(r.Pages) != 2 || r.FirstPage != 0 {
		t.Fatalf("full: seqlen %d pages %v first %d", v.Seqlen, r.Pages, r.FirstPage)
	}
	r, v = mustIngest(t, s, "a", 1, 6, 5) // tokens [6,11): page 1 (tail) + page 2
	if v.Seqlen != 11 || r.FirstPage != 1 || len(r.Pages) != 2 || r.Pages[0] != v.Pages[1] {
		t.Fatalf("append: seqlen %d reservation %+v entry pages %v", v.Seqlen, r, v.Pages)
	}
	if len(v.Pages) != 3 || v.Pages[0]+1 != v.Pages[1] || v.Pages[1]+1 != v.Pages[2] {
		t.Fatalf("pages not contiguous: %v", v.Pages)
	}
	if got := s.UsedBytes(); got != 300 {
		t.Fatalf("used %d", got)
	}
}

func TestReserveErrors(t *testing.T) {
	s := newStore(t, 8, nil, nil)
	mustIngest(t, s, "a", 5, 0, 8)
	tests := []struct {
		name       string
		sess       string
		gen        uint64
		base, toks int64
		want       codes.Code
		msg        string
	}{
		{"base mismatch", "a", 5, 4, 4, codes.FailedPrecondition, "seqlen 8"},
		{"older generation", "a", 4, 0, 4, codes.FailedPrecondition, "older"},
		{"newer generation append", "a", 6, 8, 4, codes.FailedPrecondition, "seqlen 0"},
		{"unknown session append", "b", 1, 8, 4, codes.FailedPrecondition, "seqlen 0"},
		{"larger than store", "b", 1, 0, 4*9 + 1, codes.ResourceExhausted, "larger than the store"},
		{"zero tokens", "b", 1, 0, 0, codes.InvalidArgument, "bad range"},
		{"negative base", "b", 1, -4, 4, codes.InvalidArgument, "bad range"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := s.Reserve(tt.sess, tt.gen, tt.base, tt.toks, "d")
			if code(err) != tt.want || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("got %v, want %v containing %q", err, tt.want, tt.msg)
			}
		})
	}
	if v, _ := s.Get("a"); v.Seqlen != 8 || v.Generation != 5 {
		t.Fatalf("snapshot changed: %+v", v)
	}
}

func TestNewGenerationReplacesAtCommit(t *testing.T) {
	rec := &evictRec{}
	s := newStore(t, 8, rec, nil)
	mustIngest(t, s, "a", 1, 0, 8)
	r, err := s.Reserve("a", 2, 0, 4, "d1")
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := s.Get("a"); v.Generation != 1 || v.Seqlen != 8 {
		t.Fatalf("old snapshot not kept during ingest: %+v", v)
	}
	v, err := s.Commit(r.ID)
	if err != nil || v.Generation != 2 || v.Seqlen != 4 || v.Source != "d1" {
		t.Fatalf("commit: %+v %v", v, err)
	}
	if len(rec.got) != 1 || rec.got[0] != "a:replaced" {
		t.Fatalf("evictions %v", rec.got)
	}
	if s.UsedBytes() != 100 {
		t.Fatalf("old pages not freed: %d", s.UsedBytes())
	}
}

func TestAbortKeepsSnapshot(t *testing.T) {
	s := newStore(t, 8, nil, nil)
	mustIngest(t, s, "a", 1, 0, 5)
	r, err := s.Reserve("a", 1, 5, 8, "d")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reserve("a", 1, 5, 8, "d"); code(err) != codes.Aborted {
		t.Fatalf("second reserve: %v", err)
	}
	if err := s.Abort(r.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.Abort(r.ID); code(err) != codes.NotFound {
		t.Fatalf("double abort: %v", err)
	}
	if _, err := s.Commit(r.ID); code(err) != codes.NotFound {
		t.Fatalf("commit after abort: %v", err)
	}
	v, _ := s.Get("a")
	if v.Seqlen != 5 || len(v.Pages) != 2 || s.UsedBytes() != 200 {
		t.Fatalf("after abort: %+v used %d", v, s.UsedBytes())
	}
}

func TestLRUEvictionByBytes(t *testing.T) {
	rec := &evictRec{}
	s := newStore(t, 4, rec, nil)
	mustIngest(t, s, "a", 1, 0, 8)
	mustIngest(t, s, "b", 1, 0, 8)
	if _, _, ok := s.Acquire("a"); !ok { // touch a: b is now least recent
		t.Fatal("a missing")
	}
	mustIngest(t, s, "c", 1, 0, 4)
	if _, ok := s.Get("b"); ok {
		t.Fatal("b not evicted")
	}
	if len(rec.got) != 1 || rec.got[0] != "b:capacity" {
		t.Fatalf("evictions %v", rec.got)
	}
}

func TestReadersPinPages(t *testing.T) {
	rec := &evictRec{}
	s := newStore(t, 2, rec, nil)
	mustIngest(t, s, "a", 1, 0, 8)
	_, release, ok := s.Acquire("a")
	if !ok {
		t.Fatal("missing")
	}
	if _, err := s.Reserve("b", 1, 0, 4, "d"); code(err) != codes.ResourceExhausted {
		t.Fatalf("reserve while pinned: %v", err)
	}
	release()
	release() // idempotent
	if _, err := s.Reserve("b", 1, 0, 4, "d"); err != nil {
		t.Fatalf("reserve after release: %v", err)
	}
	// a full replacement of a read entry frees its pages only when the reader leaves
	s2 := newStore(t, 4, nil, nil)
	mustIngest(t, s2, "x", 1, 0, 8)
	_, rel, _ := s2.Acquire("x")
	mustIngest(t, s2, "x", 2, 0, 8)
	if s2.UsedBytes() != 400 {
		t.Fatalf("pages of the read entry freed early: %d", s2.UsedBytes())
	}
	rel()
	if s2.UsedBytes() != 200 {
		t.Fatalf("pages not freed after read: %d", s2.UsedBytes())
	}
}

func TestReservationExpires(t *testing.T) {
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	s := newStore(t, 4, nil, clock)
	r, err := s.Reserve("a", 1, 0, 16, "d")
	if err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	now = now.Add(2 * time.Second)
	mu.Unlock()
	s.Expire()
	if s.UsedBytes() != 0 || s.Pending() != 0 {
		t.Fatalf("not expired: used %d pending %d", s.UsedBytes(), s.Pending())
	}
	if _, err := s.Commit(r.ID); code(err) != codes.NotFound {
		t.Fatalf("commit after expiry: %v", err)
	}
}
