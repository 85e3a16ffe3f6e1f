package router

import (
	"testing"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/pkg/pagehash"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

const tps = 16 // page size of the content tests

func idsN(n int, base uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

// contentQuery is a query carrying the prompt's page chain.
func (f *fixture) contentDecide(session string, ids []uint32, out int64) *kvcv1.RouteDecision {
	f.t.Helper()
	h, _ := pagehash.New(tps, 0)
	req := query(session, 0, int64(len(ids)), out)
	req.GetQuery().PageSize = tps
	req.GetQuery().PromptPages = h.Chain(ids)
	d := f.s.Handle(req).GetDecision()
	if d == nil {
		f.t.Fatalf("no decision for %s", session)
	}
	return d
}

// contentReport reports success with the chain of the generated part (pages past the prompt's).
func (f *fixture) contentReport(d *kvcv1.RouteDecision, prompt, gen []uint32, truncatedTo int64) {
	f.t.Helper()
	h, _ := pagehash.New(tps, 0)
	all := append(append([]uint32(nil), prompt...), gen...)
	chain := h.Chain(all)
	req := outcome(d.DecisionId, true, okKind, int64(len(all)))
	req.GetOutcome().KvPages = chain[len(prompt)/tps:]
	req.GetOutcome().TruncatedTo = truncatedTo
	f.commitFor(d.DecisionId, int64(len(all)))
	if ack := f.s.Handle(req).GetOutcomeAck(); ack == nil {
		f.t.Fatalf("outcome of %s not acknowledged", d.DecisionId)
	}
}

// TestRouteOnContent: a session seeded with hashes goes direct while its history only grows;
// an edit near the end truncates on D (execution.truncate_to) and starts a new KV generation
// with a new snapshot target; a query whose session content the leader does not know is never
// appended to; an invalid content address is INVALID_ARGUMENT.
func TestRouteOnContent(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	prompt := idsN(1_000, 1)
	d := f.contentDecide("c1", prompt, 50)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("first turn: %s/%s", d.Mode, d.Reason)
	}
	gen := idsN(50, 70_000)
	f.contentReport(d, prompt, gen, 0)
	conv := append(append([]uint32(nil), prompt...), gen...)

	// The history grew: direct.
	next := append(append([]uint32(nil), conv...), idsN(200, 80_000)...)
	d = f.contentDecide("c1", next, 40)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.CachedTokens != int64(len(conv)) || d.Execution.GetTruncateTo() != 0 {
		t.Fatalf("grown history: %s/%s cached %d truncate %d", d.Mode, d.Reason, d.CachedTokens, d.Execution.GetTruncateTo())
	}
	gen2 := idsN(40, 90_000)
	f.contentReport(d, next, gen2, 0)
	conv = append(next, gen2...) // 1,290 tokens: 80 full pages

	// The reasoning of the last answer stripped: truncate on D to the common prefix.
	genBefore := f.session("c1").Generation
	targets := len(f.c.Commands(d.Decode.WorkerId))
	edited := append(append([]uint32(nil), conv[:1_250]...), idsN(100, 95_000)...)
	d = f.contentDecide("c1", edited, 40)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Reason != kvcv1.RouteReason_ROUTE_REASON_PREFIX_TRUNCATED ||
		d.CachedTokens != 1_248 || d.Execution.GetTruncateTo() != 1_248 {
		t.Fatalf("edited history: %s/%s cached %d truncate %d", d.Mode, d.Reason, d.CachedTokens, d.Execution.GetTruncateTo())
	}
	f.contentReport(d, edited, idsN(40, 99_000), 1_248)
	if g := f.session("c1").Generation; g != genBefore+1 {
		t.Fatalf("generation %d after a truncation, want %d", g, genBefore+1)
	}
	cmds := f.c.Commands(d.Decode.WorkerId)
	if len(cmds) != targets+1 || cmds[len(cmds)-1].GetSetSnapshotTarget().GetGeneration() != genBefore+1 {
		t.Fatalf("no new snapshot target after the truncation: %v", cmds[targets:])
	}
	if v := testutil.ToFloat64(f.s.m.truncations); v != 1 {
		t.Fatalf("truncations metric %v", v)
	}

	// The record carries the chain the leader holds (contentrecord.go).
	if rec := f.session("c1"); loadChain(rec) == nil {
		t.Fatalf("record's content_chain (%d bytes) does not describe its residency", len(rec.ContentChain))
	}
	// A session resident by length but of unknown content (a new leader without the record's
	// chain, e.g. written before content_chain existed; an outcome without hashes): never
	// appended to on lengths.
	f.s.content.forget("c1")
	f.c.UpdateSession("c1", func(r *kvcv1.SessionRecord) { r.ContentChain = nil })
	d = f.contentDecide("c1", append(append([]uint32(nil), edited...), idsN(40, 99_000)...), 10)
	if d.Reason != kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH || d.Mode == kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
		t.Fatalf("unknown content: %s/%s", d.Mode, d.Reason)
	}

	// Invalid addresses.
	for name, mut := range map[string]func(q *kvcv1.RouteQuery){
		"pages without a page size": func(q *kvcv1.RouteQuery) { q.PageSize = 0 },
		"page size too large":       func(q *kvcv1.RouteQuery) { q.PageSize = 1 << 20 },
		"more pages than the input": func(q *kvcv1.RouteQuery) { q.InputTokens = 16 },
	} {
		req := query("c2", 0, 1_000, 10)
		req.GetQuery().PageSize = tps
		req.GetQuery().PromptPages = make([]uint64, 62)
		mut(req.GetQuery())
		if e := f.s.Handle(req).GetError(); e == nil || e.Code != 3 {
			t.Fatalf("%s: %v, want INVALID_ARGUMENT", name, e)
		}
	}
}

