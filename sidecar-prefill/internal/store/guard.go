package store

import (
	"fmt"
	"slices"
	"sync/atomic"
)

// The write guard: which bytes of the store's memory a peer may WRITE right now. Only the bytes
// of the reserved token span of an ingest in flight are writable — in the partly filled first
// page of an incremental push only the tokens ≥ base_len, in the last page only the tokens
// < base_len+tokens — in every buffer. Committed snapshot bytes, free pages and the other
// reservations' bytes are not. A reservation belongs to the writer named at ReserveFor or, when
// none was named, to the first peer that writes into it: writes from any other peer into it are
// refused.
//
// The writable bytes are kept per store page: one atomic pointer per page to {reservation, byte
// range within the page} (the same in every buffer), set (under the store lock) when a
// reservation starts and cleared when it ends. A writer's store credit (credit.go) is writable
// by that writer only, whole pages, until a reservation takes the pages over or it expires. CheckWrite takes no lock and writes nothing
// shared: the buffer by division (equally spaced buffers) or binary search over their start
// addresses, then one atomic load per page the write touches.

// guardRes is the guard's view of one reservation.
type guardRes struct {
	id      uint64
	session string
	peer    atomic.Pointer[string] // the peer that wrote first
	writer  string                 // the writer named when it was made ("" = first writer binds it)
}

// admit binds r to peer on its first write and refuses any other peer afterwards.
func (r *guardRes) admit(peer string) error {
	p := r.peer.Load()
	if p == nil {
		np := new(string)
		*np = peer
		if r.peer.CompareAndSwap(nil, np) {
			return nil
		}
		p = r.peer.Load()
	}
	if *p != peer {
		return fmt.Errorf("ingest %d (session %s) belongs to peer %q, not to %q", r.id, r.session, *p, peer)
	}
	return nil
}

// pageGuard is the writable byte range [lo, hi) of one store page (in every buffer).
type pageGuard struct {
	res    *guardRes
	lo, hi uint64
}

// guarded reports whether the store keeps a write guard (Config.Buffers set).
func (s *Store) guarded() bool { return len(s.gbufs) > 0 }

// initGuard sets up the guard's page table; the buffers must not overlap.
func (s *Store) initGuard() error {
	nb := int64(len(s.cfg.Buffers))
	if nb == 0 {
		return nil
	}
	if s.cfg.PageBytes%nb != 0 || s.cfg.PageBytes/nb%s.cfg.PageSize != 0 {
		return fmt.Errorf("store: %d page bytes do not split into %d buffers of whole tokens (page size %d)", s.cfg.PageBytes, nb, s.cfg.PageSize)
	}
	s.gItem = uint64(s.cfg.PageBytes / nb)
	s.gBufLen = s.gItem * uint64(s.cfg.PageCount)
	bufs := slices.Clone(s.cfg.Buffers)
	slices.Sort(bufs)
	for i, b := range bufs {
		if b+s.gBufLen < b || i > 0 && bufs[i-1]+s.gBufLen > b {
			return fmt.Errorf("store: buffer at %#x overlaps another or wraps (%d bytes each)", b, s.gBufLen)
		}
	}
	s.gbufs = bufs
	if len(bufs) > 1 {
		s.gStride = bufs[1] - bufs[0]
		for i := 2; i < len(bufs) && s.gStride != 0; i++ {
			if bufs[i]-bufs[i-1] != s.gStride {
				s.gStride = 0
			}
		}
	}
	s.gpages = make([]atomic.Pointer[pageGuard], s.cfg.PageCount)
	return nil
}

// guardLocked makes a new reservation's token span writable; its pages hold the token-pages
// firstPage, firstPage+1, ...
func (s *Store) guardLocked(p *pending, firstPage int64, writer string) {
	if !s.guarded() {
		return
	}
	p.guard = newGuardRes(p.id, p.session, writer)
	ps := s.cfg.PageSize
	tb := s.gItem / uint64(ps)
	end := p.base + p.tokens
	for i, pg := range p.pages {
		start := (firstPage + int64(i)) * ps
		lo, hi := max(p.base, start)-start, min(end, start+ps)-start
		if hi > lo {
			s.gpages[pg].Store(&pageGuard{res: p.guard, lo: uint64(lo) * tb, hi: uint64(hi) * tb})
		}
	}
}

func newGuardRes(id uint64, session, writer string) *guardRes {
	g := &guardRes{id: id, session: session, writer: writer}
	if writer != "" {
		g.peer.Store(&writer)
	}
	return g
}

// unguardLocked withdraws a reservation's writable bytes (commit, abort, expiry).
func (s *Store) unguardLocked(p *pending) {
	if p.guard == nil {
		return
	}
	for _, pg := range p.pages {
		if g := s.gpages[pg].Load(); g != nil && g.res == p.guard {
			s.gpages[pg].Store(nil)
		}
	}
}

// CheckWrite is the store's rdma.WriteGuard: it allows peer to WRITE [addr, addr+n) only if every
// byte lies inside the reserved token span of one ingest in flight that belongs to peer (the
// writer named at ReserveFor, else the first peer that wrote into it). A store without
// Config.Buffers allows everything. Safe for concurrent use; it takes no lock.
func (s *Store) CheckWrite(peer string, addr, n uint64) error {
	if !s.guarded() {
		return nil
	}
	end := addr + n
	if end <= addr {
		return fmt.Errorf("store: write [%#x, +%d) is empty or wraps", addr, n)
	}
	// The last buffer starting at or before addr: by division when the buffers are equally
	// spaced (one arena), else by binary search.
	bufs := s.gbufs
	var i int
	if s.gStride != 0 {
		if addr >= bufs[0] {
			i = int(min((addr-bufs[0])/s.gStride, uint64(len(bufs)-1))) + 1
		}
	} else {
		j := len(bufs)
		for i < j {
			h := int(uint(i+j) >> 1)
			if bufs[h] <= addr {
				i = h + 1
			} else {
				j = h
			}
		}
	}
	if i == 0 || addr-bufs[i-1] >= s.gBufLen {
		return s.notReserved(addr, n)
	}
	off := addr - bufs[i-1]
	item := s.gItem
	p0, p1 := off/item, (off+n-1)/item
	if p1 >= uint64(len(s.gpages)) {
		return fmt.Errorf("store: write [%#x, +%d) runs past the end of a store buffer", addr, n)
	}
	var res *guardRes
	for pg := p0; pg <= p1; pg++ {
		g := s.gpages[pg].Load()
		from, to := uint64(0), item
		if pg == p0 {
			from = off - pg*item
		}
		if pg == p1 {
			to = off + n - pg*item
		}
		switch {
		case g == nil || from < g.lo || from >= g.hi:
			return s.notReserved(addr, n)
		case pg > p0 && g.res != res && (g.res.writer == "" || g.res.writer != res.writer):
			// Two spans of one named writer may be crossed (its credit pages next to the
			// reservation that is taking them over); any other crossing is refused.
			return fmt.Errorf("store: write [%#x, +%d) crosses from ingest %d into ingest %d", addr, n, res.id, g.res.id)
		case to > g.hi:
			return fmt.Errorf("store: write [%#x, +%d) runs past the reserved token range of ingest %d (session %s)", addr, n, g.res.id, g.res.session)
		}
		res = g.res
	}
	return res.admit(peer)
}

func (s *Store) notReserved(addr, n uint64) error {
	return fmt.Errorf("store: write [%#x, +%d) is not inside the reserved token range of any ingest in flight (committed snapshots, free pages and tokens outside a reservation are read-only for peers)", addr, n)
}
