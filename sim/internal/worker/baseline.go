package worker

import (
	"container/list"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"sync"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// BaselineConfig switches on the cache features of the systems kvcentric is compared with
// (docs/simulator.md, "Baseline models"). All zero: kvc-sim as before (no prefill prefix cache:
// the E1 lower bound).
type BaselineConfig struct {
	// PrefixCacheTokens (prefill): capacity of the prefill worker's radix cache in tokens, LRU
	// over full pages; a prefill computes only the tokens past the longest cached page-aligned
	// prefix of its input (SGLang's and vLLM's prefix caching on a P/D prefill worker).
	PrefixCacheTokens int64
	// EvictionPolicy of the prefix cache: EvictLRU ("" too) or EvictPriority, which evicts the
	// pages of requests with a lower SGLang priority (GenerateReqInput.priority) first (SGLang's
	// --radix-eviction-policy).
	EvictionPolicy string
	// PullDirs (prefill): KV tiers the prefill worker fetches a longer prefix from before it
	// prefills the rest, paying the link for the fetched tokens: llm-d's P2P pull from each decode
	// host's CPU tier (one directory per decode host), or SGLang's HiCache L3 prefetch (the shared
	// store's directory).
	PullDirs []string
	// OffloadDir (decode): after every turn the decode worker writes the turn's whole KV (input
	// and generated tokens) to this tier: its own host's CPU tier (llm-d's OffloadingConnector with
	// offload_prompt_only false; the directory dies with the node) or the shared L3 store
	// (SGLang's --disaggregation-decode-enable-offload-kvcache).
	OffloadDir string
	// OffloadCapacityTokens bounds what this worker keeps in OffloadDir (LRU by session; 0: no
	// bound).
	OffloadCapacityTokens int64
	// DecodeRadix (decode): SGLang's --disaggregation-decode-enable-radix-cache with decode
	// HiCache: a plain P/D turn receives only the suffix past what the decode worker already
	// holds in its own radix (L1: in its KV pool, at most RadixTokens; poolradix.go) or restores
	// from RestoreDirs (L2/L3, at the link's rate, overlapped with the wait for the sender).
	DecodeRadix bool
	RadixTokens int64
	RestoreDirs []string
}

// Baseline is the state of the baseline models of one worker (nil: none). Safe for concurrent
// use.
type Baseline struct {
	cfg     BaselineConfig
	prefix  *radix // prefill prefix cache
	mu      sync.Mutex
	offload *list.List // sessions written to OffloadDir, LRU front = newest
	offIdx  map[string]*list.Element
	offTok  int64
}

type offEntry struct {
	file   string
	tokens int64
}

// NewBaseline validates cfg and returns its state; nil when cfg enables nothing.
func NewBaseline(cfg BaselineConfig, pageSize int) (*Baseline, error) {
	if cfg.PrefixCacheTokens < 0 || cfg.OffloadCapacityTokens < 0 || cfg.RadixTokens < 0 {
		return nil, errors.New("baseline: negative capacity")
	}
	if pageSize <= 0 {
		return nil, fmt.Errorf("baseline: page size %d", pageSize)
	}
	switch cfg.EvictionPolicy {
	case "", EvictLRU, EvictPriority:
	default:
		return nil, fmt.Errorf("baseline: radix eviction policy %q (want %s or %s)", cfg.EvictionPolicy, EvictLRU, EvictPriority)
	}
	if cfg.PrefixCacheTokens == 0 && len(cfg.PullDirs) == 0 && cfg.OffloadDir == "" && !cfg.DecodeRadix {
		return nil, nil
	}
	b := &Baseline{cfg: cfg, offload: list.New(), offIdx: map[string]*list.Element{}}
	if cfg.PrefixCacheTokens > 0 {
		b.prefix = newRadix(cfg.PrefixCacheTokens/int64(pageSize), pageSize, cfg.EvictionPolicy)
	}
	if cfg.OffloadDir != "" {
		if err := os.MkdirAll(cfg.OffloadDir, 0o755); err != nil {
			return nil, fmt.Errorf("baseline: offload dir: %w", err)
		}
	}
	return b, nil
}

// chainHashes are the hashes of ids' full pages, each covering every token before it (a radix
// path: two sequences share the first k hashes iff they share the first k pages).
func chainHashes(ids []uint32, pageSize int) []uint64 {
	n := len(ids) / pageSize
	out := make([]uint64, n)
	var prev uint64
	var buf [4]byte
	var pb [8]byte
	for i := 0; i < n; i++ {
		h := fnv.New64a()
		binary.LittleEndian.PutUint64(pb[:], prev)
		_, _ = h.Write(pb[:])
		for _, id := range ids[i*pageSize : (i+1)*pageSize] {
			binary.LittleEndian.PutUint32(buf[:], id)
			_, _ = h.Write(buf[:])
		}
		prev = h.Sum64()
		out[i] = prev
	}
	return out
}

// Eviction policies of the prefill prefix cache (SGLang's --radix-eviction-policy values this
// model implements).
const (
	// EvictLRU evicts the least recently used page first and ignores request priorities
	// (SGLang's default, LRUStrategy).
	EvictLRU = "lru"
	// EvictPriority evicts the page of the lowest priority first, least recently used within a
	// priority (SGLang 0.5.23's PriorityStrategy: (node.priority, last_access_time)); a page
	// takes the highest priority of the requests that inserted it (TreeNode.priority = max).
	EvictPriority = "priority"
)

// radix is a page-granular prefix cache: a set of chain hashes with LRU (or priority, then LRU)
// eviction and a capacity in pages. Evicting a page of a path leaves its descendants
// unreachable (they are never matched past the gap) until they are evicted too, as a radix
// tree's leaves go first.
type radix struct {
	mu         sync.Mutex
	pageSize   int
	cap        int64
	byPriority bool
	n          int64
	lists      map[int64]*list.List // per priority, front = most recently used
	idx        map[uint64]*list.Element
}

// rpage is one cached page: its chain hash and priority (SGLang's request priority: higher is
// kept longer).
type rpage struct {
	hash uint64
	prio int64
}

func newRadix(pages int64, pageSize int, policy string) *radix {
	return &radix{pageSize: pageSize, cap: pages, byPriority: policy == EvictPriority,
		lists: map[int64]*list.List{}, idx: map[uint64]*list.Element{}}
}

// match is the number of leading pages of hs held (touching them).
func (r *radix) match(hs []uint64) int {
	if r == nil {
		return 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for n < len(hs) {
		if _, ok := r.idx[hs[n]]; !ok {
			break
		}
		n++
	}
	for i := n - 1; i >= 0; i-- { // deepest first: the root ends most recently used
		e := r.idx[hs[i]]
		r.lists[e.Value.(*rpage).prio].MoveToFront(e)
	}
	return n
}

// insert adds every page of hs at priority prio (ignored under LRU), raising the priority of
// pages held at a lower one, and evicts beyond the capacity.
func (r *radix) insert(hs []uint64, prio int64) {
	if r == nil || r.cap <= 0 {
		return
	}
	if !r.byPriority {
		prio = 0
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	// Deepest pages are touched first so that the path's root ends up most recently used.
	for i := len(hs) - 1; i >= 0; i-- {
		if e, ok := r.idx[hs[i]]; ok {
			pg := e.Value.(*rpage)
			if prio <= pg.prio {
				r.lists[pg.prio].MoveToFront(e)
				continue
			}
			r.remove(e)
		}
		r.idx[hs[i]] = r.list(prio).PushFront(&rpage{hash: hs[i], prio: prio})
		r.n++
	}
	for r.n > r.cap {
		r.remove(r.victim())
	}
}

// list is the LRU list of priority prio, made on first use.
func (r *radix) list(prio int64) *list.List {
	l := r.lists[prio]
	if l == nil {
		l = list.New()
		r.lists[prio] = l
	}
	return l
}

// victim is the least recently used page of the lowest priority held (r.n > 0).
func (r *radix) victim() *list.Element {
	var low *list.List
	lowP := int64(0)
	for p, l := range r.lists {
		if low == nil || p < lowP {
			low, lowP = l, p
		}
	}
	return low.Back()
}

// remove drops a page (and its priority's list once empty).
func (r *radix) remove(e *list.Element) {
	pg := e.Value.(*rpage)
	l := r.lists[pg.prio]
	l.Remove(e)
	if l.Len() == 0 {
		delete(r.lists, pg.prio)
	}
	delete(r.idx, pg.hash)
	r.n--
}

// tierFile is the file of session in a tier directory.
func tierFile(dir, session string) string {
	h := fnv.New64a()
	_, _ = h.Write([]byte(session))
	return filepath.Join(dir, fmt.Sprintf("%016x.kv", h.Sum64()))
}

// tierMatch is the longest prefix (in pages) of hs that a tier holds for session, and the tier
// that holds it (its egress is what the fetch shares); a tier that is gone (its node died) holds
// nothing.
func tierMatch(dirs []string, session string, hs []uint64) (best int, from string) {
	for _, d := range dirs {
		b, err := os.ReadFile(tierFile(d, session))
		if err != nil {
			continue
		}
		n := 0
		for n < len(hs) && (n+1)*8 <= len(b) && binary.LittleEndian.Uint64(b[n*8:]) == hs[n] {
			n++
		}
		if n > best {
			best, from = n, d
		}
	}
	return best, from
}

// offloadWrite writes session's page hashes to the offload tier (atomically) and evicts this
// worker's least recently written sessions beyond the tier's capacity.
func (b *Baseline) offloadWrite(session string, hs []uint64, pageSize int) error {
	if b == nil || b.cfg.OffloadDir == "" || session == "" {
		return nil
	}
	file := tierFile(b.cfg.OffloadDir, session)
	buf := make([]byte, 8*len(hs))
	for i, h := range hs {
		binary.LittleEndian.PutUint64(buf[i*8:], h)
	}
	tmp := file + ".tmp"
	if err := os.WriteFile(tmp, buf, 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp, file); err != nil {
		return err
	}
	tokens := int64(len(hs) * pageSize)
	b.mu.Lock()
	defer b.mu.Unlock()
	if e, ok := b.offIdx[session]; ok {
		b.offTok -= e.Value.(*offEntry).tokens
		b.offload.Remove(e)
	}
	b.offIdx[session] = b.offload.PushFront(&offEntry{file: file, tokens: tokens})
	b.offTok += tokens
	for b.cfg.OffloadCapacityTokens > 0 && b.offTok > b.cfg.OffloadCapacityTokens && b.offload.Len() > 1 {
		e := b.offload.Back()
		oe := e.Value.(*offEntry)
		_ = os.Remove(oe.file)
		b.offTok -= oe.tokens
		b.offload.Remove(e)
		for k, v := range b.offIdx {
			if v == e {
				delete(b.offIdx, k)
				break
			}
		}
	}
	return nil
}

// prefillCost is the modeled compute of a prefill pass over p's input on a worker with the
// baseline's prefix cache and pull tiers, and what must be fetched before it: pulled tokens from
// the tier from (over this node's fetch lane, link.go: the GPU is not held meanwhile, as
// HiCache's prefetch and vLLM's remote-KV wait do not hold it). It returns the compute and the
// tokens taken from the cache and from a tier.
func (w *Worker) prefillCost(p *plan) (compute time.Duration, cached, pulled int64, from string) {
	b := w.cfg.Baseline
	if b == nil {
		return w.cfg.Timing.Prefill(p.input), 0, 0, ""
	}
	ps := w.cfg.Geometry.PageSize
	hs := chainHashes(p.tokenIDs(p.input), ps)
	local := b.prefix.match(hs)
	far := local
	if len(b.cfg.PullDirs) > 0 && local < len(hs) {
		if n, d := tierMatch(b.cfg.PullDirs, p.sessionID, hs); n > local {
			far, from = n, d
		}
	}
	// At least one token is always computed (the first output token's logits).
	cached = min(int64(local*ps), max(p.input-1, 0))
	pulled = min(int64(far*ps), max(p.input-1, 0)) - cached
	b.prefix.insert(hs, p.priority)
	if pulled <= 0 {
		from = ""
	}
	return w.cfg.Timing.Prefill(p.input - cached - pulled), cached, pulled, from
}

// recvPlan is what a transfer into a decode worker needs from the link: with the decode radix
// (SGLang's decode-side radix + HiCache) only the suffix past have comes from the sender, and
// restore tokens of it are loaded from the tier restoreFrom meanwhile.
type recvPlan struct {
	have, restore int64
	restoreFrom   string
}

// receivePlan plans the receive of tokens tokens of a transfer of kind: all of them over the
// link, or, with the decode radix, only those past what the worker holds in L1 (free) or
// restores from its tiers (over the link, started with the receive and overlapped with the
// wait for the sender, as HiCache gates the receive until the restore is ready).
func (w *Worker) receivePlan(t *turn, kind kvcv1.TransferKind, tokens int64) recvPlan {
	b := w.cfg.Baseline
	if b == nil || !b.cfg.DecodeRadix || kind != kvcv1.TransferKind_TRANSFER_KIND_SEED {
		return recvPlan{}
	}
	ps := w.cfg.Geometry.PageSize
	hs := chainHashes(t.content(tokens), ps)
	l1 := len(t.radix) // the decode radix's pages this turn locked (poolradix.go)
	l3, from := l1, ""
	if len(b.cfg.RestoreDirs) > 0 && l1 < len(hs) {
		if n, d := tierMatch(b.cfg.RestoreDirs, t.p.sessionID, hs); n > l1 {
			l3, from = n, d
		}
	}
	have := min(int64(l3*ps), max(tokens-1, 0))
	rp := recvPlan{have: have, restore: min(int64((l3-l1)*ps), have), restoreFrom: from}
	if rp.restore <= 0 {
		rp.restore, rp.restoreFrom = 0, ""
	}
	return rp
}

// baselineFinished records a decode turn's KV [0, kv) in the decode radix and the offload
// tier.
func (w *Worker) baselineFinished(t *turn) {
	b := w.cfg.Baseline
	if b == nil || t.kv <= 0 || w.cfg.Role != kvcv1.WorkerRole_WORKER_ROLE_DECODE {
		return
	}
	if b.cfg.OffloadDir == "" {
		return
	}
	hs := chainHashes(t.content(t.kv), w.cfg.Geometry.PageSize)
	if err := b.offloadWrite(t.p.sessionID, hs, w.cfg.Geometry.PageSize); err != nil {
		w.log.Warn().Err(err).Str("session", t.p.sessionID).Msg("baseline offload write failed")
	}
}
