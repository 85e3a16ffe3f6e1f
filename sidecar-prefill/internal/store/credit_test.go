package store

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// newCreditStore is a guarded store of 16 pages (geometry of guard_test.go) with credits capped
// at capPages.
func newCreditStore(t *testing.T, capPages int64, clock *fakeClock, rec *evictRec) *Store {
	t.Helper()
	cfg := Config{PageSize: gPS, PageBytes: int64(len(gBufs)) * gItem, PageCount: 16, Buffers: gBufs, Now: clock.Now,
		ReserveTimeout: time.Second, CreditTimeout: time.Minute, CreditMaxPages: capPages}
	if rec != nil {
		cfg.OnEvict = rec.fn
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustCredit(t *testing.T, s *Store, sess string, base, tokens int64, writer string, cr CreditRequest) Reservation {
	t.Helper()
	r, err := s.ReserveCredit(sess, 1, base, tokens, "d0", writer, cr)
	if err != nil {
		t.Fatalf("reserve %s [%d,+%d) %+v: %v", sess, base, tokens, cr, err)
	}
	return r
}

// writable reports whether peer may write the whole of page pg (both buffers).
func writable(s *Store, peer string, pg int64) bool {
	return s.CheckWrite(peer, gAddr(0, pg, 0), gItem) == nil && s.CheckWrite(peer, gAddr(1, pg, 0), gItem) == nil
}

func TestCreditGrantUseTopUp(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0)}
	s := newCreditStore(t, 8, clock, nil)
	// First reservation asks for credit: 1 page reserved, 4 pages of credit granted.
	r := mustCredit(t, s, "a", 0, 4, "W", CreditRequest{Pages: 4})
	c := r.Credit
	if len(r.Pages) != 1 || len(c.Pages) != 4 || c.ID == 0 {
		t.Fatalf("reservation %v credit %+v", r.Pages, c)
	}
	if slices.Contains(c.Pages, r.Pages[0]) {
		t.Fatalf("credit %v overlaps the reservation %v", c.Pages, r.Pages)
	}
	if got := s.UsedBytes(); got != 5*2*gItem {
		t.Fatalf("used %d bytes, want 5 pages", got)
	}
	for _, pg := range c.Pages {
		if !writable(s, "W", pg) {
			t.Fatalf("credit page %d not writable by its writer", pg)
		}
		if writable(s, "V", pg) {
			t.Fatalf("credit page %d writable by another writer", pg)
		}
	}
	if _, err := s.Commit(r.ID); err != nil {
		t.Fatal(err)
	}
	// The next full push of 10 tokens (3 pages) uses 2 credit pages: they lead its pages; the
	// credit keeps its other 2 pages first and is topped up to 4 again under a new id.
	r2 := mustCredit(t, s, "b", 0, 10, "W", CreditRequest{Pages: 4, Use: 2, ID: c.ID})
	if len(r2.Pages) != 3 || !slices.Equal(r2.Pages[:2], c.Pages[:2]) {
		t.Fatalf("reservation %v does not start with credit %v", r2.Pages, c.Pages[:2])
	}
	c2 := r2.Credit
	if c2.ID == c.ID || len(c2.Pages) != 4 || !slices.Equal(c2.Pages[:2], c.Pages[2:]) {
		t.Fatalf("credit after use: %+v (was %+v)", c2, c)
	}
	for _, pg := range c2.Pages {
		if slices.Contains(r2.Pages, pg) {
			t.Fatalf("credit %v overlaps reservation %v", c2.Pages, r2.Pages)
		}
	}
	if got := s.CreditOf("W"); got.ID != c2.ID || !slices.Equal(got.Pages, c2.Pages) {
		t.Fatalf("CreditOf %+v, want %+v", got, c2)
	}
	// A write running across from a (former) credit page into the next reserved page of the
	// same writer is accepted: the pages are contiguous here.
	if r2.Pages[1]+1 == r2.Pages[2] {
		if err := s.CheckWrite("W", gAddr(0, r2.Pages[1], 0), 2*gItem); err != nil {
			t.Fatal(err)
		}
	}
	if got := s.UsedBytes(); got != (1+3+4)*2*gItem || s.CreditPages() != 4 {
		t.Fatalf("used %d bytes, credit %d pages", got, s.CreditPages())
	}
	v, err := s.Commit(r2.ID)
	if err != nil || !slices.Equal(v.Pages, r2.Pages) || v.Seqlen != 10 {
		t.Fatalf("commit %+v %v", v, err)
	}
	// Committed pages taken from credit are read-only again.
	if writable(s, "W", c.Pages[0]) {
		t.Fatal("committed page from credit still writable")
	}
	// An append neither uses nor needs credit; a reservation without credit_pages leaves the
	// credit (and its id) as it is.
	r3 := mustCredit(t, s, "b", 10, 2, "W", CreditRequest{})
	if r3.Credit.ID != c2.ID || !slices.Equal(r3.Credit.Pages, c2.Pages) {
		t.Fatalf("credit changed by a reservation that asked nothing: %+v", r3.Credit)
	}
	// Abort frees the reservation's pages, the ones that came from credit included.
	if _, err := s.Commit(r3.ID); err != nil {
		t.Fatal(err)
	}
	used := s.UsedBytes()
	r4 := mustCredit(t, s, "c", 0, 8, "W", CreditRequest{Use: 2, ID: c2.ID})
	if !slices.Equal(r4.Pages, c2.Pages[:2]) || !slices.Equal(r4.Credit.Pages, c2.Pages[2:]) {
		t.Fatalf("reservation %v credit %+v", r4.Pages, r4.Credit)
	}
	if s.UsedBytes() != used {
		t.Fatalf("a reservation wholly from credit changed the used bytes: %d -> %d", used, s.UsedBytes())
	}
	if err := s.Abort(r4.ID); err != nil {
		t.Fatal(err)
	}
	if s.UsedBytes() != used-2*2*gItem || writable(s, "W", c2.Pages[0]) {
		t.Fatalf("aborted credit pages not freed: used %d", s.UsedBytes())
	}
}

