package policy

import kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"

// The outcome's effects: what a turn's RouteOutcome does to its session record and which
// commands follow (docs/routing.md, "Outcomes"). Effect classifies the outcome, Edit applies
// it to the record (inside the state's update) and ResidentCommands lists the commands of a
// new residency; the router carries them out. kv_committed_len is never written here: its one
// writer is the decode sidecar's commit (COMMITTED, a resync's report), and a residency made
// here takes the new decode worker's last commit (state.UpdateSession).

// Turn is what a decision reserved, as its outcome's effects need it.
type Turn struct {
	Session string
	Mode    kvcv1.RouteMode
	// Decode and Prefill are the decision's workers; From is the decode worker the session was
	// resident on at the decision ("" when none).
	Decode, Prefill, From string
	// Opens: the plan makes the session resident on Decode (OpenSession); Keeps: Decode keeps
	// it (KeepSession).
	Opens, Keeps bool
	// Truncate is the plan's truncate_to (0: none).
	Truncate int64
	// Input is the turn's input tokens.
	Input int64
	// SessionGen is the session's generation at the decision.
	SessionGen uint64
	// SnapshotGen and SnapshotLen: the snapshot a RESEED_SNAPSHOT writes [0, SnapshotLen) of.
	SnapshotGen uint64
	SnapshotLen int64
	// StoreGen ≠ 0: a seed through the prefill store, as its snapshot of this generation.
	StoreGen uint64
}

// Effect is what an outcome does to its session.
type Effect uint8

// Effects.
const (
	// EffectNone: the record is left as it is (a failure that says nothing of the session).
	EffectNone Effect = iota
	// EffectResident: a seed or reseed succeeded; the session lives on the decision's D in a
	// new generation, with a new snapshot target, released on the D it left.
	EffectResident
	// EffectTruncated: D rewrote its session from a token on (released it on its sidecar and
	// committed it anew): a new generation with a new snapshot target, as after a reseed.
	EffectTruncated
	// EffectExtended: a turn on the session's own D succeeded (DIRECT_TO_D, or a
	// REAL_LARGE_APPEND fallback onto it): no command (its sidecar keeps its target).
	EffectExtended
	// EffectRejected: the session's D rejected the turn (counted towards migration).
	EffectRejected
	// EffectNotResident: D does not hold the session (it evicted it; its EVICTED event may
	// still be on the way): its residency is dropped, so the retry reseeds.
	EffectNotResident
	// EffectSnapshotFailed: the snapshot a reseed used failed; it is not trusted again.
	EffectSnapshotFailed
)

var effectNames = [...]string{"none", "resident", "truncated", "extended", "rejected", "not_resident", "snapshot_failed"}

func (e Effect) String() string {
	if int(e) < len(effectNames) {
		return effectNames[e]
	}
	return "unknown"
}

// extends: the decision's D serves the session where it is resident and keeps it without
// opening it.
func (t *Turn) extends() bool { return t.Decode != "" && t.Keeps && !t.Opens }

// OutcomeEffect classifies outcome o of turn t. A success changes the record only when the
// gateway carried out the decision's own mode (an executed_mode of a fallback says nothing of
// the plan's residency).
func OutcomeEffect(t *Turn, o *kvcv1.RouteOutcome) Effect {
	exec := o.GetExecutedMode()
	if exec == kvcv1.RouteMode_ROUTE_MODE_UNSPECIFIED {
		exec = t.Mode
	}
	if o.GetSuccess() {
		switch {
		case exec != t.Mode:
			return EffectNone
		case t.Opens && t.Decode != "":
			return EffectResident
		case t.extends() && (t.Truncate > 0 || o.GetTruncatedTo() > 0):
			return EffectTruncated
		case t.extends():
			return EffectExtended
		}
		return EffectNone
	}
	switch o.GetErrorKind() {
	case kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D:
		if t.Decode != "" && t.Keeps {
			return EffectRejected
		}
	case kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT:
		if t.Decode != "" {
			return EffectNotResident
		}
	case kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED:
		if t.Mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
			return EffectSnapshotFailed
		}
	}
	return EffectNone
}

// Edited is what Edit did to the record.
type Edited struct {
	// Here: the session is resident on the turn's D after the edit (its content is learnt).
	Here bool
	// Generation is the record's generation after the edit.
	Generation uint64
	// Moved: the session left another decode worker (From) for the turn's D.
	Moved bool
	// Stale is another decode worker the record named when the new residency was made (one
	// that re-reported the session meanwhile, e.g. after its sidecar restarted): its copy is
	// stale and is released.
	Stale string
	// SnapshotPrefill is the prefill worker holding the record's snapshot ("" when none).
	SnapshotPrefill string
	// PinnedUntilMs and Low are the record's agent hints.
	PinnedUntilMs int64
	Low           bool
}

