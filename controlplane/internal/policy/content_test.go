package policy

import (
	"testing"

	"github.com/kvcentric/kvcentric/pkg/pagehash"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

const cps = 16 // page size of the content tests

// convo is a conversation's token ids: n tokens, ids from base; edit rewrites token at.
func convo(n int, base uint32, edits ...int) []uint32 {
	ids := make([]uint32, n)
	for i := range ids {
		ids[i] = base + uint32(i)
	}
	for _, at := range edits {
		ids[at] = 1 << 30
	}
	return ids
}

func chainOf(t *testing.T, ids []uint32) []uint64 {
	t.Helper()
	h, err := pagehash.New(cps, 0)
	if err != nil {
		t.Fatal(err)
	}
	return h.Chain(ids)
}

func sparseOf(t *testing.T, chain []uint64) *pagehash.Sparse {
	t.Helper()
	s, err := pagehash.NewSparse(pagehash.DefaultTail, pagehash.DefaultStride)
	if err != nil {
		t.Fatal(err)
	}
	s.Append(chain)
	return s
}

// TestDecideOnContent covers every branch of the prefix decision: the resident KV is a prefix
// (direct), diverges after a common prefix (truncate on D), diverges with nothing or too much
// to append (reseed: snapshot up to its common prefix, or re-prefill), is unknown, and the
// snapshot's own content check for a session that lost its D.
func TestDecideOnContent(t *testing.T) {
	const committed = 10_000 // 625 pages of 16
	held := convo(committed, 1)
	heldChain := chainOf(t, held)
	grow := func(ids []uint32, n int) []uint32 { // the next prompt: ids + n new tokens
		return append(append([]uint32(nil), ids...), convo(n, 500_000)...)
	}
	snapOf := func(seqlen int64) *SnapshotContent {
		p := int(seqlen / cps)
		return &SnapshotContent{Pages: p, Last: heldChain[p-1], Chain: sparseOf(t, heldChain)}
	}
	type ctc struct {
		name     string
		prompt   []uint32
		resident *pagehash.Sparse
		rec      *kvcv1.SessionRecord
		snap     *SnapshotContent
		k        func(p *kvcv1.Policy)

		mode     kvcv1.RouteMode
		reason   kvcv1.RouteReason
		decode   string
		cached   int64
		truncate int64
		recvFrom int64 // a large append's receive_from: what D keeps of its session
	}
	residentRec := func() *kvcv1.SessionRecord { return resident("d1", committed) }
	evicted := func(seqlen int64) *kvcv1.SessionRecord {
		r := resident("", committed)
		r.PreviousDecodeWorker = "d1"
		r.Snapshot = snap("p1", seqlen)
		return r
	}
	cases := []ctc{
		{name: "resident KV is a prefix: direct", prompt: grow(held, 300), resident: sparseOf(t, heldChain), rec: residentRec(),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, decode: "d1", cached: committed},
		{name: "stripped reasoning near the end: truncate to the common prefix", prompt: grow(convo(9_950, 1), 300),
			resident: sparseOf(t, heldChain), rec: residentRec(),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_TRUNCATED, decode: "d1", cached: 9_936, truncate: 9_936},
		{name: "truncation on a full D is queued there, not a reseed of the whole context", prompt: grow(convo(9_950, 1), 8_000),
			resident: sparseOf(t, heldChain), rec: resident("d2", committed),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_TRUNCATED, decode: "d2", cached: 9_936, truncate: 9_936},
		{name: "edit inside an old turn: truncate at a stride page", prompt: grow(convo(committed, 1, 5_000), 100),
			resident: sparseOf(t, heldChain), rec: residentRec(),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_TRUNCATED, decode: "d1", cached: 4_608, truncate: 4_608},
		{name: "common prefix too short for a direct append: reseed by prefill, old copy closed",
			prompt: grow(convo(committed, 1, 100), 0), resident: sparseOf(t, heldChain), rec: residentRec(),
			k:    func(p *kvcv1.Policy) { p.DirectMaxUncachedTokens = i64(2048) },
			mode: mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, decode: "d1"},
		{name: "nothing in common (first page rewritten): reseed by prefill", prompt: grow(convo(committed, 1, 0), 50),
			resident: sparseOf(t, heldChain), rec: residentRec(),
			mode: mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, decode: "d1"},
		{name: "resident content unknown: never appended to, reseed", prompt: grow(held, 300), rec: residentRec(),
			mode: mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, decode: "d1"},
		{name: "resident chain shorter than the KV (pages unknown): truncate to the known pages", prompt: grow(held, 300),
			resident: sparseOf(t, heldChain[:600]), rec: residentRec(),
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_TRUNCATED, decode: "d1", cached: 9_600, truncate: 9_600},
		{name: "mismatch with a snapshot that shares the prefix: reseed from it up to that prefix",
			prompt: grow(convo(committed, 1, 9_000), 100), resident: sparseOf(t, heldChain), rec: func() *kvcv1.SessionRecord {
				r := residentRec()
				r.Snapshot = snap("p1", 9_600)
				return r
			}(), snap: snapOf(9_600),
			k: func(p *kvcv1.Policy) { p.DirectMaxUncachedTokens = i64(512) },
			// D keeps the common prefix it holds and receives only the tail P prefills (loading
			// the snapshot's common prefix): a large append of the edited history on its own D, not
			// a reseed that reloads the prefix D holds from the store
			mode: mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND, decode: "d1", recvFrom: 8_704}, // the sparse chain: rounded down to a stride page
		{name: "edited history with a tail past the direct limit: large append from the common prefix on its D",
			prompt: grow(convo(committed, 1, 9_000), 3_000), resident: sparseOf(t, heldChain), rec: residentRec(),
			k:    func(p *kvcv1.Policy) { p.DirectMaxUncachedTokens = i64(2048) },
			mode: mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND, decode: "d1", recvFrom: 8_704},
		{name: "compacted history shorter than the session: large append from the common prefix on its D",
			prompt: grow(convo(6_000, 1, 5_000), 3_000), resident: sparseOf(t, heldChain), rec: residentRec(),
			k:    func(p *kvcv1.Policy) { p.DirectMaxUncachedTokens = i64(2048) },
			mode: mFallback, reason: kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND, decode: "d1", recvFrom: 4_608},
		// --- the session lost its D: the snapshot's content decides ---
		{name: "evicted, snapshot is a prefix: reseed from all of it", prompt: grow(held, 300), rec: evicted(9_600), snap: snapOf(9_600),
			mode: mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, cached: 9_600},
		{name: "evicted, snapshot seqlen mid-page: only its full pages", prompt: grow(held, 300), rec: evicted(9_610), snap: snapOf(9_600),
			mode: mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT, cached: 9_600},
		{name: "evicted, history edited inside the snapshot: reseed from the common prefix", prompt: grow(convo(committed, 1, 9_500), 100),
			rec: evicted(9_600), snap: snapOf(9_600),
			mode: mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, cached: 9_216},
		{name: "evicted, common prefix too short for the tail tolerance: re-prefill", prompt: grow(convo(committed, 1, 2_000), 100),
			rec: evicted(9_600), snap: snapOf(9_600),
			mode: mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH},
		// --- the turn is shorter than the snapshot (issue 14 item 8) ---
		{name: "evicted, prompt a shrunken prefix of the snapshot: its full pages", prompt: convo(8_000, 1), rec: evicted(9_600), snap: snapOf(9_600),
			mode: mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, cached: 7_680}, // the sparse chain's stride page
		// 9_300 tokens: 581 full pages (9_296); the sparse chain proves 9_216. The tolerance counts
		// from the full pages: 9_216 ≥ 9_296 − 80 (from the raw input it would be 84 short).
		{name: "evicted, shrunken prompt with a partial last page: tolerance counted from its full pages", prompt: convo(9_300, 1),
			rec: evicted(9_600), snap: snapOf(9_600), k: func(p *kvcv1.Policy) { p.TailToleranceTokens = i64(80) },
			mode: mSnap, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, cached: 9_216},
		{name: "evicted, shrunken prompt edited inside: re-prefill", prompt: convo(8_000, 1, 100), rec: evicted(9_600), snap: snapOf(9_600),
			mode: mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH},
		{name: "evicted, snapshot content unknown: re-prefill", prompt: grow(held, 300), rec: evicted(9_600),
			mode: mPrefill, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			ws := cluster()
			ws[3] = dW("d2", 100_000, 90_000) // d1 is the emptier D: reseeds land there
			in := &Input{Knobs: knobs(tt.k), Query: q(int64(len(tt.prompt)), 100, 5), Session: tt.rec, Workers: ws,
				Ledger: ledger(nil), NowMs: nowMs,
				Content: &Content{PageSize: cps, Prompt: chainOf(t, tt.prompt), Resident: tt.resident, Snapshot: tt.snap}}
			d := Decide(in)
			if d.Mode != tt.mode || d.Reason != tt.reason {
				t.Fatalf("got %s/%s, want %s/%s", d.Mode, d.Reason, tt.mode, tt.reason)
			}
			if tt.decode != "" && (d.Decode == nil || d.Decode.WorkerId != tt.decode) {
				t.Fatalf("decode %v, want %s", d.Decode, tt.decode)
			}
			if d.CachedTokens != tt.cached || d.TruncateTo != tt.truncate || d.Exec.TruncateTo != tt.truncate {
				t.Fatalf("cached %d truncate %d (exec %d), want %d, %d", d.CachedTokens, d.TruncateTo, d.Exec.TruncateTo, tt.cached, tt.truncate)
			}
			if d.ReceiveFrom != tt.recvFrom || d.Exec.ReceiveFrom != tt.recvFrom {
				t.Fatalf("receive_from %d (exec %d), want %d", d.ReceiveFrom, d.Exec.ReceiveFrom, tt.recvFrom)
			}
			if d.Mode == mFallback && (!d.Exec.KeepSession || d.Exec.OpenSession || d.Prefill == nil) {
				t.Fatalf("a large append keeps the session on its D without opening it, P computes: %+v", d.Exec)
			}
			if d.Mode == mSnap && d.SnapshotSeqlen != tt.cached {
				t.Fatalf("snapshot_seqlen %d, want %d", d.SnapshotSeqlen, tt.cached)
			}
			if tt.cached%cps != 0 {
				t.Fatalf("reused KV %d not page aligned", tt.cached)
			}
			if (d.Mode == mPrefill || d.Mode == mSnap) && !d.Exec.OpenSession {
				t.Fatal("a reseed must open the session (replacing the stale copy)")
			}
		})
	}
}

