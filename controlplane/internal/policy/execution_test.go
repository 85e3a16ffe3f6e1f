package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestExecutionPerModeAndReason: the execution plan of every mode/reason pair the policy gives,
// derived from the decision alone (the gateway executes these fields and decides nothing).
func TestExecutionPerModeAndReason(t *testing.T) {
	const (
		tNone = kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED
		tSeed = kvcv1.TransferKind_TRANSFER_KIND_SEED
		tSnap = kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT
		rej   = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D
		xfer  = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TRANSFER_FAILED
		snapF = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED
	)
	P := pW("p1", 0)
	D := dW("d2", 100_000, 0)
	type exp struct {
		prefill, decode, keep, open bool
		transfer                    kvcv1.TransferKind
		close                       string
		onTransfer                  kvcv1.RouteErrorKind
		local                       bool
	}
	fallbackReasons := []kvcv1.RouteReason{
		kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT, kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_EARLY_TURN,
		kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_RESIDENT_TOKENS, kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_OUTPUT_TOKENS,
		kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_SINGLE_TURN, kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_INFLIGHT,
		kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY, kvcv1.RouteReason_ROUTE_REASON_TRANSFER_BUDGET,
		kvcv1.RouteReason_ROUTE_REASON_D_DRAINING, kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE,
		kvcv1.RouteReason_ROUTE_REASON_SESSION_EVICTED, kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER,
		kvcv1.RouteReason_ROUTE_REASON_KV_CENTRIC_DISABLED, kvcv1.RouteReason_ROUTE_REASON_CONTROL_PLANE_UNAVAILABLE,
	}
	type row struct {
		name string
		d    Decision
		unav bool
		want exp
	}
	rows := []row{
		{name: "direct", d: Decision{Mode: mDirect, Reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, Decode: D, From: "d2"},
			want: exp{decode: true, keep: true, transfer: tNone, onTransfer: xfer}},
		{name: "direct on a draining D", d: Decision{Mode: mDirect, Reason: kvcv1.RouteReason_ROUTE_REASON_D_DRAINING, Decode: D, From: "d2",
			Cause: kvcv1.RouteReason_ROUTE_REASON_D_DRAINING},
			want: exp{decode: true, keep: true, transfer: tNone, onTransfer: xfer}},
		{name: "seed", d: Decision{Mode: mSeed, Reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, Prefill: P, Decode: D, UsesPrefill: true},
			want: exp{prefill: true, decode: true, keep: true, open: true, transfer: tSeed, onTransfer: xfer}},
		{name: "reseed snapshot after eviction", d: Decision{Mode: mSnap, Reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, Prefill: P, Decode: D,
			From: "d1", Cause: kvcv1.RouteReason_ROUTE_REASON_SESSION_EVICTED},
			want: exp{decode: true, keep: true, open: true, transfer: tSnap, onTransfer: snapF}},
		{name: "reseed snapshot after migration closes on the old D", d: Decision{Mode: mSnap, Reason: kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS,
			Prefill: P, Decode: D, From: "d1", Cause: kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS},
			want: exp{decode: true, keep: true, open: true, transfer: tSnap, close: "d1", onTransfer: snapF}},
		{name: "reseed prefill off a draining D closes there", d: Decision{Mode: mPrefill, Reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING,
			Prefill: P, Decode: D, UsesPrefill: true, From: "d1", Cause: kvcv1.RouteReason_ROUTE_REASON_D_DRAINING},
			want: exp{prefill: true, decode: true, keep: true, open: true, transfer: tSeed, close: "d1", onTransfer: xfer}},
		{name: "reseed prefill off a dead D closes nothing", d: Decision{Mode: mPrefill, Reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE,
			Prefill: P, Decode: D, UsesPrefill: true, From: "d1", Cause: kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE},
			want: exp{prefill: true, decode: true, keep: true, open: true, transfer: tSeed, onTransfer: xfer}},
		{name: "reseed onto the same D closes nothing", d: Decision{Mode: mSnap, Reason: kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS,
			Prefill: P, Decode: D, From: "d2", Cause: kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS},
			want: exp{decode: true, keep: true, open: true, transfer: tSnap, onTransfer: snapF}},
		{name: "large append keeps the session", d: Decision{Mode: mFallback, Reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND,
			Prefill: P, Decode: D, UsesPrefill: true, From: "d2"},
			want: exp{prefill: true, decode: true, keep: true, transfer: tSeed, onTransfer: xfer}},
		{name: "large append while unavailable keeps nothing", unav: true, d: Decision{Mode: mFallback,
			Reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND, Prefill: P, Decode: D, UsesPrefill: true},
			want: exp{prefill: true, decode: true, transfer: tSeed, onTransfer: xfer}},
		{name: "session decision without a decode worker opens nothing", d: Decision{Mode: mSeed, Reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION,
			Prefill: P, UsesPrefill: true},
			want: exp{prefill: true, transfer: tSeed, onTransfer: xfer}},
	}
	for _, r := range fallbackReasons {
		rows = append(rows, row{name: "fallback " + r.String(), d: Decision{Mode: mFallback, Reason: r, Prefill: P, Decode: D, UsesPrefill: true},
			want: exp{prefill: true, decode: true, transfer: tSeed, onTransfer: xfer}})
	}
	// Issue 16 finding 5: no transfer without a source — D prefills the whole request itself.
	rows = append(rows, row{name: "fallback without a prefill worker prefills on D", d: Decision{Mode: mFallback,
		Reason: kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER, Decode: D, LocalPrefill: true},
		want: exp{decode: true, transfer: tNone, onTransfer: xfer, local: true}},
		row{name: "large append without a prefill worker keeps nothing", d: Decision{Mode: mFallback,
			Reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND, Decode: D, LocalPrefill: true},
			want: exp{decode: true, transfer: tNone, onTransfer: xfer, local: true}})
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			e := execution(&r.d, r.unav)
			got := exp{prefill: e.CallPrefill, decode: e.CallDecode, keep: e.KeepSession, open: e.OpenSession,
				transfer: e.Transfer, close: e.CloseSessionOn, onTransfer: e.OnTransferFailed, local: e.LocalPrefill}
			if got != r.want {
				t.Errorf("execution %+v, want %+v", got, r.want)
			}
			if e.OnDecodeRefused != rej || !e.RetryAllowed {
				t.Errorf("on_decode_refused %v retry %v, want REJECTED_BY_D and true", e.OnDecodeRefused, e.RetryAllowed)
			}
		})
	}
}

