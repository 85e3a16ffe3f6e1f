package worker

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// localFallbackBody is a PD_FALLBACK decode call with local_prefill (a fallback without a
// prefill worker, or the gateway's fail-open): no room, no transfer.
func localFallbackBody(rid, session string, ids []int64, keep bool) []byte {
	return genBody(&kvcv1.ExecutionPayload{Mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE,
		SessionId: session, InputTokens: int64(len(ids)), LocalPrefill: true, KeepSession: keep},
		map[string]any{"rid": rid, "input_ids": ids, "stream": false, "sampling_params": map[string]any{"max_new_tokens": 3}})
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

// TestEvictWithoutSidecar (issue 23 item 1): with its sidecar gone, a decode worker whose pool
// is full makes room for a fail-open request by evicting an idle session on its own (the
// sidecar reads no pages any more) instead of answering 503 no_capacity "release failed". A
// sidecar that does not know the session (restarted, not yet re-committed to) reads none of
// its pages either; one that is up but fails the release still gets the pages quarantined (it
// may be reading them).
func TestEvictWithoutSidecar(t *testing.T) {
	for _, tc := range []struct {
		name        string
		fail        func(sc *fakeSidecar)
		status      int
		quarantined int64
		sidecarless float64
	}{
		{"sidecar gone", func(sc *fakeSidecar) { sc.stop() }, 200, 0, 1},
		{"sidecar restarted, session not re-committed yet", func(sc *fakeSidecar) {
			sc.mu.Lock()
			sc.releaseErr = status.Error(codes.NotFound, "session a unknown") // the decode sidecar's answer
			sc.mu.Unlock()
		}, 200, 0, 1},
		{"sidecar up, release fails", func(sc *fakeSidecar) {
			sc.mu.Lock()
			sc.releaseErr = status.Error(codes.Internal, "push abort failed")
			sc.mu.Unlock()
		}, 503, 16, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHub()
			p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
			d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 128, zeroTiming()) // 32 pages
			ctx := context.Background()
			first := seqIDs(60, 11)
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
			if got := d.w.Sessions(); len(got) != 1 || !got[0].Committed || got[0].Pages != 16 {
				t.Fatalf("after the seed: %+v", got)
			}
			tc.fail(d.sc)
			big := seqIDs(90, 5000) // with "a" resident (16 pages) only 16 of the 24 pages it needs are free
			r = post(t, ctx, d.url, localFallbackBody("r2", "b", big, false))
			if r.status != tc.status {
				t.Fatalf("fail-open request on a full pool: %d %s, want %d", r.status, r.code, tc.status)
			}
			if got := d.w.Sessions(); len(got) != 0 {
				t.Fatalf("session a still resident after its eviction: %+v", got)
			}
			st := d.w.stats()
			if st.Quarantined != tc.quarantined || st.FreePages != st.PageCount-tc.quarantined {
				t.Fatalf("pages after the eviction: %+v, want %d quarantined and the rest free", st, tc.quarantined)
			}
			if n := testutil.ToFloat64(d.w.m.sidecarlessReleases); n != tc.sidecarless {
				t.Fatalf("kvc_sim_releases_without_sidecar_total = %v, want %v", n, tc.sidecarless)
			}
		})
	}
}
