package policy

import (
	"testing"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestPrefillFromSnapshot: a plan in which P computes for a session whose snapshot P's store
// holds loads the snapshot's usable prefix there and prefills only the rest — on the holder
// (p1, although p2 has one request fewer: the load spares more than it), for a large append
// (whose D also receives only the suffix past what it holds), a long-tailed reseed and a
// fallback — and keeps the whole-context prefill when nothing of a snapshot is usable, or on
// the idler P when the holder's extra queue costs more than the load spares (holderPays).
func TestPrefillFromSnapshot(t *testing.T) {
	const pre, tail = 16_384, 9_216
	largeAppend := func() *kvcv1.SessionRecord {
		r := resident("d1", pre)
		r.Snapshot = snap("p1", 16_000)
		return r
	}
	lost := func() *kvcv1.SessionRecord {
		r := resident("", pre)
		r.PreviousDecodeWorker = "d1"
		r.Snapshot = snap("p1", pre)
		return r
	}
	// A lost session whose reseed a gate refuses (seed_max_output_tokens): a plain fallback. (A
	// resident session's turn is no fallback for capacity any more: it waits on its own D.)
	gated := func(p *kvcv1.Policy) { p.SeedMaxOutputTokens = proto.Int64(50) }
	full := func() *kvcv1.SessionRecord {
		r := resident("", 12_000)
		r.PreviousDecodeWorker = "d1"
		r.Snapshot = snap("p1", 12_000)
		return r
	}
	state := func(s kvcv1.WorkerState) func([]*kvcv1.Worker) {
		return func(ws []*kvcv1.Worker) { ws[0].State = s }
	}
	// p1 (the holder) runs one request more than p2 by default (cluster runs it at 2).
	busy := func(running int32) func([]*kvcv1.Worker) {
		return func(ws []*kvcv1.Worker) { ws[0].Load.RunningRequests = running }
	}
	// lowLoad: a snapshot of less than half the prompt (7 000 of 16 100).
	lowLoad := func() *kvcv1.SessionRecord {
		r := resident("", 7_000)
		r.PreviousDecodeWorker = "d1"
		r.Snapshot = snap("p1", 7_000)
		return r
	}
	tests := []struct {
		name    string
		knob    func(p *kvcv1.Policy)
		query   Query
		rec     *kvcv1.SessionRecord
		workers func() []*kvcv1.Worker
		edit    func([]*kvcv1.Worker)
		mode    kvcv1.RouteMode
		reason  kvcv1.RouteReason
		prefill string
		load    int64
		recvFr  int64
		// inFlight: prefills the control plane has in flight on p1 (the ledger)
		inFlight int32
		skipped  bool // Decision.LoadSkippedBusy
	}{
		{name: "large append loads the snapshot, D receives the suffix", query: q(pre+tail, 100, 4), rec: largeAppend(),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND,
			prefill: "p1", load: 16_000, recvFr: pre},
		{name: "long-tailed reseed loads the snapshot", query: q(pre+tail, 100, 4), rec: lost(),
			mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE,
			prefill: "p1", load: pre},
		{name: "fallback of a session with a snapshot loads it", knob: gated, query: q(12_100, 100, 4), rec: full(),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_OUTPUT_TOKENS,
			prefill: "p1", load: 12_000},
		{name: "a snapshot as long as the prompt leaves P its last token", knob: gated, query: q(12_000, 100, 4), rec: full(),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_OUTPUT_TOKENS,
			prefill: "p1", load: 11_999},
		// --- the holder's queue (holderPays): a request ahead counts half a prompt ---
		{name: "holder two requests busier: the whole context on the idle P", query: q(pre+tail, 100, 4), rec: largeAppend(), edit: busy(2),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND,
			prefill: "p2", recvFr: pre, skipped: true},
		{name: "holder busier by prefills in flight: the whole context on the idle P", query: q(pre+tail, 100, 4), rec: lost(), inFlight: 1,
			mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE, prefill: "p2", skipped: true},
		{name: "holder one request busier, a load under half the prompt: the idle P", knob: gated, query: q(16_100, 100, 4), rec: lowLoad(),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_OUTPUT_TOKENS,
			prefill: "p2", skipped: true},
		{name: "holder as loaded as the other P: the holder loads", query: q(pre+tail, 100, 4), rec: largeAppend(), edit: busy(0),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND,
			prefill: "p1", load: 16_000, recvFr: pre},
		{name: "a single prefill worker loads however busy", query: q(pre+tail, 100, 4), rec: largeAppend(), edit: busy(9),
			workers: func() []*kvcv1.Worker {
				return []*kvcv1.Worker{pW("p1", 0), dW("d1", 100_000, 10_000), dW("d2", 100_000, 50_000)}
			},
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND,
			prefill: "p1", load: 16_000, recvFr: pre},
		{name: "snapshots off: whole-context prefill on the least loaded P", knob: func(p *kvcv1.Policy) { p.SnapshotsEnabled = proto.Bool(false) },
			query: q(pre+tail, 100, 4), rec: largeAppend(),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND,
			prefill: "p2", recvFr: pre},
		{name: "holder draining: no load", query: q(pre+tail, 100, 4), rec: lost(), edit: state(kvcv1.WorkerState_WORKER_STATE_DRAINING),
			mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE, prefill: "p2"},
		{name: "holder's worker down: no load", query: q(pre+tail, 100, 4), rec: lost(), edit: state(kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN),
			mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE, prefill: "p2"},
		{name: "snapshot past its staleness: no load", knob: func(p *kvcv1.Policy) { p.SnapshotMaxStalenessMs = proto.Int64(500) },
			query: q(pre+tail, 100, 4), rec: lost(),
			mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE, prefill: "p2"},
		{name: "new session: nothing to load", query: q(pre+tail, 100, 1),
			mode: kvcv1.RouteMode_ROUTE_MODE_SEED, reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, prefill: "p2"},
		{name: "baselines never load", knob: func(p *kvcv1.Policy) { p.KvCentricEnabled = proto.Bool(false) },
			query: q(pre+tail, 100, 4), rec: lost(),
			mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, reason: kvcv1.RouteReason_ROUTE_REASON_KV_CENTRIC_DISABLED},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ws := cluster()
			ws[0].Load.RunningRequests = 1
			if tt.workers != nil {
				ws = tt.workers()
			}
			if tt.edit != nil {
				tt.edit(ws)
			}
			// The large appends of this table are the ones P prefills (not an idle D: onP).
			d := Decide(&Input{Knobs: knobs(func(p *kvcv1.Policy) {
				onP(p)
				if tt.knob != nil {
					tt.knob(p)
				}
			}), Query: tt.query, Session: tt.rec, Workers: ws,
				Ledger: ledger(map[string]Reserved{"p1": {Prefills: tt.inFlight}}), NowMs: nowMs})
			if d.Mode != tt.mode || d.Reason != tt.reason {
				t.Fatalf("%s/%s, want %s/%s", d.Mode, d.Reason, tt.mode, tt.reason)
			}
			if tt.prefill != "" && workerIDOf(d.Prefill) != tt.prefill {
				t.Errorf("prefill worker %q, want %q", workerIDOf(d.Prefill), tt.prefill)
			}
			if d.Exec.LoadPrefixTokens != tt.load || d.Exec.ReceiveFrom != tt.recvFr {
				t.Errorf("load_prefix_tokens %d receive_from %d, want %d and %d", d.Exec.LoadPrefixTokens, d.Exec.ReceiveFrom, tt.load, tt.recvFr)
			}
			if d.LoadSkippedBusy != tt.skipped {
				t.Errorf("load skipped for a busy holder %v, want %v", d.LoadSkippedBusy, tt.skipped)
			}
			if tt.load > 0 && d.Exec.LoadGeneration != tt.rec.Snapshot.Generation {
				t.Errorf("load_generation %d, want the snapshot's %d", d.Exec.LoadGeneration, tt.rec.Snapshot.Generation)
			}
		})
	}
}

