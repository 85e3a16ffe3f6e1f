package policy

import kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"

// The baselines' routers (kv_centric_enabled=false: every request is plain P/D with reason
// KV_CENTRIC_DISABLED) choose as the routers in front of those systems do, not as kvcentric's
// fallback does:
//
//   - decode: power of two choices on the router's own count of the plain P/D requests it has
//     in flight per decode worker (Reserved.Plain) — what SGLang's router recommends for P/D
//     (--decode-policy power_of_two). Two decode workers are drawn (spreadDraw: deterministic
//     per request), the one with fewer requests in flight wins.
//   - prefill: cache-aware (SGLang's router default, --prefill-policy cache_aware; llm-d's
//     scheduler scores prefix-cache affinity too): the prefill worker whose approximate cache
//     of the prompts routed to it (PrefixView) matches the most of this prompt's pages, when
//     that is at least plainCacheThreshold of them and the prefill workers' loads are balanced;
//     otherwise the least loaded.

// PrefixView is an optional part of a Ledger: the router's approximate view of what each
// prefill worker's prefix cache holds (the page-hash prompts it routed there).
type PrefixView interface {
	// PrefillPrefix is how many leading pages of prompt the router routed to prefill worker id
	// before (and still remembers).
	PrefillPrefix(id string, prompt []uint64) int
}

// SGLang router defaults: --cache-threshold 0.3, --balance-abs-threshold 64,
// --balance-rel-threshold 1.5.
const (
	plainCacheThreshold = 0.3
	plainBalanceAbs     = 64
	plainBalanceRel     = 1.5
)

// plainDecode is the power-of-two choice among the routable decode workers (tp-paired unless
// c.unpaired).
func (c *Cycle) plainDecode() *Cand {
	var first, second Cand
	d1, d2 := 2.0, 2.0
	cand := &c.cand
	for _, w := range c.In.Workers {
		if w.Role != kvcv1.WorkerRole_WORKER_ROLE_DECODE || (!c.unpaired && !c.pairable(w)) {
			continue
		}
		*cand = Cand{W: w, Res: c.In.Ledger.Reserved(w.WorkerId)}
		if !FilterRoutable.Keep(c, cand) {
			continue
		}
		d := spreadDraw(c.Q.SessionID, c.Turn, c.Q.InputTokens, w.WorkerId)
		switch {
		case d < d1:
			second, d2 = first, d1
			first, d1 = *cand, d
		case d < d2:
			second, d2 = *cand, d
		}
	}
	switch {
	case d1 > 1:
		return nil
	case d2 <= 1 && second.Res.Plain < first.Res.Plain:
		c.best = second
	default:
		c.best = first
	}
	return &c.best
}

// plainPrefill is the cache-aware prefill choice (tp > 0: of that tensor-parallel size only).
func (c *Cycle) plainPrefill(tp int32) *kvcv1.Worker {
	least := c.leastLoadedPrefill(tp)
	pv, ok := c.In.Ledger.(PrefixView)
	if !ok || least == nil || c.In.Content == nil || len(c.In.Content.Prompt) == 0 {
		return least
	}
	load := func(w *kvcv1.Worker) int64 {
		l := w.GetLoad()
		return int64(l.GetRunningRequests()) + int64(l.GetWaitingRequests()) + int64(c.In.Ledger.Reserved(w.WorkerId).Prefills)
	}
	var best *kvcv1.Worker
	bestMatch, maxLoad := 0, int64(0)
	for _, w := range c.In.Workers {
		if w.Role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL || !routable(w) || c.excluded(w.WorkerId) || (tp > 0 && TPSize(w) != tp) {
			continue
		}
		maxLoad = max(maxLoad, load(w))
		if m := pv.PrefillPrefix(w.WorkerId, c.In.Content.Prompt); m > bestMatch || (m == bestMatch && best != nil && m > 0 && load(w) < load(best)) {
			best, bestMatch = w, m
		}
	}
	minLoad := load(least)
	if maxLoad-minLoad > plainBalanceAbs && float64(maxLoad) > plainBalanceRel*float64(minLoad) {
		return least // imbalanced: shortest queue
	}
	if best == nil || float64(bestMatch) < plainCacheThreshold*float64(len(c.In.Content.Prompt)) {
		return least
	}
	return best
}
