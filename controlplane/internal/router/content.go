package router

import (
	"sync"
	"sync/atomic"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/pkg/pagehash"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Content addresses (issue 13): what the leader knows of each session's KV content, learnt
// from the gateway — the prompt's chained page hashes in the query, the generated part's in the
// outcome (RouteOutcome.kv_pages). The leader keeps it in memory and persists each session's
// compact chain in its record (SessionRecord.content_chain, encodeChain: written with the
// outcome that changed it, through the volatile journal like kv_committed_len). A new leader
// loads a record's chain on the session's first decision (loadChain) when it describes the
// record's decode worker and committed length; a session whose content it does not know is
// never appended to on lengths alone — its next turn reseeds (PREFIX_MISMATCH) and the outcome
// teaches the new leader its chain. Snapshot anchors are not persisted: after a failover a
// snapshot's content is known again from the session's next commit on.

// Bounds of the content index.
const (
	maxContentSessions = 1 << 20
	maxAnchors         = 16 // recent commits kept per session: a snapshot is one of them
	maxPromptPages     = 1 << 20
	maxPageSize        = 4096
	// maxIndexPages: the first pages of each session's chain go into its decode worker's prefix
	// index (placement of new sessions on content: system prompts, tool definitions, files).
	maxIndexPages = 128
)

// anchor is one commit of a session: the hash of its last full page, for the snapshot pushed
// from it (a snapshot's seqlen is a committed length, in the generation it was pushed in).
type anchor struct {
	gen    uint64
	tokens int64
	pages  int
	last   uint64
}

// contentEntry is a session's content as of its last successful turn. Replaced, never
// modified, once stored: decisions read it without the store's lock.
type contentEntry struct {
	decode   string
	kvLen    int64
	pageSize int64
	gen      uint64
	chain    *pagehash.Sparse // pages of [0, kvLen) the control plane knows (may be fewer than ⌊kvLen/page⌋)
	anchors  []anchor         // newest last
	indexed  []uint64         // the first pages' hashes, in decode's prefix index
}

type contentStore struct {
	mu sync.Mutex
	m  map[string]*contentEntry
	// n is len(m), stored under mu whenever it changes: forget returns at once while the store
	// holds nothing (every outcome of a turn without page hashes forgets its session's content,
	// and a cluster whose gateway sends no hashes never stores any).
	n atomic.Int64
	// prefix is each decode worker's prefix index: page hash → sessions whose chain holds it
	// among their first maxIndexPages pages. A chained hash names a whole prefix, so a prompt's
	// overlap with a worker is the longest prefix of its chain found here. Entries follow the
	// sessions' last successful turns; an eviction the leader has not seen leaves a hint that
	// only costs a worse placement (the decode worker checks what it reuses).
	prefix map[string]map[uint64]int32
}

func newContentStore() *contentStore {
	return &contentStore{m: map[string]*contentEntry{}, prefix: map[string]map[uint64]int32{}}
}

// unindexLocked removes e's hashes from its worker's prefix index.
func (cs *contentStore) unindexLocked(e *contentEntry) {
	idx := cs.prefix[e.decode]
	for _, h := range e.indexed {
		if idx[h]--; idx[h] <= 0 {
			delete(idx, h)
		}
	}
	if len(idx) == 0 {
		delete(cs.prefix, e.decode)
	}
}

// overlaps fills out with, per decode worker, how many leading pages of prompt it holds for
// some session (0 omitted).
func (cs *contentStore) overlaps(prompt []uint64, out map[string]int) {
	n := min(len(prompt), maxIndexPages)
	cs.mu.Lock()
	defer cs.mu.Unlock()
	for w, idx := range cs.prefix {
		// prompt[i] ∈ idx implies prompt[j] ∈ idx for j < i (chained): binary search.
		lo, hi := 0, n
		for lo < hi {
			mid := (lo + hi + 1) / 2
			if _, ok := idx[prompt[mid-1]]; ok {
				lo = mid
			} else {
				hi = mid - 1
			}
		}
		if lo > 0 {
			out[w] = lo
		}
	}
}

func (cs *contentStore) get(id string) *contentEntry {
	if cs.n.Load() == 0 {
		return nil
	}
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return cs.m[id]
}

func (cs *contentStore) forget(id string) {
	if cs.n.Load() == 0 {
		return // nothing stored: nothing to forget (a store before this call is seen: n is set under mu)
	}
	cs.mu.Lock()
	if e := cs.m[id]; e != nil {
		cs.unindexLocked(e)
		delete(cs.m, id)
		cs.n.Store(int64(len(cs.m)))
	}
	cs.mu.Unlock()
}

func (cs *contentStore) len() int {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	return len(cs.m)
}

// view fills ct for a decision on rec: the prompt's chain, the resident chain when e describes
// the record's residency (same decode worker and committed length, same page size), and the
// snapshot's content when one of e's commits is the snapshot's (generation, seqlen).
func view(e *contentEntry, pageSize int64, prompt []uint64, rec *kvcv1.SessionRecord, ct *policy.Content) {
	*ct = policy.Content{PageSize: pageSize, Prompt: prompt}
	if e == nil || rec == nil || e.pageSize != pageSize {
		return
	}
	if rec.DecodeWorker != "" && rec.DecodeWorker == e.decode && rec.KvCommittedLen == e.kvLen {
		ct.Resident = e.chain
	}
	if sn := rec.GetSnapshot(); sn != nil {
		if a := snapshotAnchor(e.anchors, sn, pageSize); a != nil {
			sc := &policy.SnapshotContent{Pages: a.pages, Last: a.last}
			if e.gen == a.gen {
				sc.Chain = e.chain // the snapshot was pushed from this chain's KV generation
			}
			ct.Snapshot = sc
		}
	}
}

// snapshotAnchor is the commit among anchors (newest last) the snapshot sn holds the full pages
// of: the commit it was pushed from (same generation and length), else one of its generation
// whose full pages are exactly the snapshot's, which is longer only within its partial last
// page — what a re-tag append's cut-back leaves (the store cuts its entry to the page-aligned
// base the reseed loaded before the append, and reports that length: sidecar-prefill onCut).
// When the append never lands (the decode worker that was reseeded died before its first
// push), that length stays the snapshot's, and without this the next turn's reseed found no
// content for it — PREFIX_MISMATCH, a whole-context re-prefill on P instead of a reseed
// (issue 20's demo: 1.22 model-s for 25,863 tokens, the run's recovery maximum). nil: none.
func snapshotAnchor(anchors []anchor, sn *kvcv1.SnapshotInfo, pageSize int64) *anchor {
	for i := len(anchors) - 1; i >= 0; i-- {
		if a := &anchors[i]; a.gen == sn.Generation && a.tokens == sn.Seqlen {
			return a
		}
	}
	for i := len(anchors) - 1; i >= 0; i-- {
		if a := &anchors[i]; a.gen == sn.Generation && a.tokens > sn.Seqlen && int64(a.pages) == sn.Seqlen/pageSize {
			return a
		}
	}
	return nil
}

// record stores a session's content after a successful turn that left it resident on decode
// with kvLen tokens in KV generation gen: the prompt's full pages, then the outcome's pages
// past them (the generated tokens), cut to ⌊kvLen / page⌋. It returns the stored entry (nil:
// forgotten).
func (cs *contentStore) record(session, decode string, pageSize int64, prompt, extra []uint64, kvLen int64, gen uint64) *contentEntry {
	if pageSize <= 0 || kvLen <= 0 {
		cs.forget(session)
		return nil
	}
	full := int(kvLen / pageSize)
	chain := make([]uint64, 0, min(len(prompt)+len(extra), full))
	chain = append(chain, prompt[:min(len(prompt), full)]...)
	if len(chain) == len(prompt) {
		chain = append(chain, extra[:min(len(extra), full-len(chain))]...)
	}
	sp, err := pagehash.NewSparse(policy.SparseTail(pageSize), pagehash.DefaultStride)
	if err != nil {
		cs.forget(session)
		return nil
	}
	sp.Append(chain)
	e := &contentEntry{decode: decode, kvLen: kvLen, pageSize: pageSize, gen: gen, chain: sp}
	e.indexed = chain[:min(len(chain), maxIndexPages):min(len(chain), maxIndexPages)]
	if len(chain) == full && full > 0 {
		e.anchors = []anchor{{gen: gen, tokens: kvLen, pages: full, last: chain[full-1]}}
	}
	cs.store(session, e, true)
	return e
}

// rehomed stores the content of a session re-homed onto decode (rehome.go): the worker loaded
// [0, kvLen) of the session's snapshot of generation snapGen and holds it in KV generation gen.
// The pages are those of the session's entry when the snapshot was pushed from the entry's own
// KV generation and one of its commits (an anchor) is that snapshot; the last page's hash is
// the anchor's, so IsPrefixOf stays exact. Otherwise the leader does not know the loaded
// content and forgets the session's (its next turn reseeds, as without re-homing). Returns the
// stored entry (nil: forgotten).
func (cs *contentStore) rehomed(session, decode string, kvLen int64, snapGen, gen uint64) *contentEntry {
	old := cs.get(session)
	var a *anchor
	if old != nil && old.gen == snapGen && kvLen > 0 {
		for i := len(old.anchors) - 1; i >= 0; i-- {
			if x := old.anchors[i]; x.gen == snapGen && x.tokens == kvLen {
				a = &old.anchors[i]
				break
			}
		}
	}
	if a == nil || a.pages <= 0 || a.pages > old.chain.Pages() {
		cs.forget(session)
		return nil
	}
	chain := old.chain.Clone()
	chain.Truncate(a.pages - 1)
	chain.Append([]uint64{a.last})
	e := &contentEntry{decode: decode, kvLen: kvLen, pageSize: old.pageSize, gen: gen, chain: chain,
		anchors: []anchor{{gen: gen, tokens: kvLen, pages: a.pages, last: a.last}}}
	e.indexed = old.indexed[:min(len(old.indexed), a.pages):min(len(old.indexed), a.pages)]
	cs.store(session, e, true)
	return e
}

// store puts e as session's entry and indexes its first pages on its decode worker. keep:
// carry the previous entry's anchors (same page size) before e's own.
func (cs *contentStore) store(session string, e *contentEntry, keep bool) {
	own := e.anchors
	e.anchors = nil
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if old := cs.m[session]; old != nil {
		cs.unindexLocked(old)
		if keep && old.pageSize == e.pageSize {
			e.anchors = append(e.anchors, old.anchors[max(0, len(old.anchors)-maxAnchors+len(own)):]...)
		}
	}
	e.anchors = append(e.anchors, own...)
	idx := cs.prefix[e.decode]
	if idx == nil {
		idx = map[uint64]int32{}
		cs.prefix[e.decode] = idx
	}
	for _, h := range e.indexed {
		idx[h]++
	}
	if _, ok := cs.m[session]; !ok && len(cs.m) >= maxContentSessions {
		for k, v := range cs.m { // bounded: drop an arbitrary session (its next turn reseeds)
			cs.unindexLocked(v)
			delete(cs.m, k)
			break
		}
	}
	cs.m[session] = e
	cs.n.Store(int64(len(cs.m)))
}