// TestDecideCarriesExecution: Decide fills the plan from the rules above, end to end.
func TestDecideCarriesExecution(t *testing.T) {
	in := &Input{Knobs: knobs(nil), Query: q(3_000, 100, 1), Workers: cluster(), Ledger: ledger(map[string]Reserved{}), NowMs: nowMs}
	d := Decide(in)
	if d.Mode != mSeed || !d.Exec.CallPrefill || !d.Exec.OpenSession || !d.Exec.KeepSession || d.Exec.Transfer != kvcv1.TransferKind_TRANSFER_KIND_SEED {
		t.Fatalf("seed: %s %+v", d.Mode, d.Exec)
	}
	rec := resident("d1", 10_000)
	rec.DRejects = map[string]int32{"d1": 3}
	rec.Snapshot = snap("p1", 10_000)
	in = &Input{Knobs: knobs(nil), Query: q(10_500, 100, 4), Session: rec, Workers: cluster(), Ledger: ledger(map[string]Reserved{}), NowMs: nowMs}
	d = Decide(in)
	if d.Mode != mSnap || d.Exec.CloseSessionOn != "d1" || d.Exec.CallPrefill || d.Exec.Transfer != kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT ||
		d.Exec.OnTransferFailed != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED {
		t.Fatalf("migration: %s/%s %+v", d.Mode, d.Reason, d.Exec)
	}
}