func TestCreditRefusalsConsumeNothing(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0)}
	s := newCreditStore(t, 8, clock, nil)
	r := mustCredit(t, s, "a", 0, 6, "W", CreditRequest{Pages: 3})
	if _, err := s.Commit(r.ID); err != nil {
		t.Fatal(err)
	}
	c := r.Credit
	tests := []struct {
		name   string
		sess   string
		base   int64
		tokens int64
		writer string
		cr     CreditRequest
		want   codes.Code
		msg    string
	}{
		{"stale id", "b", 0, 8, "W", CreditRequest{Use: 1, ID: c.ID - 1, Pages: 3}, codes.FailedPrecondition, "stale"},
		{"no id", "b", 0, 8, "W", CreditRequest{Use: 1}, codes.FailedPrecondition, "stale"},
		{"more than the credit", "b", 0, 16, "W", CreditRequest{Use: 4, ID: c.ID}, codes.FailedPrecondition, "more than the 3 pages of credit"},
		{"more than the push", "b", 0, 4, "W", CreditRequest{Use: 2, ID: c.ID}, codes.FailedPrecondition, "more than the 1 pages of the push"},
		{"append", "a", 6, 4, "W", CreditRequest{Use: 1, ID: c.ID}, codes.FailedPrecondition, "full push"},
		{"another writer's credit", "b", 0, 8, "V", CreditRequest{Use: 1, ID: c.ID}, codes.FailedPrecondition, "holds no credit"},
		{"no writer", "b", 0, 8, "", CreditRequest{Use: 1, ID: c.ID}, codes.InvalidArgument, "source_transfer_endpoint"},
		{"credit without writer", "b", 0, 8, "", CreditRequest{Pages: 2}, codes.InvalidArgument, "source_transfer_endpoint"},
		{"negative", "b", 0, 8, "W", CreditRequest{Pages: -1}, codes.InvalidArgument, "negative"},
		{"session busy", "a", 0, 8, "W", CreditRequest{Use: 1, ID: c.ID}, codes.Aborted, "in flight"},
	}
	busy := mustCredit(t, s, "a", 6, 1, "X", CreditRequest{}) // makes "a" busy for the last case
	used := s.UsedBytes()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := s.ReserveCredit(tt.sess, 1, tt.base, tt.tokens, "d0", tt.writer, tt.cr)
			if code(err) != tt.want || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("got %v, want %v containing %q", err, tt.want, tt.msg)
			}
			if got := s.CreditOf("W"); got.ID != c.ID || !slices.Equal(got.Pages, c.Pages) {
				t.Fatalf("credit changed: %+v, was %+v", got, c)
			}
			if s.UsedBytes() != used || s.Pending() != 1 {
				t.Fatalf("used %d (was %d), pending %d", s.UsedBytes(), used, s.Pending())
			}
			for _, pg := range c.Pages {
				if !writable(s, "W", pg) {
					t.Fatalf("credit page %d no longer writable", pg)
				}
			}
		})
	}
	if err := s.Abort(busy.ID); err != nil {
		t.Fatal(err)
	}
}

