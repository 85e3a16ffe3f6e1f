package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/proto"
)

func okOutcome() *kvcv1.RouteOutcome { return &kvcv1.RouteOutcome{Success: true} }

func failed(k kvcv1.RouteErrorKind) *kvcv1.RouteOutcome {
	return &kvcv1.RouteOutcome{ErrorKind: k}
}

// TestOutcomeEffect: which effect an outcome has, by the decision's plan and what the gateway
// reports.
func TestOutcomeEffect(t *testing.T) {
	seed := Turn{Mode: mSeed, Decode: "d1", Prefill: "p1", Opens: true, Keeps: true}
	direct := Turn{Mode: mDirect, Decode: "d1", From: "d1", Keeps: true}
	large := Turn{Mode: mFallback, Decode: "d1", From: "d1", Prefill: "p1", Keeps: true}
	plain := Turn{Mode: mFallback, Decode: "d1", Prefill: "p1"}
	snap := Turn{Mode: mSnap, Decode: "d2", Prefill: "p1", Opens: true, Keeps: true}
	truncated := direct
	truncated.Truncate = 512
	tests := []struct {
		name string
		t    Turn
		o    *kvcv1.RouteOutcome
		want Effect
	}{
		{"seed", seed, okOutcome(), EffectResident},
		{"seed carried out as a fallback", seed, &kvcv1.RouteOutcome{Success: true, ExecutedMode: mFallback}, EffectNone},
		{"seed, executed mode named", seed, &kvcv1.RouteOutcome{Success: true, ExecutedMode: mSeed}, EffectResident},
		{"reseed from a snapshot", snap, okOutcome(), EffectResident},
		{"direct", direct, okOutcome(), EffectExtended},
		{"large append on its own D", large, okOutcome(), EffectExtended},
		{"plain fallback", plain, okOutcome(), EffectNone},
		{"truncated by the plan", truncated, okOutcome(), EffectTruncated},
		{"truncated by D", direct, &kvcv1.RouteOutcome{Success: true, TruncatedTo: 256}, EffectTruncated},
		{"rejected by its D", direct, failed(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D), EffectRejected},
		{"rejected, plain fallback", plain, failed(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D), EffectNone},
		{"not resident", direct, failed(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT), EffectNotResident},
		{"not resident, no D", Turn{Mode: mFallback}, failed(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT), EffectNone},
		{"snapshot failed", snap, failed(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED), EffectSnapshotFailed},
		{"snapshot failed, not a snapshot reseed", seed, failed(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED), EffectNone},
		{"transfer failed", seed, failed(kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED), EffectNone},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := OutcomeEffect(&tt.t, tt.o); got != tt.want {
				t.Fatalf("OutcomeEffect = %s, want %s", got, tt.want)
			}
		})
	}
}

