package policy

import (
	"strings"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Execution is how the gateway carries a decision out (kvcv1.RouteExecution). Every rule that
// decides it lives here, so the gateway executes the fields and decides nothing itself.
type Execution struct {
	// CallPrefill: the prefill worker computes (full context, no session_params, bootstrap
	// host/port = its sidecar's peer address).
	CallPrefill bool
	// CallDecode: the decode worker serves the request (every decision naming one).
	CallDecode bool
	// Transfer is how KV reaches D before its append-prefill: UNSPECIFIED (none: D holds the
	// session), SEED (P's prefill) or SNAPSHOT (the prefill sidecar's store).
	Transfer kvcv1.TransferKind
	// KeepSession: D keeps the session resident afterwards (its call carries session_params).
	KeepSession bool
	// OpenSession: this decision makes the session resident on D; open a streaming session
	// there first.
	OpenSession bool
	// CloseSessionOn is the decode worker the session leaves with this decision (a migration,
	// a drain), where the gateway closes it after the request succeeded; "" for none.
	CloseSessionOn string
	// OnDecodeRefused is reported when D does not take the request (refused or dropped the
	// connection before its first token, 503, 409 other than session_not_resident).
	OnDecodeRefused kvcv1.RouteErrorKind
	// OnTransferFailed is reported when the KV transfer into D fails.
	OnTransferFailed kvcv1.RouteErrorKind
	// RetryAllowed: a retryable failure may be retried once through a new decision.
	RetryAllowed bool
	// TruncateTo: D cuts the session it holds to this many tokens before its append-prefill
	// (PREFIX_TRUNCATED); 0 = none.
	TruncateTo int64
	// LocalPrefill: D prefills a new session's first turn itself, reusing cached_tokens from its
	// prefix cache (LOCAL_FIRST_TURN; the session is opened first).
	LocalPrefill bool
	// StoreGeneration ≠ 0: the seed goes through the prefill store (seedThroughStore): P first,
	// its sidecar keeps the prompt's KV as the session's snapshot of this generation, then D
	// loads it like a snapshot.
	StoreGeneration uint64
	// LoadPrefixTokens > 0: prefill from the snapshot (fromsnap.go): P first loads tokens
	// [0, LoadPrefixTokens) of the session's snapshot of generation LoadGeneration from its
	// sidecar's store into its pool, then prefills only the rest.
	LoadPrefixTokens int64
	LoadGeneration   uint64
	// ReceiveFrom > 0: D keeps the session's KV [0, ReceiveFrom) and receives only the pages
	// past it (a large append into the session's own D).
	ReceiveFrom int64
}

// seedThroughStore: with the knob seed_through_store (colocated decode workers, docs/sglang.md),
// a plan that prefills on P to make the session resident on D (SEED, RESEED_PREFILL) writes the
// prompt's KV into P's own store as the session's snapshot of the generation the session takes
// with this seed (NextGeneration of the record's under Input.GenerationTerm: a seed makes it
// resident anew, and the router's outcome gives it that generation), and D loads it from there.
// The store then holds the session's first snapshot, so D's first push appends onto it.
// Large appends and session-less PD_FALLBACKs keep the direct transfer. With
// seed_through_store_when_short instead (decode workers that take both), only a plan whose
// decode worker is short of pages (shortOfPages) goes through the store.
func seedThroughStore(d *Decision, in *Input) {
	e := &d.Exec
	if in.Knobs == nil || in.Unavailable || !e.CallPrefill || !e.OpenSession ||
		e.Transfer != kvcv1.TransferKind_TRANSFER_KIND_SEED {
		return
	}
	if !in.Knobs.SeedThroughStore && !(in.Knobs.SeedThroughStoreWhenShort && shortOfPages(d)) {
		return
	}
	e.StoreGeneration = NextGeneration(in.Session.GetGeneration(), in.GenerationTerm)
}

// shortOfPages reports whether a seed's decode worker is short of pages now: the control
// plane's count does not admit the plan there (Admission), no decode worker had room for the
// seed (a refused seed's fallback, KeepsResidency), or the worker reports requests waiting for
// pages (prealloc_queue_depth). A direct seed would then take pages as they free and hold them
// while it waits in P's queue, pages the waiting turns need; through the store it holds none
// until P has computed. Otherwise the direct transfer costs nothing: it overlaps the prefill
// and the pages it holds meanwhile are room nobody waits for.
func shortOfPages(d *Decision) bool {
	return d.Admission != AdmitFits || d.KeepsResidency ||
		(d.Decode != nil && d.Decode.GetLoad().GetPreallocQueueDepth() > 0)
}

// LoadsSnapshot reports whether the decision's plan moves the session's snapshot from a prefill
// store into its decode worker (the holder's sidecar pushes it on the control plane's command
// and the store-transfer slot is held until the outcome). Callers ask this, not the mode.
func (d *Decision) LoadsSnapshot() bool {
	return d.Exec.Transfer == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT
}

// PlainPD reports whether the decision is a plain P/D request on a decode worker that records no
// residency there (a PD_FALLBACK but a refused seed's): counted in Reserved.Plain.
func (d *Decision) PlainPD() bool {
	return d.Mode == kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK && d.Decode != nil && !d.KeepsResidency
}

// execution derives a decision's execution plan from its mode, reason and cause.
//
//   - keep-session: every session mode keeps the session on D, and so does the large append
//     (PD_FALLBACK / REAL_LARGE_APPEND onto the session's own D, docs/routing.md §1) and the
//     fallback of a refused seed (Decision.KeepsResidency); no other PD_FALLBACK does, and
//     nothing does when the control plane is unavailable.
//   - open-session: SEED, the reseeds and a refused seed's fallback make the session resident
//     on their D.
//   - close-session: a reseed that moves the session off a D that still runs (a migration after
//     rejections, a drain) closes it there; a D that died or already evicted the session has
//     nothing to close.
//   - local-prefill: LOCAL_FIRST_TURN, and a PD_FALLBACK without a prefill worker (D prefills
//     the whole request, no transfer, nothing kept).
//   - the prefill worker computes for SEED, RESEED_PREFILL and every PD_FALLBACK with one; for
//     RESEED_SNAPSHOT its sidecar pushes the snapshot on the control plane's command instead.
//   - a D that does not take the request is a rejection by D (REJECTED_BY_D), whatever the
//     transport said; a failed transfer of a snapshot is SNAPSHOT_FAILED (the control plane then
//     drops the snapshot), of anything else TRANSFER_FAILED.
func execution(d *Decision, unavailable bool) Execution {
	e := Execution{
		CallPrefill:      d.UsesPrefill && d.Prefill != nil,
		CallDecode:       d.Decode != nil,
		Transfer:         kvcv1.TransferKind_TRANSFER_KIND_SEED,
		OnDecodeRefused:  kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D,
		OnTransferFailed: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED,
		RetryAllowed:     true,
	}
	switch d.Mode {
	case kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D:
		e.Transfer = kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED
		e.KeepSession = true
		e.TruncateTo = d.TruncateTo
		e.LocalPrefill, e.OpenSession = d.LocalPrefill, d.LocalPrefill
	case kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL:
		e.KeepSession, e.OpenSession = true, true
	case kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT:
		e.KeepSession, e.OpenSession = true, true
		e.Transfer = kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT
		e.OnTransferFailed = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED
	case kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK:
		e.KeepSession = d.Reason == kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND && !unavailable
		if e.KeepSession {
			e.ReceiveFrom = d.ReceiveFrom
		}
		if d.KeepsResidency && !unavailable {
			// A refused seed's fallback: D keeps what it receives, as a seed's D does.
			e.KeepSession, e.OpenSession = true, true
		}
		if d.LocalPrefill {
			// No prefill worker: D prefills the whole request and keeps nothing (no transfer).
			e.Transfer, e.LocalPrefill, e.KeepSession = kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED, true, false
		}
	}
	if !e.CallDecode {
		e.KeepSession, e.OpenSession, e.ReceiveFrom = false, false, 0
	}
	if e.OpenSession && d.From != "" && d.Decode != nil && d.From != d.Decode.WorkerId {
		switch d.Cause {
		case kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS, kvcv1.RouteReason_ROUTE_REASON_D_DRAINING,
			kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH:
			// PREFIX_MISMATCH: the copy left behind is not a prefix of the conversation any more.
			e.CloseSessionOn = d.From
		}
	}
	return e
}

// SnapshotTarget is SnapshotTargetTP for a decode worker without tensor parallelism.
func SnapshotTarget(ws []*kvcv1.Worker, current string) *kvcv1.Worker {
	return SnapshotTargetTP(ws, current, 1)
}

// SnapshotTargetTP chooses the prefill worker that keeps a session's snapshot when it becomes
// resident on a decode worker: the one already holding it (current) while its sidecar is
// connected, else the READY, non-draining prefill worker with the least snapshot memory in use
// (as a fraction of its capacity), then fewest snapshot sessions, then smallest id — among the
// prefill workers of the decode worker's tensor-parallel size tp (tp.go). nil when there is
// none.
func SnapshotTargetTP(ws []*kvcv1.Worker, current string, tp int32) *kvcv1.Worker {
	var best *kvcv1.Worker
	var bestFrac float64
	for _, w := range ws {
		if w.Role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL || TPSize(w) != max(tp, 1) {
			continue
		}
		if current != "" && w.WorkerId == current && w.State != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE &&
			w.State != kvcv1.WorkerState_WORKER_STATE_UNSPECIFIED {
			return w
		}
		if !routable(w) {
			continue
		}
		l := w.GetLoad()
		frac := float64(l.GetSnapshotBytesUsed())
		if c := l.GetSnapshotBytesCapacity(); c > 0 {
			frac /= float64(c)
		}
		if best == nil || frac < bestFrac ||
			(frac == bestFrac && (l.GetSnapshotSessions() < best.GetLoad().GetSnapshotSessions() ||
				(l.GetSnapshotSessions() == best.GetLoad().GetSnapshotSessions() && strings.Compare(w.WorkerId, best.WorkerId) < 0))) {
			best, bestFrac = w, frac
		}
	}
	return best
}
