package worker

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// idsBody is a /generate body with input_ids (the prompt's content) and the decision k in
// kv_hints; truncate > 0 adds truncate_to; Keep set to true marks a local first turn
// (local_prefill, a new session opened here).
func idsBody(rid string, ids []int64, maxNew int64, k kvcReq, truncate int64) []byte {
	local := k.Keep != nil && *k.Keep
	k.Keep, k.InputTokens = nil, int64(len(ids))
	if local {
		k.LocalPrefill = bptr(true)
	}
	p := k.payload()
	p.TruncateTo = truncate
	return genBody(p, map[string]any{"rid": rid, "input_ids": ids, "stream": false,
		"sampling_params": map[string]any{"max_new_tokens": maxNew}})
}

func seqIDs(n int, base int64) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = base + int64(i)
	}
	return out
}

// residentVerifies: the session's KV [0, kv_len) on d is exactly the KV of ids.
func residentVerifies(t *testing.T, d *testWorker, session string, ids []int64) {
	t.Helper()
	d.w.mu.Lock()
	s := d.w.sessions[session]
	pages := append([]int64(nil), s.pages...)
	kv := s.kvLen
	d.w.mu.Unlock()
	if kv != int64(len(ids)) {
		t.Fatalf("session holds %d tokens, the conversation has %d", kv, len(ids))
	}
	u := make([]uint32, len(ids))
	for i, v := range ids {
		u[i] = uint32(v)
	}
	if bad, err := kvpool.CheckContent(d.w.mem, contentKey, u, pages, 0, kv); err != nil || bad != 0 {
		t.Fatalf("resident KV: %d bad slots, %v", bad, err)
	}
}

