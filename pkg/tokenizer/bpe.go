package tokenizer

import (
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
)

// mergeKey packs a pair of symbol ids.
func mergeKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

type mergeVal struct {
	rank uint32 // position in the merges list: lower merges first
	id   uint32 // id of the merged token
}

// bpe is a byte-level BPE model: initial symbols are the ids of single bytes, merged by rank
// exactly as Hugging Face's BPE::merge_word does (lowest rank first, leftmost on ties).
type bpe struct {
	byteID       [256]uint32
	hasByte      [256]bool
	merges       mergeTable
	vocab        map[string]uint32 // raw bytes of every byte-level token -> id
	ignoreMerges bool

	// cache maps a piece (raw bytes) to its ids, as HF's BPE cache does: prompts repeat words,
	// and a gateway re-encodes each conversation's history every turn. It holds at most
	// cacheMax pieces of at most cacheMaxLen bytes.
	cache wordCache
}

// wordCache is a bounded map from a piece to its ids in two parts: an immutable "frozen" map
// read without a lock (an atomic pointer), and a sharded "young" map, locked per shard, that
// takes new pieces. When the young part holds as many pieces as the frozen one (at least
// cacheMerge) both are merged into a new frozen map, or, when that would exceed cacheMax, the
// young part replaces the frozen one. Merging at equal sizes keeps the copying to at most two
// map insertions per new piece, and a working set settles in the lock-free frozen map.
type wordCache struct {
	seed   maphash.Seed
	frozen atomic.Pointer[map[string][]uint32]
	count  atomic.Int64 // pieces in the young part
	swapMu sync.Mutex
	young  [cacheShards]cacheShard
}

const (
	cacheShards = 16
	cacheMerge  = 4096
)

type cacheShard struct {
	mu sync.Mutex
	m  map[string][]uint32
	_  [40]byte // keep shards on separate cache lines
}

func (c *wordCache) get(w string) ([]uint32, bool) {
	if f := c.frozen.Load(); f != nil {
		if v, ok := (*f)[w]; ok {
			return v, true
		}
	}
	if c.count.Load() == 0 {
		return nil, false
	}
	sh := &c.young[maphash.String(c.seed, w)%cacheShards]
	sh.mu.Lock()
	v, ok := sh.m[w]
	sh.mu.Unlock()
	return v, ok
}

func (c *wordCache) put(w string, ids []uint32) {
	sh := &c.young[maphash.String(c.seed, w)%cacheShards]
	sh.mu.Lock()
	if sh.m == nil {
		sh.m = make(map[string][]uint32, 64)
	}
	if _, dup := sh.m[w]; !dup {
		sh.m[strings.Clone(w)] = ids
		c.count.Add(1)
	}
	sh.mu.Unlock()
	if c.count.Load() >= c.mergeAt() {
		c.merge()
	}
}

func (c *wordCache) mergeAt() int64 {
	n := int64(cacheMerge)
	if f := c.frozen.Load(); f != nil {
		n = max(n, int64(len(*f)))
	}
	return min(n, max(cacheMax/2, 1))
}

// merge folds the young part into a new frozen map.
func (c *wordCache) merge() {
	c.swapMu.Lock()
	defer c.swapMu.Unlock()
	if c.count.Load() < c.mergeAt() {
		return // another goroutine merged first
	}
	for i := range c.young {
		c.young[i].mu.Lock()
	}
	n := int(c.count.Load())
	var next map[string][]uint32
	if f := c.frozen.Load(); f != nil && int64(len(*f)+n) <= cacheMax {
		next = make(map[string][]uint32, len(*f)+n)
		for k, v := range *f {
			next[k] = v
		}
	} else {
		next = make(map[string][]uint32, n)
	}
	for i := range c.young {
		for k, v := range c.young[i].m {
			next[k] = v
		}
		c.young[i].m = nil
	}
	c.frozen.Store(&next)
	c.count.Store(0)
	for i := range c.young {
		c.young[i].mu.Unlock()
	}
}

// Cache bounds (variables so tests can turn the cache off).
var (
	cacheMax    int64 = 1 << 17
	cacheMaxLen       = 64
)

// mergeTable is an open-addressing hash table from a symbol pair to its merge (rank and
// merged id), with linear probing: one multiply and usually one cache line per lookup.
type mergeTable struct {
	keys  []uint64 // pair key + 1 (0 = empty slot)
	vals  []mergeVal
	shift uint
}

func newMergeTable(n int) mergeTable {
	size, shift := 1<<4, uint(60)
	for size < 2*n {
		size <<= 1
		shift--
	}
	return mergeTable{keys: make([]uint64, size), vals: make([]mergeVal, size), shift: shift}
}

func (t *mergeTable) slot(k uint64) uint64 { return (k * 0x9E3779B97F4A7C15) >> t.shift }

// put inserts or replaces (a later duplicate pair wins, as in HF).
func (t *mergeTable) put(k uint64, v mergeVal) {
	mask := uint64(len(t.keys) - 1)
	for i := t.slot(k); ; i = (i + 1) & mask {
		if t.keys[i] == 0 || t.keys[i] == k+1 {
			t.keys[i], t.vals[i] = k+1, v
			return
		}
	}
}

func (t *mergeTable) get(k uint64) (mergeVal, bool) {
	mask := uint64(len(t.keys) - 1)
	for i := t.slot(k); ; i = (i + 1) & mask {
		switch t.keys[i] {
		case k + 1:
			return t.vals[i], true
		case 0:
			return mergeVal{}, false
		}
	}
}

// heapThreshold: words up to this many bytes merge with a quadratic scan (fastest for the
// short words that dominate text); longer ones use the heap (whitespace runs, long ids).
var heapThreshold = 48

