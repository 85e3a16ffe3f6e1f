package router

// maxLate bounds the expired reservations kept for their late outcomes.
const maxLate = 4096

// lateBook keeps reservations that expired without an outcome, so that an outcome that comes
// after all still applies: a turn that waited in its decode worker's prealloc queue longer
// than the reservation timeout (E4 at 2P4D load 2: 20 s against 9 s) ran and committed, and
// its refused outcome left the session's content at the previous turn while its record's
// committed length moved on (the sidecar's COMMITTED) — the content no longer described the
// residency, so the next turn was a whole-context RESEED_PREFILL with reason PREFIX_MISMATCH
// (and the snapshot of that commit had no anchor either). Only the ledger's part is gone: the
// reservation's tokens were released when it expired. Oldest dropped first past maxLate.
type lateBook struct {
	m     map[uint64]*reservation
	order []uint64
}

func (b *lateBook) add(r *reservation) {
	if b.m == nil {
		b.m = map[uint64]*reservation{}
	}
	for len(b.order) >= maxLate {
		delete(b.m, b.order[0])
		b.order = b.order[1:]
	}
	b.m[r.seq] = r
	b.order = append(b.order, r.seq)
}

// take removes and returns the expired reservation of seq.
func (b *lateBook) take(seq uint64) (*reservation, bool) {
	r, ok := b.m[seq]
	if ok {
		delete(b.m, seq) // its slot in order is skipped when it comes up
	}
	return r, ok
}

func (b *lateBook) reset() {
	b.m, b.order = nil, nil
}
