package app

import (
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// scripted is a sidecar driven by the test over a real Connect stream: it records the
// commands it receives and acks each, as the real sidecars do.
type scripted struct {
	*cpStream
	mu       sync.Mutex
	released map[string]time.Time
	targets  chan *kvcv1.SetSnapshotTargetCommand
	ended    chan struct{}
}

func startScripted(t *testing.T, c *cp, h *kvcv1.Hello) *scripted {
	t.Helper()
	sc, _, err := open(t, c, h)
	if err != nil {
		t.Fatal(err)
	}
	s := &scripted{cpStream: sc, released: map[string]time.Time{}, targets: make(chan *kvcv1.SetSnapshotTargetCommand, 16), ended: make(chan struct{})}
	go func() {
		defer close(s.ended)
		for {
			m, err := sc.stream.Recv()
			if err != nil {
				return
			}
			cmd := m.GetCommand()
			if cmd == nil {
				continue
			}
			switch a := cmd.GetAction().(type) {
			case *kvcv1.Command_ReleaseSession:
				s.mu.Lock()
				s.released[a.ReleaseSession.GetSessionId()] = time.Now()
				s.mu.Unlock()
			case *kvcv1.Command_SetSnapshotTarget:
				s.targets <- a.SetSnapshotTarget
			}
			_ = sc.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Ack{Ack: &kvcv1.CommandAck{CommandId: cmd.GetCommandId(), Ok: true}}})
		}
	}()
	return s
}

func (s *scripted) releasedAt() map[string]time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]time.Time, len(s.released))
	for k, v := range s.released {
		out[k] = v
	}
	return out
}

func prefillHello(id string) *kvcv1.Hello {
	return &kvcv1.Hello{WorkerId: id, Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Node: "n1", KvCapacityTokens: 100000,
		WorkerUrl: "http://" + id, PeerAddr: "127.0.0.1:1", TransferEndpoint: id + "-seg"}
}