// TestPrefillFromSnapshotOnContent: an edited history (the prompt diverges from the session's
// snapshot at token at) whose reseed cannot come from the snapshot alone re-prefills on the
// snapshot's holder after loading only the common prefix: never a token past the edit, page
// aligned, and something whenever a whole page precedes the edit.
func TestPrefillFromSnapshotOnContent(t *testing.T) {
	const held = 16_384
	heldIDs := convo(held, 1)
	heldChain := chainOf(t, heldIDs)
	for at := 0; at < held; at += 211 {
		prompt := append(convo(held, 1, at), convo(9_216, 900_000)...)
		rec := resident("", held)
		rec.PreviousDecodeWorker = "d1"
		rec.Snapshot = snap("p1", held)
		sc := &SnapshotContent{Pages: held / cps, Last: heldChain[held/cps-1], Chain: sparseOf(t, heldChain)}
		ws := cluster()
		ws[0].Load.RunningRequests = 0 // the holder as loaded as p2: its queue does not decide here
		d := Decide(&Input{Knobs: knobs(nil), Query: q(int64(len(prompt)), 50, 5), Session: rec, Workers: ws,
			Ledger: ledger(nil), NowMs: nowMs, Content: &Content{PageSize: cps, Prompt: chainOf(t, prompt), Snapshot: sc}})
		if d.Mode != mPrefill {
			t.Fatalf("edit at %d: %s/%s, want a re-prefill (the tail is past the tolerance)", at, d.Mode, d.Reason)
		}
		n := d.Exec.LoadPrefixTokens
		if n > int64(at) || n%cps != 0 {
			t.Fatalf("edit at %d: loads %d tokens (past the edit or not page aligned)", at, n)
		}
		if at >= 64*cps && n == 0 {
			// pagehash.Sparse keeps a page hash every DefaultStride pages far from the tail: a
			// common prefix of 64 pages or more is always found
			t.Fatalf("edit at %d: nothing loaded", at)
		}
		if n > 0 && workerIDOf(d.Prefill) != "p1" {
			t.Fatalf("edit at %d: a load on %s, not the holder p1", at, workerIDOf(d.Prefill))
		}
	}
}