// encodeWord appends the ids of one pre-tokenized piece (raw bytes).
func (m *bpe) encodeWord(dst []uint32, w string, sc *scratch) []uint32 {
	if len(w) == 1 {
		if m.hasByte[w[0]] {
			dst = append(dst, m.byteID[w[0]])
		}
		return dst
	}
	if len(w) == 2 && !m.ignoreMerges && m.hasByte[w[0]] && m.hasByte[w[1]] {
		a, b := m.byteID[w[0]], m.byteID[w[1]]
		if mv, ok := m.merges.get(mergeKey(a, b)); ok {
			return append(dst, mv.id)
		}
		return append(dst, a, b)
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[w]; ok {
			return append(dst, id)
		}
	}
	if len(w) <= cacheMaxLen && cacheMax > 0 {
		if v, ok := m.cache.get(w); ok {
			return append(dst, v...)
		}
		n := len(dst)
		dst = m.merge(dst, w, sc)
		if sc.lim == nil || sc.lim.err == nil { // not an abandoned merge
			m.cache.put(w, append([]uint32(nil), dst[n:]...))
		}
		return dst
	}
	return m.merge(dst, w, sc)
}

// merge runs the BPE merges over one piece.
func (m *bpe) merge(dst []uint32, w string, sc *scratch) []uint32 {
	syms := sc.syms[:0]
	for i := 0; i < len(w); i++ {
		if m.hasByte[w[i]] {
			syms = append(syms, m.byteID[w[i]])
		}
	}
	if len(syms) > heapThreshold {
		sc.syms = syms
		return m.mergeHeap(dst, sc)
	}
	for len(syms) > 1 {
		best, bestRank, bestID := -1, uint32(0), uint32(0)
		for i := 0; i+1 < len(syms); i++ {
			if mv, ok := m.merges.get(mergeKey(syms[i], syms[i+1])); ok && (best < 0 || mv.rank < bestRank) {
				best, bestRank, bestID = i, mv.rank, mv.id
			}
		}
		if best < 0 {
			break
		}
		syms[best] = bestID
		syms = append(syms[:best+1], syms[best+2:]...)
	}
	sc.syms = syms
	return append(dst, syms...)
}

// scratch holds per-call buffers.
type scratch struct {
	syms  []uint32
	next  []int32
	prev  []int32
	alive []bool
	heap  []heapItem
	lim   *limiter // EncodeContext's bound (limit.go); nil: none
}

type heapItem struct {
	rank uint32
	pos  int32 // index of the left symbol
	id   uint32
	// right is the id of the right symbol when the item was pushed; a stale item (its right
	// neighbour merged since) no longer matches and is skipped.
	left, right uint32
}

func less(a, b heapItem) bool {
	if a.rank != b.rank {
		return a.rank < b.rank
	}
	return a.pos < b.pos
}

func (sc *scratch) push(it heapItem) {
	h := append(sc.heap, it)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !less(h[i], h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	sc.heap = h
}

func (sc *scratch) pop() heapItem {
	h := sc.heap
	top := h[0]
	last := len(h) - 1
	h[0] = h[last]
	h = h[:last]
	i := 0
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < len(h) && less(h[l], h[m]) {
			m = l
		}
		if r < len(h) && less(h[r], h[m]) {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	sc.heap = h
	return top
}

// mergeHeap merges sc.syms with a priority queue over (rank, position), as HF does.
func (m *bpe) mergeHeap(dst []uint32, sc *scratch) []uint32 {
	syms := sc.syms
	n := len(syms)
	sc.next = grow(sc.next, n)
	sc.prev = grow(sc.prev, n)
	if cap(sc.alive) < n {
		sc.alive = make([]bool, n)
	}
	alive := sc.alive[:n]
	for i := 0; i < n; i++ {
		sc.next[i] = int32(i + 1)
		sc.prev[i] = int32(i - 1)
		alive[i] = true
	}
	sc.next[n-1] = -1
	sc.heap = sc.heap[:0]
	for i := 0; i+1 < n; i++ {
		if sc.lim.stopPops(i + 1) {
			return dst // abandoned: the caller returns the limiter's error, not these ids
		}
		if mv, ok := m.merges.get(mergeKey(syms[i], syms[i+1])); ok {
			sc.push(heapItem{rank: mv.rank, pos: int32(i), id: mv.id, left: syms[i], right: syms[i+1]})
		}
	}
	for pops := 1; len(sc.heap) > 0; pops++ {
		if sc.lim.stopPops(pops) {
			return dst // abandoned: the caller returns the limiter's error, not these ids
		}
		it := sc.pop()
		p := it.pos
		if !alive[p] || syms[p] != it.left {
			continue
		}
		q := sc.next[p]
		if q < 0 || syms[q] != it.right {
			continue
		}
		// merge q into p
		syms[p] = it.id
		alive[q] = false
		nq := sc.next[q]
		sc.next[p] = nq
		if nq >= 0 {
			sc.prev[nq] = p
		}
		if pp := sc.prev[p]; pp >= 0 {
			if mv, ok := m.merges.get(mergeKey(syms[pp], syms[p])); ok {
				sc.push(heapItem{rank: mv.rank, pos: pp, id: mv.id, left: syms[pp], right: syms[p]})
			}
		}
		if nq >= 0 {
			if mv, ok := m.merges.get(mergeKey(syms[p], syms[nq])); ok {
				sc.push(heapItem{rank: mv.rank, pos: p, id: mv.id, left: syms[p], right: syms[nq]})
			}
		}
	}
	for i := int32(0); i >= 0; i = sc.next[i] {
		dst = append(dst, syms[i])
	}
	return dst
}

func grow(s []int32, n int) []int32 {
	if cap(s) < n {
		return make([]int32, n)
	}
	return s[:n]
}
