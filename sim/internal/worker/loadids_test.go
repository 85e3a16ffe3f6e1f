package worker

import (
	"context"
	"slices"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// loadBody is the decode sidecar's load call (LoadSessionCommand): a zero-output SNAPSHOT
// receive of [0, n) into a fresh session, with the snapshot's ids as input_ids when given.
func loadBody(session string, room, n int64, ids []int64) []byte {
	extra := map[string]any{"rid": "load", "stream": false, "sampling_params": map[string]any{"max_new_tokens": 0}}
	if ids != nil {
		extra["input_ids"] = ids
	}
	return genBody(&kvcv1.ExecutionPayload{Mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE,
		SessionId: session, InputTokens: n, CachedTokens: n, KeepSession: true, OpenSession: true, Load: true,
		Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Room: room, Tokens: n}}, extra)
}

// TestLoadWithTokenIDs: a committed session's commit carries its token ids (the prompt's, then
// the generated ones); a load elsewhere that brings them back as input_ids verifies every
// received byte against them (no load_unverified), a load with other ids fails as
// kv_verify_failed, and a load without ids keeps the unverified path; a turn on KV loaded
// unverified commits without ids.
func TestLoadWithTokenIDs(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	ctx := context.Background()
	prompt := seqIDs(41, 70000) // real-looking ids: not kvc-sim's made-up ones
	done := make(chan struct{})
	go func() {
		defer close(done)
		post(t, ctx, p.url, idsBody("r1", prompt, 3, kvcReq{Mode: "SEED", Role: "prefill", SessionID: "a", Room: i64(5)}, 0))
	}()
	r := post(t, ctx, d.url, idsBody("r1", prompt, 3, kvcReq{Mode: "SEED", Role: "decode", SessionID: "a", Room: i64(5)}, 0))
	<-done
	if r.status != 200 {
		t.Fatalf("seed on d0: %d %s", r.status, r.code)
	}
	commits, _ := d.sc.snapshotOf()
	if len(commits) != 1 {
		t.Fatalf("commits %v", commits)
	}
	c := commits[0]
	n := c.GetCommittedLen()
	var want []int64
	want = append(append(want, prompt...), r.ans.OutputIDs...)
	got := make([]int64, len(c.GetTokenIds()))
	for i, id := range c.GetTokenIds() {
		got[i] = int64(id)
	}
	if int64(len(got)) != n || !slices.Equal(got, want[:n]) {
		t.Fatalf("commit of %d tokens carried ids %v, want the prompt and the generated ids %v", n, got, want[:n])
	}

	tests := []struct {
		name       string
		ids        []int64
		status     int
		code       string
		unverified bool
	}{
		{"the snapshot's ids", got, 200, "", false},
		{"other ids", append([]int64{got[0] + 1}, got[1:]...), 500, "kv_verify_failed", false},
		{"no ids", nil, 200, "", true},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d2 := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d"+string(rune('1'+i)), 4096, zeroTiming())
			r := post(t, ctx, d2.url, loadBody("a", int64(10+i), n, tc.ids))
			if r.status != tc.status || r.code != tc.code {
				t.Fatalf("load: %d %s, want %d %s", r.status, r.code, tc.status, tc.code)
			}
			if r.status != 200 {
				return
			}
			k := r.ans.MetaInfo.KVC
			if k.LoadUnverified != tc.unverified || k.VerifyFailures != 0 || (!tc.unverified && k.VerifiedBytes != n*6*8) {
				t.Fatalf("load meta %+v (unverified %v wanted)", k, tc.unverified)
			}
			cs, _ := d2.sc.snapshotOf()
			if len(cs) != 1 || cs[0].GetCommittedLen() != n {
				t.Fatalf("load commits %v", cs)
			}
			if tc.unverified && len(cs[0].GetTokenIds()) != 0 {
				t.Fatalf("a load kept unverified committed %d made-up ids", len(cs[0].GetTokenIds()))
			}
			if !tc.unverified && len(cs[0].GetTokenIds()) != int(n) {
				t.Fatalf("a verified load committed %d ids, want %d", len(cs[0].GetTokenIds()), n)
			}
		})
	}
}