// TestDrainMovesEverySessionOff drains a live decode worker holding four sessions: two with a
// usable snapshot (released at once), one without any snapshot (the drain names a target, the
// scripted prefill ingests a push, then it is released) and one whose snapshot is too far
// behind (released without one after --drain-snapshot-wait). Every session leaves the worker,
// is persisted as not resident there, and its next turn is routed to the other decode worker:
// RESEED_SNAPSHOT from its snapshot, or RESEED_PREFILL for the one without.
func TestDrainMovesEverySessionOff(t *testing.T) {
	e := etcdtest.Start(t)
	const wait = 400 * time.Millisecond
	c := startCP(t, e.Endpoints(), "cp-a", func(o *Options) { o.DrainSnapshotWait = wait })
	c.waitLeader(t)
	ctx := t.Context()

	d1 := startScripted(t, c, decodeHello("d1"))
	startScripted(t, c, decodeHello("d2"))
	p1 := startScripted(t, c, prefillHello("p1"))
	lens := map[string]int64{"s-a": 1000, "s-b": 2000, "s-c": 5000, "s-d": 800}
	rs := &kvcv1.ResidentSessions{FullSync: true}
	for _, id := range []string{"s-a", "s-b", "s-c", "s-d"} {
		rs.Sessions = append(rs.Sessions, &kvcv1.ResidentSession{SessionId: id, KvCommittedLen: lens[id], Generation: 1})
	}
	if err := d1.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: rs}}); err != nil {
		t.Fatal(err)
	}
	snaps := &kvcv1.ResidentSessions{FullSync: true, Snapshots: []*kvcv1.SnapshotHeld{
		{SessionId: "s-a", Seqlen: 1000, Generation: 1}, // current
		{SessionId: "s-b", Seqlen: 1500, Generation: 1}, // behind, within the tail tolerance (2048)
		{SessionId: "s-c", Seqlen: 1000, Generation: 1}, // 4000 behind: not usable, never catches up
	}}
	if err := p1.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: snaps}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "residency and snapshots", func() bool {
		r, err := c.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{WorkerId: "d1"})
		if err != nil || len(r.GetSessions()) != 4 {
			return false
		}
		n := 0
		for _, s := range r.GetSessions() {
			if s.GetSnapshot() != nil {
				n++
			}
		}
		return n == 3
	})

	start := time.Now()
	resp, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d1"})
	if err != nil {
		t.Fatal(err)
	}
	if st := resp.GetStatus(); !resp.GetWorker().GetDraining() || st.GetSessionsAtStart() != 4 || st.GetStartedUnixMs() == 0 {
		t.Fatalf("drain answer %v", resp)
	}
	// s-d has no snapshot: the drain names one for it; the scripted prefill ingests a push.
	// (Targets the resync re-sent for the sessions that have one may come first.)
	for found := false; !found; {
		select {
		case tg := <-d1.targets:
			if tg.GetSessionId() != "s-d" {
				continue
			}
			if tg.GetPrefillWorkerId() != "p1" || tg.GetGeneration() != 1 {
				t.Fatalf("snapshot target %v", tg)
			}
			found = true
		case <-time.After(10 * time.Second):
			t.Fatal("no snapshot target for the session without a snapshot")
		}
	}
	if err := p1.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{
		SessionId: "s-d", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED, KvLen: 800, Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	var st *kvcv1.DrainStatus
	waitFor(t, "drain finished", func() bool {
		r, err := c.admin.GetDrainStatus(ctx, &kvcv1.GetDrainStatusRequest{WorkerId: "d1"})
		st = r.GetStatus()
		return err == nil && !st.GetActive()
	})
	if st.GetSessionsLeft() != 0 || st.GetMovedWithSnapshot() != 3 || st.GetMovedWithoutSnapshot() != 1 || st.GetFailed() != 0 ||
		st.GetCancelled() || st.GetFinishedUnixMs() < st.GetStartedUnixMs() {
		t.Fatalf("drain status %v", st)
	}
	waitFor(t, "every release command received", func() bool { return len(d1.releasedAt()) == 4 })
	rel := d1.releasedAt()
	if got := rel["s-c"].Sub(start); got < wait {
		t.Fatalf("s-c (snapshot not usable) released after %s, before the %s wait", got, wait)
	}
	if got := rel["s-a"].Sub(start); got >= wait {
		t.Fatalf("s-a (snapshot current) released only after %s", got)
	}
	if r, err := c.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{WorkerId: "d1"}); err != nil || len(r.GetSessions()) != 0 {
		t.Fatalf("sessions still on d1: %v %v", r, err)
	}

	// Persisted: etcd says no session lives on d1 (what a new leader would load).
	cli, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	store, err := kvstore.New(cli)
	if err != nil {
		t.Fatal(err)
	}
	for id := range lens {
		waitFor(t, id+" persisted as moved", func() bool {
			r, ok, err := store.GetSession(ctx, id)
			return err == nil && ok && r.GetDecodeWorker() == "" && r.GetPreviousDecodeWorker() == "d1"
		})
	}

	// Nothing lost: each session's next turn goes to d2, from its snapshot where it has one.
	route, err := kvcv1.NewRouterServiceClient(c.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]kvcv1.RouteMode{"s-a": kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, "s-b": kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT,
		"s-c": kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, "s-d": kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT}
	for id, mode := range want {
		if err := route.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
			RequestId: id, SessionId: id, Turn: 2, InputTokens: lens[id] + 100, MaxOutputTokens: 64}}}); err != nil {
			t.Fatal(err)
		}
		m, err := route.Recv()
		if err != nil {
			t.Fatal(err)
		}
		d := m.GetDecision()
		if d.GetMode() != mode || d.GetDecode().GetWorkerId() != "d2" {
			t.Fatalf("%s next turn: %v %v to %s (want %v to d2)", id, d.GetMode(), d.GetReason(), d.GetDecode().GetWorkerId(), mode)
		}
	}
	if !metric(t, c, `kvc_cp_drain_moves_total{result="with_snapshot"} 3`) || !metric(t, c, `kvc_cp_drains_total{event="finished"} 1`) {
		t.Fatal("drain metrics")
	}

	// Undrain re-admits d1 and a drain with nothing resident finishes at once.
	if r, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d1", Undrain: true}); err != nil || r.GetWorker().GetDraining() {
		t.Fatalf("undrain %v %v", r, err)
	}
}

