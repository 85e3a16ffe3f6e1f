package worker

import "container/list"

// poolRadix is a decode worker's radix cache in its own KV pool (SGLang's
// --disaggregation-decode-enable-radix-cache): the full pages of finished plain P/D turns stay
// in the pool, each owning a real page, and compete with running requests for it.
//
//   - A turn whose prompt starts with cached pages locks them (SGLang's _match_prefix_and_lock,
//     inc_lock_ref) and uses those very pages for its prefix, so it allocates only the rest
//     (its transfer writes the same bytes into them: the content pattern is a function of the
//     tokens and positions, as real KV of an identical prefix is).
//   - The budget of an allocation is free + evictable pages (_allocatable_token_budgets:
//     available_size + evictable_size); when the free list is short, unlocked pages are evicted
//     least recently used first (tree_cache.evict), before any session.
//   - A finished turn's full pages are inserted (its matched ones unlocked, new ones adopted;
//     a page another turn inserted meanwhile is freed).
//
// Pages are chain hashes (chainHashes), so the deepest page of a path is touched first and its
// root ends most recently used: leaves are evicted first, as a radix tree's are. Guarded by
// Worker.mu.
type poolRadix struct {
	cap   int64 // most pages it may hold (its capacity flag; the pool bounds it anyway)
	nodes map[uint64]*rnode
	lru   *list.List // unlocked nodes, front = most recently used
}

type rnode struct {
	hash uint64
	page int64
	lock int
	el   *list.Element // in lru while unlocked
}

func newPoolRadix(capPages int64) *poolRadix {
	return &poolRadix{cap: capPages, nodes: map[uint64]*rnode{}, lru: list.New()}
}

// size is the pages the radix holds; evictable those no running turn has locked.
func (r *poolRadix) size() int64      { return int64(len(r.nodes)) }
func (r *poolRadix) evictable() int64 { return int64(r.lru.Len()) }

// lockMatch locks the leading pages of hs the radix holds, at most limit of them, and returns
// them in token order.
func (r *poolRadix) lockMatch(hs []uint64, limit int) []*rnode {
	var out []*rnode
	for i := 0; i < len(hs) && i < limit; i++ {
		n := r.nodes[hs[i]]
		if n == nil {
			break
		}
		out = append(out, n)
	}
	for _, n := range out {
		if n.lock == 0 {
			r.lru.Remove(n.el)
			n.el = nil
		}
		n.lock++
	}
	return out
}

// unlock releases locked nodes (deepest first, so the path's root ends most recently used).
func (r *poolRadix) unlock(ns []*rnode) {
	for i := len(ns) - 1; i >= 0; i-- {
		n := ns[i]
		n.lock--
		if n.lock == 0 {
			n.el = r.lru.PushFront(n)
		}
	}
}

// adopt inserts page under hash (unlocked, most recently used); false when the radix holds the
// hash already or is full: the caller frees the page.
func (r *poolRadix) adopt(hash uint64, page int64) bool {
	if _, ok := r.nodes[hash]; ok || r.size() >= r.cap {
		return false
	}
	n := &rnode{hash: hash, page: page}
	n.el = r.lru.PushFront(n)
	r.nodes[hash] = n
	return true
}

// evict removes up to n unlocked pages, least recently used first, and returns their pages.
func (r *poolRadix) evict(n int64) []int64 {
	var out []int64
	for int64(len(out)) < n && r.lru.Len() > 0 {
		e := r.lru.Back()
		nd := e.Value.(*rnode)
		r.lru.Remove(e)
		delete(r.nodes, nd.hash)
		out = append(out, nd.page)
	}
	return out
}

// radixBegin (decode, plain P/D turn with the decode radix): locks the cached prefix of the
// prompt (leaving at least one token to receive) and returns its pages; t.l1 records how many.
func (w *Worker) radixBegin(t *turn) []int64 {
	if w.prad == nil {
		return nil
	}
	ps := int64(w.cfg.Geometry.PageSize)
	hs := chainHashes(t.content(t.p.input), int(ps))
	w.mu.Lock()
	t.radix = w.prad.lockMatch(hs, int(max(t.p.input-1, 0)/ps))
	w.mu.Unlock()
	pages := make([]int64, len(t.radix))
	for i, n := range t.radix {
		pages[i] = n.page
	}
	return pages
}

// radixFinish ends a plain P/D turn that used the radix: on success its full pages of KV go to
// the radix; every other page is freed, and its locks are released.
func (w *Worker) radixFinish(t *turn, ok bool) {
	ps := int64(w.cfg.Geometry.PageSize)
	var hs []uint64
	if ok && t.kv > 0 {
		hs = chainHashes(t.content(t.kv), int(ps))
	}
	var free []int64
	w.mu.Lock()
	for i := len(t.pages) - 1; i >= 0; i-- { // deepest first: the path's root ends most recently used
		pg := t.pages[i]
		switch {
		case i < len(t.radix): // the radix's own page
		case i < len(hs) && w.prad.adopt(hs[i], pg):
		default:
			free = append(free, pg)
		}
	}
	w.prad.unlock(t.radix)
	t.radix = nil
	w.alloc.put(free)
	w.wakeLocked() // pages freed, radix pages evictable again
	w.mu.Unlock()
}
