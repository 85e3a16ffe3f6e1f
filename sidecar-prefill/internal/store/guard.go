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
// The writable ranges live in an immutable table sorted by address, replaced (copy on write,
// under the store lock) when a reservation starts or ends; CheckWrite reads it without a lock:
// a last-hit cache, then a binary search.

// guardRes is the guard's view of one reservation.
type guardRes struct {
	id      uint64
	session string
	peer    atomic.Pointer[string] // the peer that wrote first
	revoked atomic.Bool            // committed, aborted or expired
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

// guardSpan is a writable byte range [lo, hi) of one reservation.
type guardSpan struct {
	lo, hi uint64
	res    *guardRes
}

// guardTable is a sorted set of non-overlapping spans; never modified once published.
type guardTable struct {
	spans []guardSpan
}

// guarded reports whether the store keeps a write guard (Config.Buffers set).
func (s *Store) guarded() bool { return len(s.cfg.Buffers) > 0 }

// spansOf lays the token span [p.base, p.base+p.tokens) of a reservation whose pages hold the
// token-pages firstPage, firstPage+1, ... over every buffer, sorted, touching spans joined.
func (s *Store) spansOf(p *pending, firstPage int64, res *guardRes) []guardSpan {
	ps := s.cfg.PageSize
	itemLen := uint64(s.cfg.PageBytes) / uint64(len(s.cfg.Buffers))
	tb := itemLen / uint64(ps)
	end := p.base + p.tokens
	out := make([]guardSpan, 0, len(s.cfg.Buffers))
	for _, buf := range s.cfg.Buffers {
		for i, pg := range p.pages {
			start := (firstPage + int64(i)) * ps
			lo, hi := max(p.base, start)-start, min(end, start+ps)-start
			if hi <= lo {
				continue
			}
			a := buf + uint64(pg)*itemLen + uint64(lo)*tb
			z := buf + uint64(pg)*itemLen + uint64(hi)*tb
			if n := len(out); n > 0 && out[n-1].hi == a {
				out[n-1].hi = z
				continue
			}
			out = append(out, guardSpan{lo: a, hi: z, res: res})
		}
	}
	slices.SortFunc(out, func(a, b guardSpan) int {
		switch {
		case a.lo < b.lo:
			return -1
		case a.lo > b.lo:
			return 1
		}
		return 0
	})
	j := 0
	for i := 1; i < len(out); i++ {
		if out[j].hi == out[i].lo {
			out[j].hi = out[i].hi
			continue
		}
		j++
		out[j] = out[i]
	}
	if len(out) > 0 {
		out = out[:j+1]
	}
	return out
}

// guardLocked makes a new reservation's token span writable.
func (s *Store) guardLocked(p *pending, firstPage int64, writer string) {
	if !s.guarded() {
		return
	}
	p.guard = &guardRes{id: p.id, session: p.session}
	if writer != "" {
		p.guard.peer.Store(&writer)
	}
	add := s.spansOf(p, firstPage, p.guard)
	var cur []guardSpan
	if t := s.guard.Load(); t != nil {
		cur = t.spans
	}
	merged := make([]guardSpan, 0, len(cur)+len(add))
	i, j := 0, 0
	for i < len(cur) || j < len(add) {
		if j == len(add) || i < len(cur) && cur[i].lo < add[j].lo {
			merged = append(merged, cur[i])
			i++
		} else {
			merged = append(merged, add[j])
			j++
		}
	}
	s.guard.Store(&guardTable{spans: merged})
}

// unguardLocked withdraws a reservation's writable span (commit, abort, expiry).
func (s *Store) unguardLocked(p *pending) {
	if p.guard == nil {
		return
	}
	p.guard.revoked.Store(true)
	t := s.guard.Load()
	if t == nil {
		return
	}
	kept := make([]guardSpan, 0, len(t.spans))
	for _, sp := range t.spans {
		if sp.res != p.guard {
			kept = append(kept, sp)
		}
	}
	s.guard.Store(&guardTable{spans: kept})
}

// CheckWrite is the store's rdma.WriteGuard: it allows peer to WRITE [addr, addr+n) only if the
// range lies inside the reserved token span of one ingest in flight that no other peer has
// written. A store without Config.Buffers allows everything. Safe for concurrent use; it takes
// no lock.
func (s *Store) CheckWrite(peer string, addr, n uint64) error {
	if !s.guarded() {
		return nil
	}
	end := addr + n
	if end <= addr {
		return fmt.Errorf("store: write [%#x, +%d) is empty or wraps", addr, n)
	}
	if sp := s.lastHit.Load(); sp != nil && addr >= sp.lo && end <= sp.hi && !sp.res.revoked.Load() {
		return sp.res.admit(peer)
	}
	var spans []guardSpan
	if t := s.guard.Load(); t != nil {
		spans = t.spans
	}
	// The first span starting after addr; the one before it is the only candidate.
	i, j := 0, len(spans)
	for i < j {
		h := int(uint(i+j) >> 1)
		if spans[h].lo <= addr {
			i = h + 1
		} else {
			j = h
		}
	}
	if i == 0 || addr >= spans[i-1].hi {
		return fmt.Errorf("store: write [%#x, +%d) is not inside the reserved token range of any ingest in flight (committed snapshots, free pages and tokens outside a reservation are read-only for peers)", addr, n)
	}
	sp := &spans[i-1]
	if end > sp.hi {
		return fmt.Errorf("store: write [%#x, +%d) runs past the reserved token range of ingest %d (session %s)", addr, n, sp.res.id, sp.res.session)
	}
	s.lastHit.Store(sp)
	return sp.res.admit(peer)
}