// TestForgetWorker: refused while the sidecar is connected; an unreachable worker is removed
// with its residency from memory and etcd; force removes a connected one and ends its stream.
func TestForgetWorker(t *testing.T) {
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a")
	c.waitLeader(t)
	ctx := t.Context()
	d1 := startScripted(t, c, decodeHello("d1"))
	p1 := startScripted(t, c, prefillHello("p1"))
	if err := d1.send(resident(true, "s-1", "s-2")); err != nil {
		t.Fatal(err)
	}
	if err := p1.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: &kvcv1.ResidentSessions{
		FullSync: true, Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "s-1", Seqlen: 100, Generation: 1}}}}}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "residency", func() bool {
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "s-1"})
		return err == nil && r.GetSession().GetDecodeWorker() == "d1" && r.GetSession().GetSnapshot().GetPrefillWorker() == "p1"
	})
	if _, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{
		MaxConcurrentTransfersPerWorker: map[string]int32{"d1": 2, "p1": 3}}}); err != nil {
		t.Fatal(err)
	}

	cases := []struct {
		name string
		req  *kvcv1.ForgetWorkerRequest
		code codes.Code
	}{
		{"connected", &kvcv1.ForgetWorkerRequest{WorkerId: "d1"}, codes.FailedPrecondition},
		{"unknown", &kvcv1.ForgetWorkerRequest{WorkerId: "nope"}, codes.NotFound},
		{"bad id", &kvcv1.ForgetWorkerRequest{WorkerId: "a/b"}, codes.InvalidArgument},
	}
	for _, tc := range cases {
		if _, err := c.admin.ForgetWorker(ctx, tc.req); code(err) != tc.code {
			t.Fatalf("%s: %v, want %v", tc.name, err, tc.code)
		}
	}

	// Decommissioned: the sidecar is gone (unreachable, residency kept for the grace).
	d1.cancel()
	waitFor(t, "d1 unreachable", func() bool {
		w, err := c.admin.GetWorker(ctx, &kvcv1.GetWorkerRequest{WorkerId: "d1"})
		return err == nil && w.GetWorker().GetState() == kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
	})
	r, err := c.admin.ForgetWorker(ctx, &kvcv1.ForgetWorkerRequest{WorkerId: "d1"})
	if err != nil || r.GetSessionsUnbound() != 2 || r.GetSnapshotsDropped() != 0 {
		t.Fatalf("forget d1: %v %v", r, err)
	}
	if _, err := c.admin.GetWorker(ctx, &kvcv1.GetWorkerRequest{WorkerId: "d1"}); code(err) != codes.NotFound {
		t.Fatalf("d1 after forget: %v", err)
	}
	// Forced while connected: the stream ends.
	r, err = c.admin.ForgetWorker(ctx, &kvcv1.ForgetWorkerRequest{WorkerId: "p1", Force: true})
	if err != nil || r.GetSnapshotsDropped() != 1 {
		t.Fatalf("forget p1: %v %v", r, err)
	}
	select {
	case <-p1.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("forced forget did not end p1's stream")
	}
	s, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "s-1"})
	if err != nil || s.GetSession().GetDecodeWorker() != "" || s.GetSession().GetSnapshot() != nil {
		t.Fatalf("s-1 after forget: %v %v", s, err)
	}
	// etcd: the worker keys are gone (ForgetWorker answers after the flush).
	cli, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	store, err := kvstore.New(cli)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"d1", "p1"} {
		if _, ok, err := store.GetWorker(ctx, id); err != nil || ok {
			t.Fatalf("%s still in etcd (%v)", id, err)
		}
	}
	if rec, ok, err := store.GetSession(ctx, "s-1"); err != nil || !ok || rec.GetDecodeWorker() != "" || rec.GetSnapshot() != nil {
		t.Fatalf("s-1 in etcd: %v %v %v", rec, ok, err)
	}
	if p, err := c.admin.GetPolicy(ctx, &kvcv1.GetPolicyRequest{}); err != nil || len(p.GetPolicy().GetMaxConcurrentTransfersPerWorker()) != 0 {
		t.Fatalf("overrides of forgotten workers kept: %v %v", p.GetPolicy().GetMaxConcurrentTransfersPerWorker(), err)
	}
	ws, err := c.admin.ListWorkers(ctx, &kvcv1.ListWorkersRequest{})
	if err != nil || len(ws.GetWorkers()) != 0 {
		t.Fatalf("workers after forget: %v %v", ws, err)
	}
}