// TestPlaceOnContent: sessions sharing a system prompt with a session resident on a decode
// worker are placed there — a short first turn prefilled on it (LOCAL_FIRST_TURN), a long one
// seeded there (PREFIX_OVERLAP); the prefix index follows the sessions (forgotten sessions
// leave it).
func TestPlaceOnContent(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	system := idsN(640, 5) // 40 pages shared
	first := append(append([]uint32(nil), system...), idsN(400, 100_000)...)
	d := f.contentDecide("a1", first, 20)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || d.Reason != kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION {
		t.Fatalf("first session: %s/%s", d.Mode, d.Reason)
	}
	home := d.Decode.WorkerId
	f.contentReport(d, first, idsN(20, 200_000), 0)
	// Make the other D emptier, so headroom alone would pick it.
	other := "d1"
	if home == "d1" {
		other = "d2"
	}
	f.c.UpdateWorker(home, func(w *kvcv1.Worker) { w.Load.UsedTokens = 60_000 })

	short := append(append([]uint32(nil), system...), idsN(300, 300_000)...)
	d = f.contentDecide("a2", short, 20)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Reason != kvcv1.RouteReason_ROUTE_REASON_LOCAL_FIRST_TURN ||
		d.Decode.WorkerId != home || d.CachedTokens != 640 || !d.Execution.GetLocalPrefill() || !d.Execution.GetOpenSession() || d.Prefill != nil {
		t.Fatalf("short first turn: %s/%s on %s cached %d exec %+v", d.Mode, d.Reason, d.Decode.GetWorkerId(), d.CachedTokens, d.Execution)
	}
	f.contentReport(d, short, idsN(20, 400_000), 0)
	if rec := f.session("a2"); rec.DecodeWorker != home || rec.Generation != 1 {
		t.Fatalf("local first turn did not make the session resident: %+v", rec)
	}

	long := append(append([]uint32(nil), system...), idsN(10_000, 500_000)...)
	d = f.contentDecide("a3", long, 20)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || d.Reason != kvcv1.RouteReason_ROUTE_REASON_PREFIX_OVERLAP || d.Decode.WorkerId != home {
		t.Fatalf("long first turn: %s/%s on %s", d.Mode, d.Reason, d.Decode.GetWorkerId())
	}
	f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, 0)

	// Forgotten sessions leave the index: placement falls back to headroom.
	f.s.content.forget("a1")
	f.s.content.forget("a2")
	d = f.contentDecide("a4", long, 20)
	if d.Reason != kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION || d.Decode.WorkerId != other {
		t.Fatalf("after the index emptied: %s/%s on %s", d.Mode, d.Reason, d.Decode.GetWorkerId())
	}
	if n := len(f.s.content.prefix); n != 0 {
		t.Fatalf("prefix index keeps %d workers after every session left", n)
	}
}

// TestSnapshotCutBackKeepsContent: a re-tag append cuts the store's entry back to the
// page-aligned base before it lands (sidecar-prefill onCut reports that length); when the
// append never lands — the decode worker the session was just reseeded onto died — the
// snapshot stays at the cut length, which no commit has. Its full pages are still those of the
// commit it was pushed from, so its content stays known and the next turn reseeds from it; on
// the old code it was unknown (PREFIX_MISMATCH: a whole-context re-prefill). A cut to fewer
// full pages than any commit of its generation has, or of another generation, stays unknown.
func TestSnapshotCutBackKeepsContent(t *testing.T) {
	cs := newContentStore()
	h, _ := pagehash.New(tps, 0)
	ids := idsN(1_010, 1) // 63 full pages and 2 tokens
	chain := h.Chain(ids)
	const gen = 7
	if e := cs.record("s", "decode-0", tps, chain, nil, 1_010, gen); e == nil {
		t.Fatal("nothing recorded")
	}
	for _, tc := range []struct {
		name  string
		sn    *kvcv1.SnapshotInfo
		pages int
		known bool
	}{
		{"the commit it was pushed from", &kvcv1.SnapshotInfo{Generation: gen, Seqlen: 1_010}, 63, true},
		{"cut back within its partial last page", &kvcv1.SnapshotInfo{Generation: gen, Seqlen: 1_008}, 63, true},
		{"cut back by more than its partial page", &kvcv1.SnapshotInfo{Generation: gen, Seqlen: 992}, 0, false},
		{"another generation", &kvcv1.SnapshotInfo{Generation: gen + 1, Seqlen: 1_008}, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ct policy.Content
			view(cs.get("s"), tps, chain, &kvcv1.SessionRecord{SessionId: "s", Snapshot: tc.sn}, &ct)
			if (ct.Snapshot != nil) != tc.known {
				t.Fatalf("snapshot content %+v, want known=%v", ct.Snapshot, tc.known)
			}
			if tc.known && (ct.Snapshot.Pages != tc.pages || ct.Snapshot.Last != chain[tc.pages-1]) {
				t.Fatalf("snapshot content %d pages, last %x; want %d pages ending in %x", ct.Snapshot.Pages, ct.Snapshot.Last, tc.pages, chain[tc.pages-1])
			}
		})
	}
}
