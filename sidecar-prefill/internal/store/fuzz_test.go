package store

import "testing"

// FuzzStoreOps runs random sequences of reserve/commit/abort/acquire/release/expire and checks
// the page accounting after every step: every allocated page belongs to exactly one entry or
// open reservation (or a dead entry still being read), and the free count matches.
func FuzzStoreOps(f *testing.F) {
	f.Add([]byte{0, 1, 2, 10, 1, 0, 0, 2, 3, 4, 5, 6, 7, 8, 9})
	f.Add([]byte{0, 0, 0, 0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 5, 5})
	f.Fuzz(func(t *testing.T, ops []byte) {
		s, err := New(Config{PageSize: 4, PageBytes: 8, PageCount: 12})
		if err != nil {
			t.Fatal(err)
		}
		var ids []uint64
		var releases []func()
		sessions := []string{"a", "b", "c"}
		for i := 0; i+2 < len(ops); i += 3 {
			op, x, y := ops[i]%6, ops[i+1], ops[i+2]
			sess := sessions[int(x)%len(sessions)]
			switch op {
			case 0: // reserve
				base := int64(0)
				if y%2 == 1 {
					if v, ok := s.Get(sess); ok {
						base = v.Seqlen
					}
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
				if _, rel, ok := s.Acquire(sess); ok {
					releases = append(releases, rel)
				}
			case 4: // a read ends
				if len(releases) > 0 {
					j := int(y) % len(releases)
					releases[j]()
					releases = append(releases[:j], releases[j+1:]...)
				}
			case 5:
				s.Release(sess)
			}
			checkAccounting(t, s, releases)
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
	used := s.cfg.PageCount - s.nfree
	if int64(len(owner)) > used {
		t.Fatalf("%d pages owned, %d allocated", len(owner), used)
	}
}
