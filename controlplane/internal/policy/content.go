package policy

import (
	"github.com/kvcentric/kvcentric/pkg/pagehash"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Content is what a decision knows of the turn's content (issue 13): the chained page hashes
// of the prompt (from the gateway) and of the KV the session holds (from its decode worker's
// commits, through the outcomes) and of its snapshot. With it, the resident or snapshot KV is
// reused only up to the longest common prefix with the prompt; without it (nil, or PageSize 0:
// the gateway had no token ids) the decision goes on lengths alone, as before.
type Content struct {
	// PageSize is the page size the hashes were computed with (RouteQuery.page_size).
	PageSize int64
	// Prompt is the chain of the prompt's full pages.
	Prompt []uint64
	// Resident is the chain of the KV the session holds on its decode worker (the record's
	// decode_worker, kv_committed_len) — nil when the control plane does not know it (no
	// outcome with hashes since the session's last commit, another page size, a new leader).
	// It may hold fewer pages than ⌊kv_committed_len / PageSize⌋: the pages past those are
	// unknown and not reused.
	Resident *pagehash.Sparse
	// Snapshot is what the session's snapshot holds; nil when unknown.
	Snapshot *SnapshotContent
	// Overlap is, for a new session, how many leading pages of the prompt each decode worker
	// holds for other sessions (its prefix index; workers without any omitted).
	Overlap map[string]int
}

// SnapshotContent describes a snapshot's content: its full pages and the hash of the last one.
type SnapshotContent struct {
	Pages int
	Last  uint64
	// Chain is a chain the snapshot is a prefix of (the session's chain in the snapshot's KV
	// generation), to find the common prefix when the snapshot is not a prefix of the prompt;
	// nil when unknown.
	Chain *pagehash.Sparse
}

// TailTokens is how many tokens at the end of a session the compact chain keeps every page
// hash of (pagehash.Sparse's tail), so the common prefix is exact for divergences that recent:
// the previous answer and its reasoning (the chat-turn seam, stripped reasoning), a rewritten
// last tool result. Earlier divergences round down to a multiple of pagehash.DefaultStride pages.
const TailTokens = 2048

// SparseTail is the Sparse tail, in pages, for a page size: TailTokens worth, at least
// pagehash.DefaultTail pages.
func SparseTail(pageSize int64) int {
	if pageSize <= 0 {
		return pagehash.DefaultTail
	}
	return max(pagehash.DefaultTail, int(TailTokens/pageSize))
}

// known reports whether the decision is on content.
func (ct *Content) known() bool { return ct != nil && ct.PageSize > 0 }

// residentPrefix: the pages of the resident KV that are provably a prefix of the prompt, and
// whether all the session's KV is (the turn may append to it as it is). Tokens of a partial
// last page are not covered by any hash: the decode worker checks them against the prompt's
// ids and cuts there itself (a divergence it sees inside its full pages fails the request).
func (c *Cycle) residentPrefix() (pages int64, whole bool) {
	ct := c.In.Content
	if ct.Resident == nil {
		return 0, false
	}
	full := c.S.KvCommittedLen / ct.PageSize
	if int64(ct.Resident.Pages()) == full && ct.Resident.IsPrefixOf(ct.Prompt) {
		return full, true
	}
	return int64(ct.Resident.CommonPages(ct.Prompt)), false
}

// prefixMismatch: the KV resident on d is not a prefix of the prompt; its first lcp pages are.
// Truncating the session on d to that page boundary and append-prefilling the rest
// (DIRECT_TO_D, PREFIX_TRUNCATED, execution.truncate_to) keeps what matches when there is
// something to keep and the rest is within a direct append (D queues it when it cannot admit
// it now, Admission); otherwise the session is reseeded with
// reason PREFIX_MISMATCH — from its snapshot only up to the prefix the snapshot shares with the
// prompt, else by re-prefill — and the stale copy on d is closed.
func (c *Cycle) prefixMismatch(d *kvcv1.Worker, lcp int64) Decision {
	keep := min(lcp*c.In.Content.PageSize, c.Q.InputTokens)
	uncached := c.Q.InputTokens - keep
	if keep > 0 && uncached <= c.K.DirectMaxUncachedTokens {
		c.Need = uncached + c.Q.MaxOutputTokens
		cand := Cand{W: d, Res: c.In.Ledger.Reserved(d.WorkerId)}
		dec := Decision{
			Mode:           kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Reason:         kvcv1.RouteReason_ROUTE_REASON_PREFIX_TRUNCATED,
			Cause:          c.Cause,
			Decode:         d,
			ReservedTokens: c.Need,
			CachedTokens:   keep,
			TruncateTo:     keep,
			PauseMs:        c.pause(&cand),
			From:           d.WorkerId,
		}
		// Never downgraded to a reseed of the whole context for capacity: D queues it.
		if !fits(c, &cand) {
			dec.Admission = AdmitOverCapacity
		}
		return dec
	}
	if keep > 0 {
		// The common prefix stays where it is: the tail past it is too long for D's
		// append-prefill, so P prefills it (from its store's snapshot where that holds the
		// prefix, fromsnap.go) and D, cutting its session back to the common prefix, receives
		// only the pages past it — a large append of the edited history on its own D, not a
		// whole-context reseed.
		dec := c.largeAppend(d, uncached, keep)
		if dec.Reason == kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND && dec.Cause == 0 {
			dec.Cause = kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH
		}
		return dec
	}
	if c.Cause == 0 {
		c.Cause = kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH
	}
	dec, _ := c.reseed(kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, d.WorkerId, ReseedProfile, false)
	return dec
}

// snapshotPrefix is how many tokens of the snapshot may be reused for this prompt: all its
// full pages when they are a prefix of the prompt, else the pages it provably shares with it
// (page aligned: a snapshot's partial last page is never reused on content, since no hash
// covers it). ok is false when content is known and nothing of the snapshot is provably a
// prefix.
func (c *Cycle) snapshotPrefix(seqlen int64) (tokens int64, ok bool) {
	ct := c.In.Content
	sc := ct.Snapshot
	if sc == nil || sc.Pages <= 0 || int64(sc.Pages) > seqlen/ct.PageSize {
		return 0, false
	}
	m := 0
	switch {
	case sc.Pages <= len(ct.Prompt) && ct.Prompt[sc.Pages-1] == sc.Last:
		m = sc.Pages
	case sc.Chain != nil:
		m = min(sc.Pages, sc.Chain.CommonPages(ct.Prompt))
	}
	if m == 0 {
		return 0, false
	}
	return int64(m) * ct.PageSize, true
}

// overlapTokens is the prefix of the prompt worker w holds for other sessions, in tokens.
func (c *Cycle) overlapTokens(w string) int64 {
	ct := c.In.Content
	if !ct.known() {
		return 0
	}
	return min(int64(ct.Overlap[w])*ct.PageSize, c.Q.InputTokens)
}

// ScoreOverlap prefers the decode worker holding the longest prefix of a new session's prompt
// (a shared system prompt, tool definitions, repository files): its overlap relative to the
// largest any worker has, weighted above headroom and queues, so the largest overlap wins
// among the workers that admit the session — when that worker has room free for the session
// to grow to twice its first turn. A worker that would have to evict idle sessions to take it,
// or soon after as its sessions grow, scores 0 here: locality that costs sessions their
// residency (reseeds later) is not worth a shared prefix. (Measured: without the growth room,
// the demo's three sessions of one system prompt, 21K-30K tokens each and growing, landed on
// one 88K-token decode worker and evicted each other every few turns.)
var ScoreOverlap = Scorer{"content-overlap", 4, func(c *Cycle, w *Cand) float64 {
	ct := c.In.Content
	if !ct.known() {
		return 0
	}
	if w.W.GetLoad().GetUsedTokens()+w.Res.Tokens+w.Res.Settling+2*c.Need > effectiveCapacity(c, w.W) {
		return 0
	}
	best := 0
	for _, n := range ct.Overlap {
		best = max(best, n)
	}
	if best == 0 {
		return 0
	}
	return float64(ct.Overlap[w.W.WorkerId]) / float64(best)
}}

// SeedOnContentProfile places a new session whose prompt shares pages with KV resident on
// decode workers: the seed filters, then the overlap ahead of headroom and queues.
var SeedOnContentProfile = &Profile{"seed-on-content",
	SeedProfile.Filters,
	[]Scorer{ScoreOverlap, ScoreHeadroom, ScoreQueues}}

// placeOnContent finishes a new session's placement on d when its prompt overlaps what d holds:
// a short first turn — what is left after the overlap at most direct_max_uncached_tokens, as
// for a direct turn — is prefilled on d itself (conditional disaggregation: LOCAL_FIRST_TURN,
// DIRECT_TO_D with execution.local_prefill, cached_tokens = the overlap, no prefill worker and
// no transfer); a longer one is seeded there (PREFIX_OVERLAP). ok is false without overlap.
func (c *Cycle) placeOnContent(d *Cand) (Decision, bool) {
	o := c.overlapTokens(d.W.WorkerId)
	if o <= 0 || ScoreOverlap.Score(c, d) <= 0 {
		return Decision{}, false
	}
	if c.Q.InputTokens-o <= c.K.DirectMaxUncachedTokens {
		return Decision{
			Mode:           kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
			Reason:         kvcv1.RouteReason_ROUTE_REASON_LOCAL_FIRST_TURN,
			Decode:         d.W,
			ReservedTokens: c.Need,
			CachedTokens:   o,
			LocalPrefill:   true,
			PauseMs:        c.pause(d),
			NewSession:     true,
		}, true
	}
	return Decision{}, false
}
