package policy

import (
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func constReason(r kvcv1.RouteReason) func(*Cycle) kvcv1.RouteReason {
	return func(*Cycle) kvcv1.RouteReason { return r }
}

// Gates.
var (
	// GatePendingTransfer: a seed or reseed of this session is still in flight; a second one
	// would race it.
	GatePendingTransfer = Gate{"pending-transfer", kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT,
		func(c *Cycle) bool { return c.In.Ledger.TransferPending(c.Q.SessionID) }}
	// GateEarlyTurn: seed_min_turn.
	GateEarlyTurn = Gate{"seed-min-turn", kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_EARLY_TURN,
		func(c *Cycle) bool { return c.Turn < c.K.SeedMinTurn }}
	// GateOutputTokens: seed_max_output_tokens.
	GateOutputTokens = Gate{"seed-max-output-tokens", kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_OUTPUT_TOKENS,
		func(c *Cycle) bool {
			return c.K.SeedMaxOutputTokens > 0 && c.Q.MaxOutputTokens > c.K.SeedMaxOutputTokens
		}}
	// GateResidentTokens: seed_max_resident_tokens (input + max output would be resident).
	GateResidentTokens = Gate{"seed-max-resident-tokens", kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_RESIDENT_TOKENS,
		func(c *Cycle) bool {
			return c.K.SeedMaxResidentTokens > 0 && c.Q.InputTokens+c.Q.MaxOutputTokens > c.K.SeedMaxResidentTokens
		}}
	// GateSingleTurn: seed_only_multiturn; a turn > 0 or the client's hint proves multi-turn.
	GateSingleTurn = Gate{"seed-only-multiturn", kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_SINGLE_TURN,
		func(c *Cycle) bool { return c.K.SeedOnlyMultiturn && !c.Q.MultiturnHint && c.Turn == 0 }}
)

// SeedGates run, in order, before a new session is seeded.
var SeedGates = []Gate{GatePendingTransfer, GateEarlyTurn, GateOutputTokens, GateResidentTokens, GateSingleTurn}

// ReseedGates run before a lost or migrating session is reseeded: the size limits still hold
// (a huge reseed is what storms the transfer path); turn and multi-turn do not (the session
// has proved itself).
var ReseedGates = []Gate{GatePendingTransfer, GateOutputTokens, GateResidentTokens}

// Filters.
var (
	// FilterRoutable: connected, READY, not draining. Emptying here on a lost session reports
	// why it lost its D.
	FilterRoutable = Filter{"routable", func(c *Cycle) kvcv1.RouteReason {
		if c.Cause != 0 {
			return c.Cause
		}
		return kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY
	}, func(c *Cycle, w *Cand) bool { return routable(w.W) && !c.excluded(w.W.WorkerId) }}
	// FilterNotCurrent: a migration goes elsewhere.
	FilterNotCurrent = Filter{"not-current", constReason(kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY),
		func(c *Cycle, w *Cand) bool { return w.W.WorkerId != c.Current }}
	// FilterNotRejecter: never place a session on a D that rejected it since its last success.
	FilterNotRejecter = Filter{"not-rejecter", constReason(kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY),
		func(c *Cycle, w *Cand) bool { return c.S.GetDRejects()[w.W.WorkerId] == 0 }}
	// FilterCapacity: used + reserved + needed ≤ capacity × (1 − headroom).
	FilterCapacity = Filter{"capacity", constReason(kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY), fits}
	// FilterTransferBudget: per-D max_concurrent_transfers of reseeds from a prefill store,
	// counted from local reservations (Reserved.StoreTransfers). A transfer P computes (a seed,
	// RESEED_PREFILL) takes no slot: it starts only once P prefilled, and a seed has its own
	// bound (seed_max_inflight_decode).
	FilterTransferBudget = Filter{"transfer-budget", constReason(kvcv1.RouteReason_ROUTE_REASON_TRANSFER_BUDGET),
		func(c *Cycle, w *Cand) bool {
			b := c.K.TransferBudget(w.W.WorkerId)
			return b == 0 || w.Res.StoreTransfers < b
		}}
	// FilterSeedInflight: seed_max_inflight_decode.
	FilterSeedInflight = Filter{"seed-max-inflight", constReason(kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_INFLIGHT),
		func(c *Cycle, w *Cand) bool {
			return c.K.SeedMaxInflightDecode == 0 || w.Res.Seeds < c.K.SeedMaxInflightDecode
		}}
)

// Scorers.
var (
	// ScoreHeadroom: the fraction of capacity still free after this request.
	ScoreHeadroom = Scorer{"headroom", 2, func(c *Cycle, w *Cand) float64 {
		capTok := effectiveCapacity(c, w.W)
		if capTok <= 0 {
			return 0
		}
		return float64(capTok-w.W.GetLoad().GetUsedTokens()-w.Res.Tokens-w.Res.Settling-c.Need) / float64(capTok)
	}}
	// ScoreFree: the fraction of capacity free before this request (pinned + in flight +
	// settling); it orders the Ds none of which has room (headroom is 0 on all of them): the
	// least overcommitted one queues the reseed the shortest.
	ScoreFree = Scorer{"free", 0.5, func(c *Cycle, w *Cand) float64 {
		capTok := effectiveCapacity(c, w.W)
		if capTok <= 0 {
			return 0
		}
		return float64(capTok-pinnedTokens(w.W)-w.Res.Tokens-w.Res.Settling) / float64(capTok)
	}}
	// A reseed's filters as scores (ReseedProfile): weights 16, 8, 4 over headroom (2), queues
	// (1) and free (0.5) order the candidates lexicographically — not a rejecter, then room,
	// then a store-transfer slot, then the rest — so a reseed is never refused for them.
	ScoreNotRejecter = Scorer{"not-rejecter", 16, func(c *Cycle, w *Cand) float64 { return b2f(FilterNotRejecter.Keep(c, w)) }}
	ScoreCapacity    = Scorer{"capacity", 8, func(c *Cycle, w *Cand) float64 { return b2f(fits(c, w)) }}
	ScoreBudget      = Scorer{"transfer-budget", 4, func(c *Cycle, w *Cand) float64 { return b2f(FilterTransferBudget.Keep(c, w)) }}
	// ScoreQueues: short transfer and prealloc queues, counting local in-flight transfers.
	ScoreQueues = Scorer{"queues", 1, func(_ *Cycle, w *Cand) float64 {
		l := w.W.GetLoad()
		q := max(l.GetTransferQueueDepth(), w.Res.Transfers) + l.GetPreallocQueueDepth()
		return 1 / (1 + float64(q))
	}}
	// ScoreSpread: a draw in [0, 1) per (session, turn, input length, worker) — deterministic,
	// so Decide stays pure. A plain P/D request reserves nothing on its D (its pages live only
	// while it runs), so the control plane does not see the requests it sent since a D's last
	// load report: without the draw every plain P/D request until the next report went to the
	// same D (most headroom in that report, ties to the smallest id) — 80–90% of a baseline
	// arm's requests on one decode worker of four, whose pool and prealloc queue then bounded the
	// arm under load (docs/benchmark.md, *Load sweep*). With it, Ds of about the same headroom
	// share the requests as a P/D router's random decode choice does; a clearly emptier D still
	// wins (headroom weighs 2).
	ScoreSpread = Scorer{"spread", 1, func(c *Cycle, w *Cand) float64 {
		return spreadDraw(c.Q.SessionID, c.Turn, c.Q.InputTokens, w.W.WorkerId)
	}}
)

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// spreadDraw is FNV-1a over (session, turn, input, worker), mixed and mapped to [0, 1); no
// allocation.
func spreadDraw(session string, turn int32, input int64, worker string) float64 {
	const prime = 1099511628211
	h := uint64(14695981039346656037)
	for i := 0; i < len(session); i++ {
		h = (h ^ uint64(session[i])) * prime
	}
	h = (h ^ uint64(uint32(turn))) * prime
	h = (h ^ uint64(input)) * prime
	for i := 0; i < len(worker); i++ {
		h = (h ^ uint64(worker[i])) * prime
	}
	h ^= h >> 33 // splitmix-style finalizer: FNV's low bits alone are poorly mixed
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	return float64(h>>11) / (1 << 53)
}

// Profiles.
var (
	// SeedProfile places a new session. No transfer budget: a seed's transfer starts only once
	// P prefilled (seed_max_inflight_decode bounds seeds). The new-session bound
	// (newsession.go) comes before capacity: a seed it refuses everywhere is refused, not kept
	// by a fallback.
	SeedProfile = &Profile{"seed",
		[]Filter{FilterRoutable, FilterNewSessionShare, FilterCapacity, FilterSeedInflight},
		[]Scorer{ScoreHeadroom, ScoreQueues}}
	// ReseedProfile places a session that lost its D on the best routable D: rejections,
	// capacity and the store-transfer budget are scores (a reseed is never downgraded to a
	// whole-context PD_FALLBACK for them; its D queues it), Decision.Admission says which one
	// the chosen D misses.
	ReseedProfile = &Profile{"reseed",
		[]Filter{FilterRoutable},
		[]Scorer{ScoreNotRejecter, ScoreCapacity, ScoreBudget, ScoreHeadroom, ScoreQueues, ScoreFree}}
	// DrainProfile moves a session off a draining D that still serves it: only to a D that
	// admits it now (with none it is served in place).
	DrainProfile = &Profile{"drain",
		[]Filter{FilterRoutable, FilterNotRejecter, FilterCapacity, FilterTransferBudget},
		[]Scorer{ScoreHeadroom, ScoreQueues}}
	// MigrateProfile moves a session off a D that rejected it migration_reject_threshold times.
	MigrateProfile = &Profile{"migrate",
		[]Filter{FilterRoutable, FilterNotCurrent, FilterNotPrevious, FilterNotRejecter, FilterCapacity, FilterTransferBudget},
		[]Scorer{ScoreHeadroom, ScoreQueues}}
	// FallbackProfile picks the D of a plain P/D request.
	FallbackProfile = &Profile{"fallback", []Filter{FilterRoutable}, []Scorer{ScoreHeadroom, ScoreQueues, ScoreSpread}}
)

// FilterNotPrevious: a migration never bounces back to the D the session last left (no
// ping-pong between two full workers); with no other target the session is served in place.
var FilterNotPrevious = Filter{"not-previous", constReason(kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY),
	func(c *Cycle, w *Cand) bool { return w.W.WorkerId != c.S.GetPreviousDecodeWorker() }}
