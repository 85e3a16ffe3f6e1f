package policy

import (
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// DefaultNewSessionShare is the share of a decode worker's kv_capacity_tokens that the
// reservations of new sessions awaiting their outcome may take beyond its free room
// (Knobs.NewSessionShare; kvc-controlplane --new-session-share): 0, no bound. Off by default:
// the bound cannot tell an abusive burst from a legitimate rush of new sessions onto full
// workers (both evict idle sessions), and past it a new session is refused instead of queued
// on its worker. 0.5 is the value for shared (multi-tenant) clusters (docs/operations.md): at
// most half of a full worker's pool goes to new sessions that have not reported an outcome,
// so a burst leaves about half of its idle sessions resident.
const DefaultNewSessionShare = 0

// The per-worker bound on new sessions' reservations (issue 23 item 5). A decode worker evicts
// its idle resident sessions (LRU) to make room for new work, so decisions that open new
// sessions there — seeds, a first turn prefilled on D (LOCAL_FIRST_TURN), the fallback that
// keeps a refused seed's KV — could, in a burst, reserve its whole pool and push every resident
// session out before any of them reports an outcome. Their reservations (Reserved.NewSession)
// are bounded per worker: a new session is placed on a decode worker only when its tokens fit
// in the worker's free room (capacity × (1 − headroom) − used − reserved − settling: nobody is
// evicted for it) or the new sessions' reservations there stay within NewSessionShare of its
// kv_capacity_tokens. A seed goes to another worker that admits it; when no routable worker
// does, the query is refused (Decision.Refused: the router answers RESOURCE_EXHAUSTED
// NO_D_CAPACITY, the gateway 503 no_d_capacity), since any plan would evict on some worker.
// Turns of resident sessions, reseeds and plain P/D requests are not bounded here.

// FilterNewSessionShare keeps a decode worker that admits one more new session within the
// bound (newSessionRoom).
var FilterNewSessionShare = Filter{"new-session-share", constReason(kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY),
	func(c *Cycle, w *Cand) bool { return newSessionRoom(c, w) }}

// keepFallbackProfile picks the decode worker of a fallback that keeps a new session's KV
// when FallbackProfile's choice is past its bound: FallbackProfile within the bound.
var keepFallbackProfile = &Profile{"fallback-keep",
	[]Filter{FilterRoutable, FilterNewSessionShare}, FallbackProfile.Scorers}

// newSessionRoom: c.Need more tokens of a new session on w leave w within the bound — they fit
// in its free room, or its new sessions' reservations stay within NewSessionShare of its
// capacity. Always true with the bound off (NewSessionShare 0).
func newSessionRoom(c *Cycle, w *Cand) bool {
	share := c.K.NewSessionShare
	if share <= 0 {
		return true
	}
	free := effectiveCapacity(c, w.W) - w.W.GetLoad().GetUsedTokens() - w.Res.Tokens - w.Res.Settling
	if c.Need <= free {
		return true
	}
	return w.Res.NewSession+c.Need <= int64(share*float64(w.W.KvCapacityTokens))
}

// refused is the decision for a new session no routable decode worker admits within the bound:
// nothing is routed or reserved.
func (c *Cycle) refused() Decision {
	return Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, Reason: kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY,
		Cause: c.Cause, Refused: true}
}
