package policy

import (
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// fromSnapshot makes a plan in which P computes (SEED, RESEED_PREFILL, any PD_FALLBACK of a
// session) prefill from the session's snapshot when the store holds a usable prefix of the
// prompt (docs/routing.md, "Prefill from the snapshot"): P is the snapshot's holder, which
// loads tokens [0, LoadPrefixTokens) of the snapshot of generation LoadGeneration from its
// sidecar's store into its worker's pool and prefills only the rest. The mode and reason stay
// what they were (they say why P computes); the plan says how much of it P is spared. Usable:
// snapshots on, the holder routable (its worker computes) and not excluded, of the decode
// worker's tensor-parallel size, not older than snapshot_max_staleness_ms, and on content the
// snapshot's longest common prefix of pages with the prompt (length only: the snapshot up to
// the input). P always computes at least the prompt's last token (the first output token comes
// from it). A seed through the prefill store keeps its plan (P's store write would replace the
// entry it reads). A holder busier than the plan's own prefill worker (the least loaded) is
// skipped where its queue costs more than the load spares (holderPays): P re-prefills the
// whole context on the idler worker (Decision.LoadSkippedBusy).
func (c *Cycle) fromSnapshot(d *Decision) {
	in := c.In
	if in.Unavailable || !c.K.KVCentricEnabled || !c.K.SnapshotsEnabled || in.NoSnapshot || c.S == nil ||
		!d.Exec.CallPrefill || d.Exec.StoreGeneration != 0 {
		return
	}
	s := c.S.GetSnapshot()
	if s == nil || s.PrefillWorker == "" || s.Seqlen <= 0 {
		return
	}
	p := findWorker(in.Workers, s.PrefillWorker, kvcv1.WorkerRole_WORKER_ROLE_PREFILL)
	if p == nil || !routable(p) || c.excluded(p.WorkerId) || (d.Decode != nil && TPSize(p) != TPSize(d.Decode)) {
		return
	}
	if m := c.K.SnapshotMaxStalenessMs; m > 0 && in.NowMs-s.UpdatedUnixMs > m {
		return
	}
	tokens := s.Seqlen
	if in.Content.known() {
		t, ok := c.snapshotPrefix(s.Seqlen)
		if !ok {
			return
		}
		tokens = t
	}
	tokens = min(tokens, c.Q.InputTokens-1)
	if tokens <= 0 {
		return
	}
	if alt := d.Prefill; alt != nil && alt.WorkerId != p.WorkerId && !c.holderPays(p, alt, tokens) {
		d.LoadSkippedBusy = true
		return
	}
	d.Prefill = p
	d.Exec.LoadPrefixTokens, d.Exec.LoadGeneration = tokens, s.Generation
}

// receiveFrom is the suffix-only receive of a large append into the session's own decode
// worker: D keeps the KV it holds of the prompt, [0, cached) cut to a page boundary when the
// page size is known (the workers cut it to theirs), and P sends only the pages past it.
func (c *Cycle) receiveFrom(cached int64) int64 {
	if ct := c.In.Content; ct.known() {
		return cached / ct.PageSize * ct.PageSize
	}
	return cached
}

// holderPays reports whether loading tokens of the prompt on the snapshot's holder beats
// re-prefilling the whole prompt on alt, the plan's least-loaded prefill worker. The holder
// computes input - tokens after the requests it has beyond alt's (prefillLoad: running,
// waiting and the control plane's prefills in flight); alt computes the whole input. A
// request ahead is counted as half a prompt of this size (the one running is half done on
// average, and the agentic prompts P serves are of one order, many of them loads that compute
// only a tail), so the holder pays while its extra load × input / 2 ≤ tokens: one request more
// for a load of half the prompt or more, never two. An equally loaded holder always pays; with
// a single prefill worker there is no alternative.
func (c *Cycle) holderPays(holder, alt *kvcv1.Worker, tokens int64) bool {
	extra := c.prefillLoad(holder) - c.prefillLoad(alt)
	return extra <= 0 || extra*c.Q.InputTokens <= 2*tokens
}
