package store

import (
	"slices"
	"testing"
	"time"
)

// FuzzStoreOps runs random sequences of reserve (with and without store credit)/commit/abort/
// acquire/release/credit expiry and checks the page accounting after every step: every allocated
// page belongs to exactly one entry, open reservation or credit (or a dead entry still being
// read), the free count matches, credits stay under their cap, and the write guard marks every
// credit page for its writer and no free page.
func FuzzStoreOps(f *testing.F) {
	f.Add([]byte{0, 1, 2, 10, 1, 0, 0, 2, 3, 4, 5, 6, 7, 8, 9})
	f.Add([]byte{0, 0, 0, 0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 5, 5})
	f.Add([]byte{6, 3, 1, 1, 0, 0, 6, 2, 12, 2, 0, 0, 6, 1, 4, 7, 0, 200, 6, 4, 28, 1, 1, 1})
	f.Add([]byte{0, 4, 20, 1, 0, 0, 3, 1, 0, 0, 7, 3, 4, 0, 0, 0, 7, 3, 1, 0, 0}) // a re-tag under a read, then after it
	f.Fuzz(func(t *testing.T, ops []byte) {
		clock := &fakeClock{now: time.Unix(1000, 0)}
		s, err := New(Config{PageSize: 4, PageBytes: 8, PageCount: 12, Buffers: []uint64{0x1000, 0x2000}, Now: clock.Now,
			ReserveTimeout: time.Hour, CreditTimeout: time.Minute, CreditMaxPages: 4})
		if err != nil {
			t.Fatal(err)
		}
		writers := []string{"W", "V", ""}
		var ids []uint64
		var releases []func()
		var reading []View // what each read in progress reads
		sessions := []string{"a", "b", "c"}
		for i := 0; i+2 < len(ops); i += 3 {
			op, x, y := ops[i]%8, ops[i+1], ops[i+2]
			sess := sessions[int(x)%len(sessions)]
			switch op {
			case 0: // reserve: a full push, an append, or a re-tag that may cut the entry back
				base := int64(0)
				v, ok := s.Get(sess)
				if y%2 == 1 && ok {
					base = v.Seqlen
				}
				if y%4 == 3 && ok && v.Seqlen > 1 {
					base = 1 + int64(x)%(v.Seqlen-1)
					if r, err := s.ReserveRetag(sess, v.Generation+1, base, int64(y%40)+1, "d", "", CreditRequest{}, v.Generation); err == nil {
						ids = append(ids, r.ID)
					}
					break
				}
				if r, err := s.Reserve(sess, uint64(x%3), base, int64(y%40)+1, "d"); err == nil {
					ids = append(ids, r.ID)
				}
			case 1: // commit
				if len(ids) > 0 {
					j := int(y) % len(ids)
					_, _ = s.Commit(ids[j])
					ids = append(ids[:j], ids[j+1:]...)
				}
			case 2: // abort
				if len(ids) > 0 {
					j := int(y) % len(ids)
					_ = s.Abort(ids[j])
					ids = append(ids[:j], ids[j+1:]...)
				}
			case 3: // acquire (a reseed reading)
				if v, rel, ok := s.Acquire(sess); ok {
					releases = append(releases, rel)
					reading = append(reading, v)
				}
			case 4: // a read ends
				if len(releases) > 0 {
					j := int(y) % len(releases)
					releases[j]()
					releases = append(releases[:j], releases[j+1:]...)
					reading = append(reading[:j], reading[j+1:]...)
				}
			case 5:
				s.Release(sess)
			case 6: // a reservation with credit: asks for some, uses some (maybe a stale id)
				w := writers[int(y)%len(writers)]
				c := s.CreditOf(w)
				cr := CreditRequest{Pages: int64(x % 5)}
				if y&4 != 0 && len(c.Pages) > 0 {
					cr.Use, cr.ID = int64(x)%int64(len(c.Pages))+1, c.ID
					if y&8 != 0 {
						cr.ID++ // stale
					}
				}
				r, err := s.ReserveCredit(sess, uint64(x%3), 0, int64(y%40)+1, "d", w, cr)
				if err == nil {
					ids = append(ids, r.ID)
					if cr.Use > 0 && (len(r.Pages) < int(cr.Use) || r.Pages[0] != c.Pages[0]) {
						t.Fatalf("reservation %v does not start with credit %v (use %d)", r.Pages, c.Pages, cr.Use)
					}
				} else if after := s.CreditOf(w); after.ID != c.ID || len(after.Pages) != len(c.Pages) {
					t.Fatalf("refused reservation %+v changed the credit %+v -> %+v: %v", cr, c, after, err)
				}
			case 7: // time passes: idle credits expire
				clock.Add(time.Duration(y%90) * time.Second)
				s.Expire()
			}
			checkAccounting(t, s, releases)
			// nothing a reseed reads is freed or made writable under it (a cut back waits)
			for _, v := range reading {
				for _, pg := range v.Pages {
					if s.free[pg] {
						t.Fatalf("page %d of %s is free while a read of it is in progress", pg, v.Session)
					}
					if g := s.gpages[pg].Load(); g != nil && g.lo < uint64(min(v.Seqlen-int64(slices.Index(v.Pages, pg))*4, 4))*(s.gItem/4) {
						t.Fatalf("page %d of %s is writable below the read's seqlen %d: %+v", pg, v.Session, v.Seqlen, g)
					}
				}
			}
		}
		for _, r := range releases {
			r()
		}
		for _, id := range ids {
			_ = s.Abort(id)
		}
		for _, sess := range sessions {
			s.Release(sess)
		}
		clock.Add(2 * time.Minute)
		s.Expire()
		checkAccounting(t, s, nil)
		if s.UsedBytes() != 0 {
			t.Fatalf("pages leaked: %d bytes still used", s.UsedBytes())
		}
	})
}

