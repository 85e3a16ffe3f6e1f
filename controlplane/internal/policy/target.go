package policy

import kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"

// The snapshot target: which prefill worker keeps a session's snapshot while it is resident on
// a decode worker (SetSnapshotTargetCommand). One builder, TargetCommand, serves every sender:
// the router at a seed's or reseed's outcome, the drain when the session's store is gone and
// the resync of a restarted decode sidecar. The agent hints travel on their own command
// (HintsCommand): a new target never changes them.

// SnapshotBase is a snapshot of which the session's decode worker holds exactly the first Len
// tokens: the entry of generation Generation in Prefill's store. Named with the target it makes
// the decode sidecar's next push an append (re-tagging the entry when Generation is older than
// the command's) instead of a full push. The zero value is none.
type SnapshotBase struct {
	Prefill    string
	Len        int64
	Generation uint64
}

// ReseedBase is the base of a RESEED_SNAPSHOT from prefill's snapshot [0, seqlen) of generation
// gen: the new decode worker was written from it.
func ReseedBase(prefill string, seqlen int64, gen uint64) SnapshotBase {
	return SnapshotBase{Prefill: prefill, Len: seqlen, Generation: gen}
}

// StoreSeedBase is the base of a seed through the prefill store: the decode worker loaded the
// prompt [0, input) from the store's snapshot of generation storeGen (0: no store seed).
func StoreSeedBase(prefill string, input int64, storeGen uint64) SnapshotBase {
	if storeGen == 0 {
		return SnapshotBase{}
	}
	return SnapshotBase{Prefill: prefill, Len: input, Generation: storeGen}
}

// ResyncBase is the base of a session a restarted decode sidecar re-reports with committed
// tokens: rec's own snapshot, when it is of the residency's generation (pushed from it) and no
// longer than what the worker holds. A snapshot of another generation is not a base: the KV may
// have been rewritten since (a truncation, a reseed).
func ResyncBase(rec *kvcv1.SessionRecord, committed int64) SnapshotBase {
	sn := rec.GetSnapshot()
	if sn.GetGeneration() == 0 || sn.GetGeneration() != rec.GetGeneration() || sn.GetSeqlen() > committed {
		return SnapshotBase{}
	}
	return SnapshotBase{Prefill: sn.GetPrefillWorker(), Len: sn.GetSeqlen(), Generation: sn.GetGeneration()}
}

// Target is what a snapshot target is named for.
type Target struct {
	Session string
	// Generation is the session's KV generation on its decode worker.
	Generation uint64
	// Current is the prefill worker that holds (or was named to hold) the session's snapshot:
	// kept while its sidecar is connected (SnapshotTargetTP).
	Current string
	// TP is the decode worker's tensor-parallel size (a target of the same size is chosen).
	TP int32
	// Base is a snapshot the decode worker holds the start of (none: the first push is full).
	Base SnapshotBase
}

// TargetCommand names the prefill worker that keeps t's snapshot (SnapshotTargetTP) and, when
// that worker's store holds t.Base of a generation not after t's, the valid base. It returns
// the command and the chosen worker, or nil, nil when no prefill worker can keep it.
func TargetCommand(ws []*kvcv1.Worker, t Target) (*kvcv1.SetSnapshotTargetCommand, *kvcv1.Worker) {
	p := SnapshotTargetTP(ws, t.Current, t.TP)
	if p == nil {
		return nil, nil
	}
	c := &kvcv1.SetSnapshotTargetCommand{SessionId: t.Session, PrefillWorkerId: p.GetWorkerId(), PeerAddr: p.GetPeerAddr(),
		TransferEndpoint: p.GetTransferEndpoint(), Generation: t.Generation}
	if b := t.Base; b.Prefill == p.GetWorkerId() && b.Len > 0 && b.Generation != 0 && b.Generation <= t.Generation {
		c.ValidBaseLen, c.BaseGeneration = b.Len, b.Generation
	}
	return c, p
}

// HintsCommand is the command that tells a decode sidecar session's agent hints (the pin's end
// and the priority), or nil when there is nothing to tell a sidecar that knows none (no pin
// holding at nowMs, not low priority) unless always is set (the hints changed: an unpin too).
func HintsCommand(session string, pinnedUntilMs int64, low bool, nowMs int64, always bool) *kvcv1.SetSessionHintsCommand {
	if pinnedUntilMs <= nowMs {
		pinnedUntilMs = 0
	}
	if !always && pinnedUntilMs == 0 && !low {
		return nil
	}
	return &kvcv1.SetSessionHintsCommand{SessionId: session, PinnedUntilUnixMs: pinnedUntilMs, LowPriority: low}
}