func TestCreditFreePagesOnlyAndCap(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0)}
	rec := &evictRec{}
	s := newCreditStore(t, 6, clock, rec)
	// 13 of 16 pages hold snapshots.
	mustIngest(t, s, "a", 1, 0, 8*gPS)
	mustIngest(t, s, "b", 1, 0, 5*gPS)
	tests := []struct {
		name   string
		writer string
		want   int64
		got    int // credit pages granted
	}{
		{"fewer than asked: only the free pages", "W", 8, 2}, // 1 page reserved, 2 left free
		// this reservation evicts a (for itself); its writer's credit then comes from free
		// pages, up to its share of the cap (6 / 2 writers)
		{"up to its share of the cap", "V", 5, 3},
		{"what is left of the cap", "U", 2, 1},
		{"cap reached", "X", 1, 0},
	}
	for i, tt := range tests {
		r := mustCredit(t, s, "s"+string(rune('0'+i)), 0, 1, tt.writer, CreditRequest{Pages: tt.want})
		if len(r.Credit.Pages) != tt.got {
			t.Fatalf("%s: credit %+v, want %d pages", tt.name, r.Credit, tt.got)
		}
		if tt.got == 0 && r.Credit.ID != 0 {
			t.Fatalf("%s: an empty credit has id %d", tt.name, r.Credit.ID)
		}
	}
	// Only the second reservation evicted (for itself, never for credit).
	if len(rec.got) != 1 || rec.got[0] != "a:capacity" {
		t.Fatalf("evictions %v", rec.got)
	}
	// The cap on all credits: with room to spare, a second writer gets only what is left of 6.
	s2 := newCreditStore(t, 6, clock, nil)
	r := mustCredit(t, s2, "x", 0, 1, "W", CreditRequest{Pages: 4})
	r2 := mustCredit(t, s2, "y", 0, 1, "V", CreditRequest{Pages: 4})
	if len(r.Credit.Pages) != 4 || len(r2.Credit.Pages) != 2 || s2.CreditPages() != 6 {
		t.Fatalf("credits %v and %v (%d pages)", r.Credit.Pages, r2.Credit.Pages, s2.CreditPages())
	}
	// W holds more than its share (3 of 6 with two writers): after a use it gets back up to its
	// share only, and V's next reservation takes the room up to its own share.
	r3 := mustCredit(t, s2, "z", 0, 8, "W", CreditRequest{Pages: 4, Use: 2, ID: r.Credit.ID})
	r4 := mustCredit(t, s2, "z2", 0, 1, "V", CreditRequest{Pages: 4})
	if len(r3.Credit.Pages) != 3 || len(r4.Credit.Pages) != 3 || s2.CreditPages() != 6 {
		t.Fatalf("credits after a use %v and %v (%d pages)", r3.Credit.Pages, r4.Credit.Pages, s2.CreditPages())
	}
	// No credits at all with a negative cap.
	s3, err := New(Config{PageSize: 4, PageBytes: 100, PageCount: 16, CreditMaxPages: -1})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := s3.ReserveCredit("x", 1, 0, 4, "d", "W", CreditRequest{Pages: 4}); err != nil || len(r.Credit.Pages) != 0 {
		t.Fatalf("credit with credits off: %+v %v", r.Credit, err)
	}
}

func TestCreditExpires(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0)}
	s := newCreditStore(t, 8, clock, nil)
	r := mustCredit(t, s, "a", 0, 4, "W", CreditRequest{Pages: 4})
	if _, err := s.Commit(r.ID); err != nil {
		t.Fatal(err)
	}
	c := r.Credit
	// A reservation of the writer (even one asking nothing) counts as use.
	clock.Add(50 * time.Second)
	r2 := mustCredit(t, s, "a", 4, 1, "W", CreditRequest{})
	if _, err := s.Commit(r2.ID); err != nil {
		t.Fatal(err)
	}
	clock.Add(50 * time.Second)
	s.Expire()
	if got := s.CreditOf("W"); got.ID != c.ID {
		t.Fatalf("credit expired although used 50s ago: %+v", got)
	}
	used := s.UsedBytes()
	clock.Add(11 * time.Second)
	s.Expire()
	if got := s.CreditOf("W"); got.ID != 0 || s.CreditPages() != 0 || s.UsedBytes() != used-4*2*gItem {
		t.Fatalf("credit not expired: %+v, %d credit pages, used %d", got, s.CreditPages(), s.UsedBytes())
	}
	for _, pg := range c.Pages {
		if writable(s, "W", pg) || writable(s, "V", pg) {
			t.Fatalf("expired credit page %d still writable", pg)
		}
	}
	if _, err := s.ReserveCredit("b", 1, 0, 4, "d0", "W", CreditRequest{Use: 1, ID: c.ID}); code(err) != codes.FailedPrecondition {
		t.Fatalf("use of an expired credit: %v", err)
	}
	// A new grant has a new id.
	r3 := mustCredit(t, s, "b", 0, 4, "W", CreditRequest{Pages: 2})
	if r3.Credit.ID == c.ID || len(r3.Credit.Pages) != 2 {
		t.Fatalf("new credit %+v", r3.Credit)
	}
}

func TestCreditIDsDifferAcrossStores(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0)}
	a := newCreditStore(t, 8, clock, nil)
	b := newCreditStore(t, 8, clock, nil) // a restarted prefill sidecar
	ra := mustCredit(t, a, "x", 0, 4, "W", CreditRequest{Pages: 2})
	rb := mustCredit(t, b, "x", 0, 4, "W", CreditRequest{Pages: 2})
	if ra.Credit.ID == rb.Credit.ID {
		t.Fatalf("two store instances gave the same credit id %d", ra.Credit.ID)
	}
	if _, err := b.ReserveCredit("y", 1, 0, 4, "d0", "W", CreditRequest{Use: 1, ID: ra.Credit.ID}); code(err) != codes.FailedPrecondition {
		t.Fatalf("the old store's id accepted: %v", err)
	}
}