// TestEffectEdit: what each effect does to the session record; none writes kv_committed_len
// (its one writer is the decode sidecar's commit).
func TestEffectEdit(t *testing.T) {
	const now = 5_000
	base := func() *kvcv1.SessionRecord {
		return &kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d1", KvCommittedLen: 4100, Generation: 3,
			DRejects: map[string]int32{"d1": 2}, LastSeenUnixMs: 1, PinnedUntilUnixMs: 9000, LowPriority: true,
			Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 4000, Generation: 3}}
	}
	move := Turn{Mode: mSnap, Decode: "d2", From: "d1", Prefill: "p1", Opens: true, Keeps: true, SnapshotGen: 3, SnapshotLen: 4000}
	tests := []struct {
		name string
		e    Effect
		t    Turn
		rec  func(*kvcv1.SessionRecord) // the record before, from base
		want func(*kvcv1.SessionRecord) // the record after, from base
		ed   Edited
	}{
		{name: "resident elsewhere", e: EffectResident, t: move,
			want: func(r *kvcv1.SessionRecord) {
				r.DecodeWorker, r.Generation, r.Migrations, r.PreviousDecodeWorker, r.DRejects, r.LastSeenUnixMs = "d2", 4, 1, "d1", nil, now
			},
			ed: Edited{Here: true, Generation: 4, Moved: true, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "resident, a third worker re-reported it", e: EffectResident, t: move,
			rec: func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d3" },
			want: func(r *kvcv1.SessionRecord) {
				r.DecodeWorker, r.Generation, r.Migrations, r.PreviousDecodeWorker, r.DRejects, r.LastSeenUnixMs = "d2", 4, 1, "d1", nil, now
			},
			ed: Edited{Here: true, Generation: 4, Moved: true, Stale: "d3", SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "truncated in place", e: EffectTruncated, t: Turn{Mode: mDirect, Decode: "d1", From: "d1", Keeps: true, Truncate: 256},
			want: func(r *kvcv1.SessionRecord) { r.Generation, r.DRejects, r.LastSeenUnixMs = 4, nil, now },
			ed:   Edited{Here: true, Generation: 4, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "extended", e: EffectExtended, t: Turn{Mode: mDirect, Decode: "d1", From: "d1", Keeps: true},
			want: func(r *kvcv1.SessionRecord) { r.DRejects, r.LastSeenUnixMs = nil, now },
			ed:   Edited{Here: true, Generation: 3, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "extended, moved meanwhile", e: EffectExtended, t: Turn{Mode: mDirect, Decode: "d2", From: "d2", Keeps: true},
			want: func(r *kvcv1.SessionRecord) {}, ed: Edited{}},
		{name: "rejected", e: EffectRejected, t: Turn{Mode: mDirect, Decode: "d1", Keeps: true},
			want: func(r *kvcv1.SessionRecord) { r.DRejects["d1"] = 3 },
			ed:   Edited{Generation: 3, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "rejected, the count saturates", e: EffectRejected, t: Turn{Mode: mDirect, Decode: "d1", Keeps: true},
			rec:  func(r *kvcv1.SessionRecord) { r.DRejects["d1"] = 1 << 30 },
			want: func(r *kvcv1.SessionRecord) { r.DRejects["d1"] = 1 << 30 },
			ed:   Edited{Generation: 3, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "not resident", e: EffectNotResident, t: Turn{Mode: mDirect, Decode: "d1", SessionGen: 3},
			want: func(r *kvcv1.SessionRecord) { r.DecodeWorker, r.PreviousDecodeWorker = "", "d1" },
			ed:   Edited{Generation: 3, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "not resident, reseeded since", e: EffectNotResident, t: Turn{Mode: mDirect, Decode: "d1", SessionGen: 2},
			want: func(r *kvcv1.SessionRecord) {},
			ed:   Edited{Generation: 3, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "snapshot failed", e: EffectSnapshotFailed, t: Turn{Mode: mSnap, Prefill: "p1", SnapshotGen: 3},
			want: func(r *kvcv1.SessionRecord) { r.Snapshot = nil },
			ed:   Edited{Generation: 3, PinnedUntilMs: 9000, Low: true}},
		{name: "snapshot failed, another snapshot since", e: EffectSnapshotFailed, t: Turn{Mode: mSnap, Prefill: "p1", SnapshotGen: 2},
			want: func(r *kvcv1.SessionRecord) {},
			ed:   Edited{Generation: 3, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
		{name: "none", e: EffectNone, t: Turn{Mode: mSeed, Decode: "d2"},
			want: func(r *kvcv1.SessionRecord) {},
			ed:   Edited{Generation: 3, SnapshotPrefill: "p1", PinnedUntilMs: 9000, Low: true}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := base()
			if tt.rec != nil {
				tt.rec(rec)
			}
			want := proto.Clone(rec).(*kvcv1.SessionRecord)
			tt.want(want)
			ed := tt.e.Edit(&tt.t, rec, now, 0)
			if !proto.Equal(rec, want) {
				t.Fatalf("record %v, want %v", rec, want)
			}
			if tt.e != EffectExtended || tt.ed.Here {
				if ed != tt.ed {
					t.Fatalf("edited %+v, want %+v", ed, tt.ed)
				}
			} else if ed.Here {
				t.Fatalf("edited %+v: here on a worker the session left", ed)
			}
			if rec.KvCommittedLen != 4100 {
				t.Fatalf("kv_committed_len %d written", rec.KvCommittedLen)
			}
		})
	}
}

// TestResidentCommands: a new residency's commands — the release on each worker left behind,
// then with snapshots on the target (a reseed's snapshot or a store seed's entry as its valid
// base) and the hints when there are any, all with the decision's traceparent.
func TestResidentCommands(t *testing.T) {
	p1 := with(pW("p1", 0), func(w *kvcv1.Worker) { w.PeerAddr, w.TransferEndpoint = "p1:1", "p1:2" })
	ws := []*kvcv1.Worker{p1, dW("d1", 1000, 0), dW("d2", 1000, 0)}
	on, off := Compile(Defaults()), Compile(Defaults())
	off.SnapshotsEnabled = false
	const now = 1000
	target := func(gen uint64, base int64, baseGen uint64) Send {
		return Send{Worker: "d2", Name: "set_snapshot_target", Cmd: &kvcv1.Command{Traceparent: "tp", Action: &kvcv1.Command_SetSnapshotTarget{
			SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: "p1", PeerAddr: "p1:1", TransferEndpoint: "p1:2",
				Generation: gen, ValidBaseLen: base, BaseGeneration: baseGen}}}}
	}
	release := func(w string) Send {
		return Send{Worker: w, Name: "release_session", Cmd: &kvcv1.Command{Traceparent: "tp", Action: &kvcv1.Command_ReleaseSession{
			ReleaseSession: &kvcv1.ReleaseSessionCommand{SessionId: "s", Reason: "moved to d2"}}}}
	}
	hints := Send{Worker: "d2", Name: "set_session_hints", Cmd: &kvcv1.Command{Traceparent: "tp", Action: &kvcv1.Command_SetSessionHints{
		SetSessionHints: &kvcv1.SetSessionHintsCommand{SessionId: "s", PinnedUntilUnixMs: 9000, LowPriority: true}}}}
	snap := Turn{Session: "s", Mode: mSnap, Decode: "d2", From: "d1", Prefill: "p1", Opens: true, Keeps: true, SnapshotGen: 3, SnapshotLen: 4000}
	seed := Turn{Session: "s", Mode: mSeed, Decode: "d2", Prefill: "p1", Opens: true, Keeps: true, Input: 900}
	storeSeed := seed
	storeSeed.StoreGen = 4
	tests := []struct {
		name     string
		k        *Knobs
		ws       []*kvcv1.Worker
		t        Turn
		ed       Edited
		until    int64
		low      bool
		want     []Send
		noTarget bool
	}{
		{name: "reseed from a snapshot, moved", k: on, ws: ws, t: snap, ed: Edited{Here: true, Generation: 4, Moved: true, SnapshotPrefill: "p1"},
			want: []Send{release("d1"), target(4, 4000, 3)}},
		{name: "moved, a stale copy too, pinned", k: on, ws: ws, t: snap, ed: Edited{Here: true, Generation: 4, Moved: true, Stale: "d3", SnapshotPrefill: "p1"},
			until: 9000, low: true, want: []Send{release("d1"), release("d3"), target(4, 4000, 3), hints}},
		{name: "seed", k: on, ws: ws, t: seed, ed: Edited{Here: true, Generation: 1}, want: []Send{target(1, 0, 0)}},
		{name: "seed through the store", k: on, ws: ws, t: storeSeed, ed: Edited{Here: true, Generation: 4}, want: []Send{target(4, 900, 4)}},
		{name: "an expired pin is no hint", k: on, ws: ws, t: seed, ed: Edited{Here: true, Generation: 1}, until: now - 1, want: []Send{target(1, 0, 0)}},
		{name: "snapshots off: releases only", k: off, ws: ws, t: snap, ed: Edited{Here: true, Generation: 4, Moved: true}, until: 9000, low: true,
			want: []Send{release("d1")}},
		{name: "no prefill worker: the hints all the same", k: on, ws: ws[1:], t: seed, ed: Edited{Here: true, Generation: 1}, until: 9000, low: true,
			want: []Send{hints}, noTarget: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, noTarget := ResidentCommands(nil, tt.k, tt.ws, &tt.t, tt.ed, tt.until, tt.low, now, "tp")
			if noTarget != tt.noTarget || len(got) != len(tt.want) {
				t.Fatalf("commands %v (no target %v), want %v (no target %v)", got, noTarget, tt.want, tt.noTarget)
			}
			for i := range got {
				if got[i].Worker != tt.want[i].Worker || got[i].Name != tt.want[i].Name || !proto.Equal(got[i].Cmd, tt.want[i].Cmd) {
					t.Fatalf("command %d: %+v, want %+v", i, got[i], tt.want[i])
				}
			}
		})
	}
}