// TestContentNeverReusesMismatchedKV: over random edits of a resident conversation, a
// decision on content never reuses (direct or from the snapshot) a token that is not part of
// the prompt's common prefix with the KV it reuses.
func TestContentNeverReusesMismatchedKV(t *testing.T) {
	const committed = 4_000
	held := convo(committed, 1)
	heldChain := chainOf(t, held)
	for at := 0; at < committed; at += 97 {
		prompt := append(convo(committed, 1, at), convo(200, 900_000)...)
		for _, withSnap := range []bool{false, true} {
			rec := resident("d1", committed)
			var sc *SnapshotContent
			if withSnap {
				rec.Snapshot = snap("p1", 3_200)
				sc = &SnapshotContent{Pages: 200, Last: heldChain[199], Chain: sparseOf(t, heldChain)}
			}
			in := &Input{Knobs: knobs(nil), Query: q(int64(len(prompt)), 50, 5), Session: rec, Workers: cluster(),
				Ledger: ledger(nil), NowMs: nowMs,
				Content: &Content{PageSize: cps, Prompt: chainOf(t, prompt), Resident: sparseOf(t, heldChain), Snapshot: sc}}
			d := Decide(in)
			if d.CachedTokens > int64(at) {
				t.Fatalf("edit at %d (snapshot %v): %s/%s reuses %d tokens", at, withSnap, d.Mode, d.Reason, d.CachedTokens)
			}
			if d.ReceiveFrom > int64(at) || d.Exec.ReceiveFrom > int64(at) {
				t.Fatalf("edit at %d (snapshot %v): %s/%s keeps %d tokens on D", at, withSnap, d.Mode, d.Reason, d.ReceiveFrom)
			}
			if d.Mode == mDirect && d.TruncateTo != d.CachedTokens {
				t.Fatalf("edit at %d: direct without truncation to the reused %d tokens", at, d.CachedTokens)
			}
		}
	}
}

