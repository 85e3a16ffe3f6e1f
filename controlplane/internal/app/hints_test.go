package app

import (
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestAgentHintsEndToEnd: a real control plane on real etcd. A turn of a resident session
// carries a pin and the low-priority hint on the Route stream; once its outcome is in, the
// AdminService shows both on the session (GetSession, ListSessions) and the decode worker's
// sidecar stream gets them on a SetSessionHintsCommand (its snapshot target is not named again).
func TestAgentHintsEndToEnd(t *testing.T) {
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a")
	c.waitLeader(t)
	ctx := t.Context()
	if _, _, err := open(t, c, &kvcv1.Hello{WorkerId: "p0", Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Node: "n1",
		KvCapacityTokens: 100000, WorkerUrl: "http://p0", PeerAddr: "127.0.0.1:1", TransferEndpoint: "p0-seg"}); err != nil {
		t.Fatal(err)
	}
	d0, _, err := open(t, c, decodeHello("d0"))
	if err != nil {
		t.Fatal(err)
	}
	hints := make(chan *kvcv1.SetSessionHintsCommand, 16)
	go func() {
		for {
			m, err := d0.stream.Recv()
			if err != nil {
				return
			}
			cmd := m.GetCommand()
			if cmd == nil {
				continue
			}
			if h := cmd.GetSetSessionHints(); h != nil {
				hints <- h
			}
			_ = d0.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Ack{Ack: &kvcv1.CommandAck{CommandId: cmd.GetCommandId(), Ok: true}}})
		}
	}()
	if err := d0.send(resident(true, "agent-1")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "session resident", func() bool {
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "agent-1"})
		return err == nil && r.GetSession().GetDecodeWorker() == "d0"
	})

	rs, err := kvcv1.NewRouterServiceClient(c.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "r1", SessionId: "agent-1", Turn: 1, InputTokens: 500, MaxOutputTokens: 64, PinMs: 30_000, LowPriority: true,
	}}}); err != nil {
		t.Fatal(err)
	}
	resp, err := rs.Recv()
	if err != nil {
		t.Fatal(err)
	}
	d := resp.GetDecision()
	if d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.GetDecode().GetWorkerId() != "d0" {
		t.Fatalf("decision %v", resp)
	}
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
		DecisionId: d.GetDecisionId(), Success: true, KvLenAfter: 564, ExecutedMode: d.GetMode(),
	}}}); err != nil {
		t.Fatal(err)
	}
	if resp, err := rs.Recv(); err != nil || resp.GetOutcomeAck() == nil {
		t.Fatalf("outcome answer %v %v", resp, err)
	}
	r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "agent-1"})
	if err != nil {
		t.Fatal(err)
	}
	until := r.GetSession().GetPinnedUntilUnixMs()
	if until < before.Add(30*time.Second).UnixMilli() || until > time.Now().Add(30*time.Second).UnixMilli() || !r.GetSession().GetLowPriority() {
		t.Fatalf("GetSession %v: want pinned ~30 s from now, low priority", r.GetSession())
	}
	ls, err := c.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{WorkerId: "d0"})
	if err != nil || len(ls.GetSessions()) != 1 || ls.GetSessions()[0].GetPinnedUntilUnixMs() != until || !ls.GetSessions()[0].GetLowPriority() {
		t.Fatalf("ListSessions %v %v", ls, err)
	}
	deadline := time.After(10 * time.Second)
	for {
		select {
		case h := <-hints:
			if h.GetSessionId() != "agent-1" || h.GetPinnedUntilUnixMs() != until || !h.GetLowPriority() {
				t.Fatalf("hints %v", h)
			}
			return
		case <-deadline:
			t.Fatal("the decode sidecar never got the session's hints")
		}
	}
}