// Edit applies effect e of turn t to rec at nowMs; term is the leader's generation term (a
// new residency's generation is in its range). It never writes kv_committed_len.
func (e Effect) Edit(t *Turn, rec *kvcv1.SessionRecord, nowMs int64, term uint64) Edited {
	var ed Edited
	switch e {
	case EffectResident, EffectTruncated:
		if d := rec.DecodeWorker; d != "" && d != t.Decode && d != t.From {
			ed.Stale = d
		}
		rec.DecodeWorker = t.Decode
		rec.Generation = NextGeneration(rec.Generation, term)
		if t.From != "" && t.From != t.Decode {
			rec.Migrations++
			rec.PreviousDecodeWorker = t.From
			ed.Moved = true
		}
		rec.DRejects = nil
		rec.LastSeenUnixMs = nowMs
		ed.Here = true
	case EffectExtended:
		if rec.DecodeWorker != t.Decode {
			return ed // moved meanwhile; this outcome is about an old residency
		}
		rec.DRejects = nil
		rec.LastSeenUnixMs = nowMs
		ed.Here = true
	case EffectRejected:
		if rec.DRejects == nil {
			rec.DRejects = make(map[string]int32, 1)
		}
		if rec.DRejects[t.Decode] < 1<<30 {
			rec.DRejects[t.Decode]++
		}
	case EffectNotResident:
		// Only if the record still names the residency the decision saw (same D, same
		// generation): a reseed since then stands.
		if rec.DecodeWorker == t.Decode && rec.Generation == t.SessionGen {
			rec.PreviousDecodeWorker = rec.DecodeWorker
			rec.DecodeWorker = ""
		}
	case EffectSnapshotFailed:
		if sn := rec.Snapshot; sn != nil && sn.PrefillWorker == t.Prefill && sn.Generation == t.SnapshotGen {
			rec.Snapshot = nil
		}
	}
	ed.Generation = rec.Generation
	if rec.Snapshot != nil {
		ed.SnapshotPrefill = rec.Snapshot.PrefillWorker
	}
	ed.PinnedUntilMs, ed.Low = rec.PinnedUntilUnixMs, rec.LowPriority
	return ed
}

// Send is one command for a worker's sidecar; Name is its action (the metric label).
type Send struct {
	Worker string
	Name   string
	Cmd    *kvcv1.Command
}

// ResidentCommands are the commands after a new residency of turn t (EffectResident,
// EffectTruncated) that Edit reported as ed, appended to out: ReleaseSession to the decode
// workers whose copy is left behind, then, with snapshots on, the snapshot target on the new D
// (TargetCommand; a reseed's snapshot or a store seed's entry is its valid base) and the
// session's agent hints when it has any (pinnedUntilMs and low: this turn's when it set them,
// else the record's; HintsCommand). With snapshots off the sidecar releases nothing for
// capacity, so neither is sent. trace is the decision's traceparent. noTarget is true when snapshots are on and
// no prefill worker can keep the snapshot.
func ResidentCommands(out []Send, k *Knobs, ws []*kvcv1.Worker, t *Turn, ed Edited, pinnedUntilMs int64, low bool, nowMs int64, trace string) (_ []Send, noTarget bool) {
	var left [2]string // the decode workers whose copy is left behind
	if ed.Moved {
		left[0] = t.From
	}
	left[1] = ed.Stale
	for _, w := range left {
		if w == "" {
			continue
		}
		out = append(out, Send{Worker: w, Name: "release_session", Cmd: &kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{
			SessionId: t.Session, Reason: "moved to " + t.Decode,
		}}, Traceparent: trace}})
	}
	if !k.SnapshotsEnabled {
		return out, false
	}
	tg := Target{Session: t.Session, Generation: ed.Generation, Current: ed.SnapshotPrefill, TP: FindTP(ws, t.Decode)}
	switch {
	case t.StoreGen != 0:
		// A seed through the prefill store: that store holds the session's snapshot, and D
		// loaded the prompt [0, input) from it (its first push appends, re-tagging the entry).
		tg.Current = t.Prefill
		tg.Base = StoreSeedBase(t.Prefill, t.Input, t.StoreGen)
	case t.Mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT:
		// No full re-push after a reseed: D holds exactly [0, SnapshotLen) of the store's
		// snapshot (it was written from there).
		tg.Base = ReseedBase(t.Prefill, t.SnapshotLen, t.SnapshotGen)
	}
	c, _ := TargetCommand(ws, tg)
	if c != nil {
		out = append(out, Send{Worker: t.Decode, Name: "set_snapshot_target", Cmd: &kvcv1.Command{
			Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: c}, Traceparent: trace}})
	}
	if h := HintsCommand(t.Session, pinnedUntilMs, low, nowMs, false); h != nil {
		out = append(out, Send{Worker: t.Decode, Name: "set_session_hints", Cmd: &kvcv1.Command{
			Action: &kvcv1.Command_SetSessionHints{SetSessionHints: h}, Traceparent: trace}})
	}
	return out, c == nil
}