// TestContentUnknownGoesOnLengths: a query without hashes decides as before.
func TestContentUnknownGoesOnLengths(t *testing.T) {
	for _, ct := range []*Content{nil, {PageSize: 0}} {
		d := Decide(&Input{Knobs: knobs(nil), Query: q(12_000, 100, 4), Session: resident("d2", 10_000), Workers: cluster(),
			Ledger: ledger(nil), NowMs: nowMs, Content: ct})
		if d.Mode != mDirect || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT || d.CachedTokens != 10_000 {
			t.Fatalf("content %v: %s/%s cached %d", ct, d.Mode, d.Reason, d.CachedTokens)
		}
	}
}

// TestPlaceNewSessionsOnContent: a new session goes to the decode worker holding the longest
// prefix of its prompt (ahead of headroom), admission permitting; a short first turn is
// prefilled there (LOCAL_FIRST_TURN); without overlap, or where the overlap worker cannot
// admit it, placement is as before.
func TestPlaceNewSessionsOnContent(t *testing.T) {
	type ptc struct {
		name    string
		input   int64
		overlap map[string]int
		full    string // a worker with no room

		mode   kvcv1.RouteMode
		reason kvcv1.RouteReason
		decode string
		cached int64
	}
	cases := []ptc{
		{name: "long first turn: seeded on the overlap worker though it has less headroom", input: 12_800, overlap: map[string]int{"d2": 100},
			mode: mSeed, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_OVERLAP, decode: "d2"},
		{name: "short first turn: prefilled on the overlap worker itself", input: 4_000, overlap: map[string]int{"d2": 100},
			mode: mDirect, reason: kvcv1.RouteReason_ROUTE_REASON_LOCAL_FIRST_TURN, decode: "d2", cached: 1_600},
		{name: "the largest overlap wins", input: 12_800, overlap: map[string]int{"d1": 20, "d2": 100},
			mode: mSeed, reason: kvcv1.RouteReason_ROUTE_REASON_PREFIX_OVERLAP, decode: "d2"},
		{name: "overlap worker full: placed elsewhere as a new session", input: 4_000, overlap: map[string]int{"d2": 100}, full: "d2",
			mode: mSeed, reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, decode: "d1"},
		{name: "overlap worker would have to evict: placed by headroom", input: 4_000, overlap: map[string]int{"d2": 100}, full: "d2-evictable",
			mode: mSeed, reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, decode: "d1"},
		{name: "no overlap: as before", input: 4_000,
			mode: mSeed, reason: kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION, decode: "d1"},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			ws := cluster()
			for i, w := range ws {
				switch tt.full {
				case w.WorkerId:
					ws[i] = dW(w.WorkerId, 100_000, 99_000)
				case w.WorkerId + "-evictable": // full of idle sessions: admits, by evicting
					ws[i] = evictable(dW(w.WorkerId, 100_000, 99_000), 90_000)
				}
			}
			prompt := make([]uint64, tt.input/cps)
			for i := range prompt {
				prompt[i] = uint64(i + 1)
			}
			in := &Input{Knobs: knobs(nil), Query: q(tt.input, 100, 0), Workers: ws, Ledger: ledger(nil), NowMs: nowMs,
				Content: &Content{PageSize: cps, Prompt: prompt, Overlap: tt.overlap}}
			d := Decide(in)
			if d.Mode != tt.mode || d.Reason != tt.reason || d.Decode == nil || d.Decode.WorkerId != tt.decode || d.CachedTokens != tt.cached {
				t.Fatalf("got %s/%s on %v cached %d, want %s/%s on %s cached %d", d.Mode, d.Reason, d.Decode.GetWorkerId(), d.CachedTokens,
					tt.mode, tt.reason, tt.decode, tt.cached)
			}
			if tt.reason == kvcv1.RouteReason_ROUTE_REASON_LOCAL_FIRST_TURN {
				e := d.Exec
				if !e.LocalPrefill || !e.OpenSession || !e.KeepSession || e.CallPrefill || d.Prefill != nil || d.Transfer || d.Seed ||
					e.Transfer != kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED || d.ReservedTokens != tt.input+100 {
					t.Fatalf("local first turn plan %+v (decision %+v)", e, d)
				}
			} else if d.Exec.LocalPrefill {
				t.Fatal("local_prefill on a seed")
			}
		})
	}
}
