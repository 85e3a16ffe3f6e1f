package server

import (
	"io"
	"net/http/httptest"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// The plan's prefill from the snapshot (load_prefix_tokens, load_generation) and suffix-only
// receive (receive_from) reach the workers in kv_hints: the load on both halves of a plan that
// calls P (D learns that P computed on loaded KV), receive_from on both halves of a SEED-kind
// transfer; neither when the plan does not carry it.
func TestWorkerBodyLoadAndSuffix(t *testing.T) {
	largeAppend := &kvcv1.RouteExecution{CallPrefill: true, CallDecode: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED,
		KeepSession: true, LoadPrefixTokens: 16_000, LoadGeneration: 7, ReceiveFrom: 16_384}
	reseed := &kvcv1.RouteExecution{CallPrefill: true, CallDecode: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED,
		KeepSession: true, OpenSession: true, LoadPrefixTokens: 16_384, LoadGeneration: 3}
	plain := &kvcv1.RouteExecution{CallPrefill: true, CallDecode: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED}
	tests := []struct {
		name       string
		exec       *kvcv1.RouteExecution
		role       string
		load       int64
		gen        uint64
		receiveFrm int64 // the receive's (D) or the send's (P) from_token
	}{
		{"large append, prefill half", largeAppend, rolePrefill, 16_000, 7, 16_384},
		{"large append, decode half", largeAppend, roleDecode, 16_000, 7, 16_384},
		{"long-tailed reseed, prefill half", reseed, rolePrefill, 16_384, 3, 0},
		{"whole-context prefill", plain, rolePrefill, 0, 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &plan{mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, decisionID: "d-1", prefill: &kvcv1.WorkerRef{WorkerId: "p0", PeerAddr: "10.0.0.2:7000"},
				decode: &kvcv1.WorkerRef{WorkerId: "d0"}, room: 42, exec: tt.exec}
			raw, err := io.ReadAll(workerBody(p, &api.Request{RID: "r1", SessionID: "s1", InputTokens: 25_600, MaxTokens: 4, Text: "hi"}, tt.role).reader())
			if err != nil {
				t.Fatal(err)
			}
			pl := bodyPayload(t, raw)
			var from int64
			if tt.role == roleDecode {
				from = pl.GetReceive().GetFromToken()
			} else {
				from = pl.GetSend().GetFromToken()
			}
			if pl.GetLoadPrefixTokens() != tt.load || pl.GetLoadGeneration() != tt.gen || from != tt.receiveFrm {
				t.Fatalf("payload %v: want load_prefix_tokens %v load_generation %v from_token %v", pl, tt.load, tt.gen, tt.receiveFrm)
			}
		})
	}
}

// The answer says how much of the prompt P loads from its store instead of computing
// (X-KVC-Prefill-Load-Tokens), only when the plan calls P with a load.
func TestRouteHeadersPrefillLoad(t *testing.T) {
	tests := []struct {
		name string
		exec *kvcv1.RouteExecution
		want string
	}{
		{"large append from the snapshot", &kvcv1.RouteExecution{CallPrefill: true, CallDecode: true, LoadPrefixTokens: 16_000}, "16000"},
		{"whole-context prefill", &kvcv1.RouteExecution{CallPrefill: true, CallDecode: true}, ""},
		{"load without a call to P", &kvcv1.RouteExecution{CallDecode: true, LoadPrefixTokens: 16_000}, ""},
		{"no plan (fail-open)", nil, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			s := newSink(rec, &api.Request{RID: "r1", InputTokens: 25_600})
			s.routeHeaders(&plan{mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, exec: tt.exec}, &api.Request{RID: "r1", InputTokens: 25_600})
			if got := rec.Header().Get("X-KVC-Prefill-Load-Tokens"); got != tt.want {
				t.Fatalf("X-KVC-Prefill-Load-Tokens %q, want %q", got, tt.want)
			}
		})
	}
}