func TestInferTurn(t *testing.T) {
	seen := &kvcv1.SessionRecord{Turn: 4, LastSeenUnixMs: 1}
	for _, tt := range []struct {
		name   string
		client int32
		rec    *kvcv1.SessionRecord
		want   int32
	}{
		{"client's turn wins", 7, seen, 7},
		{"new session", 0, nil, 0},
		{"record never seen (created by an event)", 0, &kvcv1.SessionRecord{Turn: 4}, 0},
		{"one more than the last seen", 0, seen, 5},
		{"saturates", 0, &kvcv1.SessionRecord{Turn: 1 << 30, LastSeenUnixMs: 1}, 0},
	} {
		if got := InferTurn(tt.client, tt.rec); got != tt.want {
			t.Errorf("%s: %d, want %d", tt.name, got, tt.want)
		}
	}
	// Decide counts with it: a seed gate on turn sees the inferred turn.
	k := knobs(func(p *kvcv1.Policy) { p.SeedMinTurn = i32(5) })
	rec := &kvcv1.SessionRecord{SessionId: "s", Turn: 4, LastSeenUnixMs: 1}
	d := Decide(&Input{Knobs: k, Query: Query{SessionID: "s", InputTokens: 100, MaxOutputTokens: 1}, Session: rec, Workers: cluster(),
		Ledger: ledger(map[string]Reserved{}), NowMs: nowMs})
	if d.Turn != 5 || d.Mode != mSeed {
		t.Errorf("inferred turn %d mode %s, want 5 and SEED", d.Turn, d.Mode)
	}
}

func TestSnapshotTarget(t *testing.T) {
	p := func(id string, st kvcv1.WorkerState, used, capacity int64, sessions int32) *kvcv1.Worker {
		return &kvcv1.Worker{WorkerId: id, Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, State: st,
			Load: &kvcv1.WorkerLoad{SnapshotBytesUsed: used, SnapshotBytesCapacity: capacity, SnapshotSessions: sessions}}
	}
	ready, down, gone := kvcv1.WorkerState_WORKER_STATE_READY, kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN, kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
	for _, tt := range []struct {
		name    string
		ws      []*kvcv1.Worker
		current string
		want    string
	}{
		{"least used fraction", []*kvcv1.Worker{p("a", ready, 50, 100, 1), p("b", ready, 60, 200, 9)}, "", "b"},
		{"fewest sessions on a tie", []*kvcv1.Worker{p("a", ready, 10, 100, 3), p("b", ready, 10, 100, 2)}, "", "b"},
		{"smallest id on a full tie", []*kvcv1.Worker{p("b", ready, 0, 100, 0), p("a", ready, 0, 100, 0)}, "", "a"},
		{"current holder kept while connected (worker down)", []*kvcv1.Worker{p("a", ready, 0, 100, 0), p("b", down, 90, 100, 9)}, "b", "b"},
		{"current holder gone", []*kvcv1.Worker{p("a", ready, 50, 100, 0), p("b", gone, 0, 100, 0)}, "b", "a"},
		{"draining and down are not new targets", []*kvcv1.Worker{p("a", down, 0, 100, 0), draining(p("b", ready, 0, 100, 0))}, "", ""},
		{"decode workers are not targets", []*kvcv1.Worker{dW("d1", 100, 0)}, "", ""},
	} {
		if got := workerIDOf(SnapshotTarget(tt.ws, tt.current)); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

// The router asks the decision what its plan does instead of branching on the mode.
func TestDecisionPlanPredicates(t *testing.T) {
	d := &kvcv1.Worker{WorkerId: "d"}
	tests := []struct {
		name         string
		dec          Decision
		loads, plain bool
	}{
		{"reseed from the snapshot", Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, Decode: d}, true, false},
		{"reseed by prefill", Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, Decode: d}, false, false},
		{"plain P/D", Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, Decode: d}, false, true},
		{"a refused seed's fallback keeps residency", Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, Decode: d, KeepsResidency: true}, false, false},
		{"direct", Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, Decode: d}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.dec.Exec = execution(&tt.dec, false)
			if got := tt.dec.LoadsSnapshot(); got != tt.loads {
				t.Errorf("LoadsSnapshot = %v, want %v", got, tt.loads)
			}
			if got := tt.dec.PlainPD(); got != tt.plain {
				t.Errorf("PlainPD = %v, want %v", got, tt.plain)
			}
		})
	}
}