func checkAccounting(t *testing.T, s *Store, _ []func()) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	owner := map[int64]string{}
	claim := func(p int64, who string) {
		if prev, dup := owner[p]; dup {
			t.Fatalf("page %d owned by %s and %s", p, prev, who)
		}
		if s.free[p] {
			t.Fatalf("page %d of %s is marked free", p, who)
		}
		owner[p] = who
	}
	for sess, e := range s.entries {
		if int64(len(e.Pages)) != ceilDiv(e.Seqlen, s.cfg.PageSize) {
			t.Fatalf("entry %s: %d pages for seqlen %d", sess, len(e.Pages), e.Seqlen)
		}
		for _, p := range e.Pages {
			claim(p, "entry "+sess)
		}
	}
	for id, p := range s.pend {
		for _, pg := range p.owned {
			claim(pg, "reservation "+p.session)
		}
		_ = id
	}
	var credited int64
	for w, c := range s.credits {
		if len(c.pages) == 0 || c.id == 0 {
			t.Fatalf("credit of %s: %d pages, id %d", w, len(c.pages), c.id)
		}
		for _, pg := range c.pages {
			claim(pg, "credit of "+w)
			if g := s.gpages[pg].Load(); g == nil || g.res != c.guard || g.res.writer != w {
				t.Fatalf("credit page %d of %s not guarded for it: %+v", pg, w, g)
			}
		}
		credited += int64(len(c.pages))
	}
	if credited != s.creditPages || credited > s.cfg.CreditMaxPages {
		t.Fatalf("%d credit pages, counted %d, cap %d", credited, s.creditPages, s.cfg.CreditMaxPages)
	}
	// A free page is writable only by an open reservation: an append whose shared first page was
	// freed by a release of the entry meanwhile (it can no longer commit); never by a credit.
	open := map[*guardRes]bool{}
	for _, p := range s.pend {
		open[p.guard] = true
	}
	for pg := range s.free {
		if g := s.gpages[pg].Load(); s.free[pg] && g != nil && !open[g.res] {
			t.Fatalf("free page %d is writable by %+v", pg, g.res)
		}
	}
	used := s.cfg.PageCount - s.nfree
	if int64(len(owner)) > used {
		t.Fatalf("%d pages owned, %d allocated", len(owner), used)
	}
}
