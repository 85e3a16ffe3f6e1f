package server

import (
	"io"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// BenchmarkWorkerBody: one decode half's /generate body of a seed (the kv_hints payload built
// and encoded), without the prompt text.
func BenchmarkWorkerBody(b *testing.B) {
	p := &plan{mode: kvcv1.RouteMode_ROUTE_MODE_SEED, decisionID: "d-g1-k7cvm", room: 4242, cached: 900,
		prefill: &kvcv1.WorkerRef{WorkerId: "p0", PeerAddr: "10.0.0.2:7000"}, decode: &kvcv1.WorkerRef{WorkerId: "d0"},
		exec: &kvcv1.RouteExecution{CallPrefill: true, CallDecode: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED,
			KeepSession: true, OpenSession: true}}
	req := &api.Request{RID: "r1", SessionID: "s1", InputTokens: 25_600, MaxTokens: 64}
	if sp, e := api.Parse(api.Chat, nil, []byte(`{"messages":[{"role":"user","content":"x"}],"max_tokens":64,"temperature":0.7,"stop":["\n\n"]}`), api.Options{}); e == nil {
		req.Sampling = sp.Sampling // a chat request's sampling_params, as SGLang builds them
	} else {
		b.Fatal(e)
	}
	b.ReportAllocs()
	for b.Loop() {
		for _, role := range []string{rolePrefill, roleDecode} {
			if _, err := io.Copy(io.Discard, workerBody(p, req, role).reader()); err != nil {
				b.Fatal(err)
			}
		}
	}
}
