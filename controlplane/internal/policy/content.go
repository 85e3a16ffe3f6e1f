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
// something to keep and the rest fits a direct append; otherwise the session is reseeded with
// reason PREFIX_MISMATCH — from its snapshot only up to the prefix the snapshot shares with the
// prompt, else by re-prefill — and the stale copy on d is closed.
func (c *Cycle) prefixMismatch(d *kvcv1.Worker, lcp int64) Decision {
	keep := min(lcp*c.In.Content.PageSize, c.Q.InputTokens)
	uncached := c.Q.InputTokens - keep
	if keep > 0 && uncached <= c.K.DirectMaxUncachedTokens {
		c.Need = uncached + c.Q.MaxOutputTokens
		cand := Cand{W: d, Res: c.In.Ledger.Reserved(d.WorkerId)}
		if fits(c, &cand) {
			return Decision{
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
		}
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