// TestEditedHistoryNeverServedFromMismatchedKV plays a conversation whose history is edited
// (a token of an earlier turn rewritten, the end of the last answer re-rendered) against one
// decode worker. KV is a function of (token id, position): a direct turn told to reuse KV that
// is not a prefix of its prompt fails kv_verify_failed; truncate_to cuts the session at the
// common prefix and the rest is prefilled; a divergence inside the partial last page (which
// page hashes cannot see) is cut by the worker itself. After every successful turn the
// session's KV is exactly the KV of the conversation the client holds.
func TestEditedHistoryNeverServedFromMismatchedKV(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	ctx := context.Background()
	const sid = "edit-1"

	// Seed: 40 ids, 5 generated (page size 4: 45 tokens, the last page partial).
	prompt := seqIDs(40, 100)
	seed := kvcReq{Mode: "SEED", SessionID: sid, Room: i64(1)}
	var wg sync.WaitGroup
	wg.Add(1)
	var pr result
	go func() {
		defer wg.Done()
		k := seed
		k.Role = "prefill"
		pr = post(t, ctx, p.url, idsBody("r1", prompt, 5, k, 0))
	}()
	k := seed
	k.Role = "decode"
	dr := post(t, ctx, d.url, idsBody("r1", prompt, 5, k, 0))
	wg.Wait()
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("seed: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	if len(dr.ans.OutputIDs) != 5 {
		t.Fatalf("seed answer has %d output_ids, want 5", len(dr.ans.OutputIDs))
	}
	conv := append(append([]int64(nil), prompt...), dr.ans.OutputIDs...)
	residentVerifies(t, d, sid, conv)

	direct := func(rid string, ids []int64, cached, truncate int64) result {
		t.Helper()
		return post(t, ctx, d.url, idsBody(rid, ids, 3, kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: sid, CachedTokens: cached}, truncate))
	}

	// 1. The resident KV is a prefix: direct, nothing rewritten.
	next := append(append([]int64(nil), conv...), seqIDs(7, 900)...)
	r := direct("r2", next, int64(len(conv)), 0)
	if r.status != 200 || r.ans.MetaInfo.KVC.TruncatedTo != 0 || r.ans.MetaInfo.KVC.VerifyFailures != 0 {
		t.Fatalf("prefix turn: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	conv = append(next, r.ans.OutputIDs...) // 55 tokens
	residentVerifies(t, d, sid, conv)

	// 2. History edited at token 10 (a rewritten earlier turn), but the decision reuses all of
	// it (what a length-only decision does): refused, never served.
	edited := append([]int64(nil), conv...)
	edited[10] = 7
	edited = append(edited, seqIDs(4, 950)...)
	r = direct("r3", edited, int64(len(conv)), 0)
	if r.status != http.StatusInternalServerError || r.code != "kv_verify_failed" {
		t.Fatalf("mis-stitched turn: %d %s, want 500 kv_verify_failed", r.status, r.code)
	}
	residentVerifies(t, d, sid, conv) // the failed turn left the session as it was

	// 3. The decision truncates at the common prefix of full pages (8 = 2 pages of 4).
	_, before := d.sc.snapshotOf()
	r = direct("r4", edited, 8, 8)
	if r.status != 200 || r.ans.MetaInfo.KVC.TruncatedTo != 8 || r.ans.MetaInfo.KVC.PrefillTokens != int64(len(edited))-8 {
		t.Fatalf("truncated turn: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	commits, releases := d.sc.snapshotOf()
	if len(releases) != len(before)+1 || releases[len(releases)-1].GetSessionId() != sid {
		t.Fatalf("the sidecar was not told to forget the session before the rewrite: %v", releases)
	}
	conv = append(edited, r.ans.OutputIDs...) // 62 tokens: the last page holds 2
	if last := commits[len(commits)-1]; last.GetCommittedLen() != int64(len(conv)) {
		t.Fatalf("last commit %d, want %d", last.GetCommittedLen(), len(conv))
	}
	residentVerifies(t, d, sid, conv)

	// 4. The end of the last answer re-rendered differently (inside the partial last page):
	// the worker cuts there itself.
	if len(conv)%4 == 0 {
		t.Fatalf("test needs a partial last page, have %d tokens", len(conv))
	}
	seam := append([]int64(nil), conv...)
	seam[len(seam)-1] = 5
	seam = append(seam, seqIDs(6, 990)...)
	r = direct("r5", seam, int64(len(conv)), 0)
	if r.status != 200 || r.ans.MetaInfo.KVC.TruncatedTo != int64(len(conv))-1 || r.ans.MetaInfo.KVC.VerifyFailures != 0 {
		t.Fatalf("seam turn: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	conv = append(seam, r.ans.OutputIDs...)
	residentVerifies(t, d, sid, conv)

	// 5. truncate_to that is not the turn's cached_tokens, or on a transfer mode, is refused.
	if r := direct("r6", conv, 4, 8); r.status != 400 {
		t.Fatalf("truncate_to != cached_tokens: %d %s", r.status, r.code)
	}
}

// TestReceivedKVOfAnotherPromptFailsVerification: KV computed for one prompt (a stale snapshot,
// a seed of the unedited history) does not verify when it arrives for a different prompt.
func TestReceivedKVOfAnotherPromptFailsVerification(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	ctx := context.Background()
	old := seqIDs(24, 10)
	edited := append([]int64(nil), old...)
	edited[20] = 3
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		post(t, ctx, p.url, idsBody("r1", old, 2, kvcReq{Mode: "SEED", Role: "prefill", SessionID: "s", Room: i64(9)}, 0))
	}()
	r := post(t, ctx, d.url, idsBody("r1", edited, 2, kvcReq{Mode: "SEED", Role: "decode", SessionID: "s", Room: i64(9)}, 0))
	wg.Wait()
	if r.status != http.StatusInternalServerError || r.code != "kv_verify_failed" {
		t.Fatalf("KV of another prompt: %d %s, want 500 kv_verify_failed", r.status, r.code)
	}
	if _, ok := sessionsOf(t, d)["s"]; ok {
		t.Fatal("a session whose KV failed verification stayed resident")
	}
}

// TestLocalFirstTurnReusesPrefix: a LOCAL_FIRST_TURN (DIRECT_TO_D with local_prefill) creates
// the session on this decode worker, copies the KV of the longest page-aligned prefix another
// idle session holds (a shared system prompt), verifies it against the new prompt's ids and
// prefills only the rest; without such a session it prefills everything.
func TestLocalFirstTurnReusesPrefix(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	ctx := context.Background()
	system := seqIDs(30, 7) // 7 full pages of 4 and 2 tokens

	// A session holding the system prompt (seeded through P).
	first := append(append([]int64(nil), system...), seqIDs(10, 5000)...)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		post(t, ctx, p.url, idsBody("r1", first, 2, kvcReq{Mode: "SEED", Role: "prefill", SessionID: "a", Room: i64(3)}, 0))
	}()
	if r := post(t, ctx, d.url, idsBody("r1", first, 2, kvcReq{Mode: "SEED", Role: "decode", SessionID: "a", Room: i64(3)}, 0)); r.status != 200 {
		t.Fatalf("seed: %d %s", r.status, r.code)
	}
	wg.Wait()

	local := func(rid, sid string, ids []int64, cached int64) result {
		return post(t, ctx, d.url, idsBody(rid, ids, 3, kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: sid, CachedTokens: cached, Keep: bptr(true)}, 0))
	}
	second := append(append([]int64(nil), system...), seqIDs(20, 9000)...)
	r := local("r2", "b", second, 30)
	if r.status != 200 || r.ans.MetaInfo.KVC.PrefixCachedTokens != 28 || r.ans.MetaInfo.KVC.PrefillTokens != int64(len(second))-28 {
		t.Fatalf("local first turn: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	residentVerifies(t, d, "b", append(second, r.ans.OutputIDs...))

	// Nothing shared: everything prefilled here.
	alone := seqIDs(25, 70_000)
	r = local("r3", "c", alone, 0)
	if r.status != 200 || r.ans.MetaInfo.KVC.PrefixCachedTokens != 0 || r.ans.MetaInfo.KVC.PrefillTokens != 25 {
		t.Fatalf("local first turn without a shared prefix: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	residentVerifies(t, d, "c", append(alone, r.ans.OutputIDs...))

	// local_prefill computes here: a payload that also receives KV is refused.
	pl := kvcReq{Mode: "SEED", Role: "decode", SessionID: "e", Room: i64(4), InputTokens: int64(len(alone))}.payload()
	pl.LocalPrefill = true
	if r := post(t, ctx, d.url, genBody(pl, map[string]any{"rid": "r4", "input_ids": alone, "sampling_params": map[string]any{"max_new_tokens": 1}})); r.status != 400 {
		t.Fatalf("local_prefill with a receive: %d %s", r.status, r.code)
	}
}

// TestLargeAppendOfEditedHistory: a large append whose history was edited or compacted (the
// control plane cut receive_from back to the common prefix on content) is served on the
// session's own decode worker: D keeps [0, receive_from) of what it holds, cuts the session
// there (the sidecar forgets it first, truncated_to), and receives only the pages past it —
// also when the compacted prompt is shorter than the session. A receive_from past the common
// prefix is mis-stitched KV and refused.
func TestLargeAppendOfEditedHistory(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	ctx := context.Background()
	const sid = "edit-large"
	// pdIDs runs both halves of plan k on ids (P's send and D's receive from from).
	pdIDs := func(rid string, ids []int64, k kvcReq, from int64) (pr, dr result) {
		t.Helper()
		kp, kd := k, k
		kp.Role, kd.Role, kp.ReceiveFrom, kd.ReceiveFrom = "prefill", "decode", from, from
		kp.InputTokens, kd.InputTokens = int64(len(ids)), int64(len(ids))
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			pr = post(t, ctx, p.url, genBody(kp.payload(), map[string]any{"rid": rid, "input_ids": ids, "stream": false,
				"sampling_params": map[string]any{"max_new_tokens": 3}}))
		}()
		dr = post(t, ctx, d.url, genBody(kd.payload(), map[string]any{"rid": rid, "input_ids": ids, "stream": false,
			"sampling_params": map[string]any{"max_new_tokens": 3}}))
		if dr.status != http.StatusOK {
			cancel() // as a router would: the decode half failed, abandon the prefill half
		}
		wg.Wait()
		return pr, dr
	}
	// Seed: 40 ids, 5 generated: 45 tokens (page size 4).
	prompt := seqIDs(40, 100)
	pr, dr := pdIDs("r1", prompt, kvcReq{Mode: "SEED", SessionID: sid, Room: i64(1)}, 0)
	if pr.status != 200 || dr.status != 200 {
		t.Fatalf("seed: P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
	}
	conv := append(append([]int64(nil), prompt...), dr.ans.OutputIDs...)
	residentVerifies(t, d, sid, conv)
	large := func(room int64) kvcReq {
		return kvcReq{Mode: "PD_FALLBACK", SessionID: sid, Room: i64(room), Keep: bptr(true)}
	}

	tests := []struct {
		name     string
		edit     func(conv []int64) []int64
		from     int64
		status   int
		code     string
		truncate int64 // D's truncated_to
	}{
		{name: "edited at token 20, tail past it: D keeps 20, receives the rest",
			edit: func(c []int64) []int64 {
				e := append([]int64(nil), c[:20]...)
				return append(e, seqIDs(40, 500)...)
			}, from: 20, status: 200, truncate: 20},
		{name: "compacted below the session's length: D keeps 12 of it",
			edit: func(c []int64) []int64 {
				e := append([]int64(nil), c[:12]...)
				return append(e, seqIDs(20, 700)...)
			}, from: 12, status: 200, truncate: 12},
		{name: "receive_from past the common prefix: mis-stitched, refused",
			edit: func(c []int64) []int64 {
				e := append([]int64(nil), c[:20]...)
				return append(e, seqIDs(40, 800)...)
			}, from: 24, status: http.StatusInternalServerError, code: "kv_verify_failed"},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ids := tt.edit(conv)
			_, before := d.sc.snapshotOf()
			_, dr := pdIDs(fmt.Sprint("r-", i), ids, large(int64(10+i)), tt.from)
			if dr.status != tt.status || dr.code != tt.code {
				t.Fatalf("D %d %s, want %d %s", dr.status, dr.code, tt.status, tt.code)
			}
			if tt.status != 200 {
				residentVerifies(t, d, sid, conv) // the refused turn left the session as it was
				return
			}
			k := dr.ans.MetaInfo.KVC
			if k.TruncatedTo != tt.truncate || k.ReceivedFrom != tt.from || k.VerifyFailures != 0 {
				t.Fatalf("decode meta %+v: want truncated_to %d, received from %d", k, tt.truncate, tt.from)
			}
			if _, releases := d.sc.snapshotOf(); len(releases) != len(before)+1 {
				t.Fatalf("the sidecar was not told to forget the session before the rewrite: %v", releases)
			}
			conv = append(ids, dr.ans.OutputIDs...)
			residentVerifies(t, d, sid, conv)
		})
	}
}
