package worker

import (
	"context"
	"encoding/json"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// localFallbackBody is a PD_FALLBACK decode call with local_prefill (a fallback without a
// prefill worker, or the gateway's fail-open): no room, no transfer.
func localFallbackBody(rid, session string, ids []int64, keep bool) []byte {
	kv := map[string]any{"mode": "PD_FALLBACK", "role": "decode", "session_id": session, "input_tokens": len(ids),
		"local_prefill": true, "keep_session": keep}
	b := map[string]any{"rid": rid, "input_ids": ids, "stream": false,
		"sampling_params": map[string]any{"max_new_tokens": 3}, "kvc": kv}
	if keep {
		b["session_params"] = map[string]any{"id": session}
	}
	out, _ := json.Marshal(b)
	return out
}

// TestLocalFallbackNeedsNoSidecar (issue 16 findings 2 and 5): a PD_FALLBACK with local_prefill
// is prefilled whole on the decode worker — with its sidecar gone, and next to a resident copy
// of the same session, which it leaves as it was. A local fallback that would keep the session
// is refused.
func TestLocalFallbackNeedsNoSidecar(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	ctx := context.Background()
	first := seqIDs(40, 11)
	done := make(chan struct{})
	go func() {
		defer close(done)
		post(t, ctx, p.url, idsBody("r1", first, 2, kvcReq{Mode: "SEED", Role: "prefill", SessionID: "a", Room: i64(5)}, 0))
	}()
	r := post(t, ctx, d.url, idsBody("r1", first, 2, kvcReq{Mode: "SEED", Role: "decode", SessionID: "a", Room: i64(5)}, 0))
	<-done
	if r.status != 200 {
		t.Fatalf("seed: %d %s", r.status, r.code)
	}
	resident := append(append([]int64(nil), first...), r.ans.OutputIDs...)

	d.sc.stop() // every sidecar call fails from here on
	p.sc.stop()
	next := append(append([]int64(nil), resident...), seqIDs(30, 900)...)
	r = post(t, ctx, d.url, localFallbackBody("r2", "a", next, false))
	if r.status != 200 || r.ans.MetaInfo.KVC.PrefillTokens != int64(len(next)) || len(r.ans.OutputIDs) != 3 {
		t.Fatalf("local fallback without sidecars: %d %s %+v", r.status, r.code, r.ans.MetaInfo.KVC)
	}
	residentVerifies(t, d, "a", resident) // the resident copy is untouched

	if r := post(t, ctx, d.url, localFallbackBody("r3", "a", next, true)); r.status != 400 {
		t.Fatalf("local fallback keeping the session: %d %s", r.status, r.code)
	}
	if r := post(t, ctx, p.url, localFallbackBody("r4", "b", next, false)); r.status != 400 {
		t.Fatalf("local fallback on a prefill worker: %d %s", r.status, r.code)
	}
}
