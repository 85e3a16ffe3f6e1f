package server

import (
	"io"
	"slices"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A tensor-parallel prefill worker's ranks reach every rank of the decode worker in kv_hints
// (prefill_peer_addrs, in rank order): rank r receives from rank r.
func TestWorkerBodyTensorParallel(t *testing.T) {
	tpPrefill := &kvcv1.WorkerRef{WorkerId: "p-a0", WorkerUrl: "http://p", PeerAddr: "10.0.0.1:7000", TpRanks: []*kvcv1.TPRank{
		{TpRank: 0, WorkerId: "p-a0", PeerAddr: "10.0.0.1:7000"}, {TpRank: 1, WorkerId: "p-a1", PeerAddr: "10.0.0.1:7001"}}}
	plain := &kvcv1.WorkerRef{WorkerId: "p0", WorkerUrl: "http://p", PeerAddr: "10.0.0.2:7000"}
	seed := &kvcv1.RouteExecution{CallPrefill: true, CallDecode: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SEED, KeepSession: true}
	snapshot := &kvcv1.RouteExecution{CallDecode: true, Transfer: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, KeepSession: true}
	direct := &kvcv1.RouteExecution{CallDecode: true, KeepSession: true}
	tests := []struct {
		name    string
		prefill *kvcv1.WorkerRef
		exec    *kvcv1.RouteExecution
		role    string
		want    []string // nil: no prefill_peer_addrs key
	}{
		{"seed, decode side", tpPrefill, seed, roleDecode, []string{"10.0.0.1:7000", "10.0.0.1:7001"}},
		{"seed, prefill side (P sends, receives nothing)", tpPrefill, seed, rolePrefill, nil},
		{"reseed from a snapshot", tpPrefill, snapshot, roleDecode, []string{"10.0.0.1:7000", "10.0.0.1:7001"}},
		{"no transfer", tpPrefill, direct, roleDecode, nil},
		{"no tensor parallelism", plain, seed, roleDecode, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := &plan{mode: kvcv1.RouteMode_ROUTE_MODE_SEED, decisionID: "d-1", prefill: tt.prefill, decode: &kvcv1.WorkerRef{WorkerId: "d0"},
				room: 42, exec: tt.exec}
			raw, err := io.ReadAll(workerBody(p, &api.Request{RID: "r1", SessionID: "s1", InputTokens: 100, MaxTokens: 4, Text: "hi"}, tt.role).reader())
			if err != nil {
				t.Fatal(err)
			}
			pl := bodyPayload(t, raw)
			r := pl.GetReceive()
			if tt.want == nil {
				if len(r.GetPeerAddrs()) != 0 {
					t.Fatalf("peer_addrs sent: %v", pl)
				}
				return
			}
			if !slices.Equal(r.GetPeerAddrs(), tt.want) || r.GetPeerAddr() != tt.want[0] {
				t.Fatalf("payload %v", pl)
			}
		})
	}
}
