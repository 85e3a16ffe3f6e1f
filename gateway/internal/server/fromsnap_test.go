package server

import (
	"encoding/json"
	"io"
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
		load, gen  float64 // 0: absent
		receiveFrm float64
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
			var body struct {
				KVHints struct {
					Actions []struct {
						Payload map[string]any `json:"payload"`
					} `json:"actions"`
				} `json:"kv_hints"`
			}
			if err := json.Unmarshal(raw, &body); err != nil || len(body.KVHints.Actions) != 1 {
				t.Fatalf("body %s: %v", raw, err)
			}
			pl := body.KVHints.Actions[0].Payload
			num := func(k string) float64 { v, _ := pl[k].(float64); return v }
			if num("load_prefix_tokens") != tt.load || num("load_generation") != tt.gen || num("receive_from") != tt.receiveFrm {
				t.Fatalf("payload %v: want load_prefix_tokens %v load_generation %v receive_from %v", pl, tt.load, tt.gen, tt.receiveFrm)
			}
			for _, k := range []string{"load_prefix_tokens", "load_generation", "receive_from"} {
				if _, has := pl[k]; has && num(k) == 0 {
					t.Fatalf("%s sent as zero: %v", k, pl)
				}
			}
		})
	}
}
