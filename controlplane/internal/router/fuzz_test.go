package router

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/proto"
)

// FuzzRouteRequest feeds arbitrary bytes, decoded as a RouteRequest, to a router that has
// three decisions outstanding: nothing panics, every answer is a decision, ack or error, and the
// ledger stays consistent (no leak, no double release, nothing negative), also when the same
// message comes twice.
func FuzzRouteRequest(f *testing.F) {
	seeds := []*kvcv1.RouteRequest{
		query("s", 0, 1000, 10),
		query("s", 3, 10_000_000, 1_000_000),
		{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{SessionId: "a/b", InputTokens: -1, Turn: -4}}},
		outcome("dfuzz0000-1", true, okKind, 1010),
		outcome("dfuzz0000-2", false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0),
		outcome("dfuzz0000-3", false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED, 0),
		outcome("dfuzz0000-99", true, okKind, 0),
		{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{DecisionId: "dfuzz0000-1", Success: true, ExecutedMode: 4, KvLenAfter: -3}}},
		{},
	}
	for _, s := range seeds {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0xff, 0x01})
	f.Fuzz(func(t *testing.T, data []byte) {
		var req kvcv1.RouteRequest
		if proto.Unmarshal(data, &req) != nil {
			return
		}
		fx := newFixture(t, basicCluster()...)
		fx.s.prefix = "dfuzz0000-"
		fx.c.PutSession(&kvcv1.SessionRecord{SessionId: "r", Generation: 1, LastSeenUnixMs: 1,
			Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 900, Generation: 1, UpdatedUnixMs: fx.now.UnixMilli()}})
		fx.decide("s", 0, 1000, 10)
		fx.decide("t", 0, 2000, 10)
		fx.decide("r", 2, 1000, 10)
		for range 2 {
			resp := fx.s.Handle(&req)
			if resp.GetDecision() == nil && resp.GetOutcomeAck() == nil && resp.GetError() == nil {
				t.Fatalf("empty answer to %v", &req)
			}
			fx.checkLedger()
		}
	})
}
