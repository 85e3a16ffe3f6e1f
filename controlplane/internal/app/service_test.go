package app

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	"github.com/kvcentric/kvcentric/pkg/launch"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type cp struct {
	node     string
	grpcAddr string
	httpAddr string
	cancel   context.CancelFunc
	done     chan struct{}
	conn     *grpc.ClientConn
	admin    kvcv1.AdminServiceClient
}

// startCP runs a control plane in this process (real gRPC and HTTP on loopback port 0).
func startCP(t *testing.T, endpoints []string, node string, mods ...func(*Options)) *cp {
	t.Helper()
	o := NewOptions()
	o.NodeID = node
	o.GRPCAddr, o.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0"
	o.EtcdEndpoints = strings.Join(endpoints, ",")
	o.ElectionTTL = 2 * time.Second
	o.UnreachableGrace = 30 * time.Second
	o.FlushDelay = 10 * time.Millisecond
	o.ShutdownGrace = 2 * time.Second
	o.ReadyFile = filepath.Join(t.TempDir(), "ready.json")
	o.TLS.Insecure = true // a mod that sets o.TLS replaces it
	for _, m := range mods {
		m(o)
	}
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &cp{node: node, cancel: cancel, done: make(chan struct{})}
	go func() { _ = Run(ctx, o, zerolog.Nop()); close(c.done) }()
	t.Cleanup(c.stop)
	var info readyInfo
	waitFor(t, "ready file", func() bool {
		b, err := os.ReadFile(o.ReadyFile)
		return err == nil && json.Unmarshal(b, &info) == nil
	})
	c.grpcAddr, c.httpAddr = info.GRPCAddr, info.HTTPAddr
	conn, err := grpc.NewClient(c.grpcAddr, append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	c.conn, c.admin = conn, kvcv1.NewAdminServiceClient(conn)
	return c
}

func (c *cp) stop() {
	c.cancel()
	select {
	case <-c.done:
	case <-time.After(15 * time.Second):
		panic("control plane did not stop within 15s")
	}
}

func (c *cp) leader(t *testing.T) *kvcv1.GetLeaderResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	r, err := c.admin.GetLeader(ctx, &kvcv1.GetLeaderRequest{})
	if err != nil {
		return &kvcv1.GetLeaderResponse{}
	}
	return r
}

func (c *cp) waitLeader(t *testing.T) int64 {
	t.Helper()
	var epoch int64
	waitFor(t, c.node+" leading", func() bool {
		r := c.leader(t)
		epoch = r.GetEpoch()
		return r.GetResponderIsLeader() && r.GetLeaderId() == c.node
	})
	return epoch
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	launch.WaitForT(t, what, 20*time.Second, 10*time.Millisecond, cond)
}

type cpStream struct {
	stream grpc.BidiStreamingClient[kvcv1.ConnectRequest, kvcv1.ConnectResponse]
	cancel context.CancelFunc
}

func dial(t *testing.T, c *cp) (*cpStream, error) {
	ctx, cancel := context.WithCancel(t.Context())
	st, err := kvcv1.NewSidecarServiceClient(c.conn).Connect(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &cpStream{stream: st, cancel: cancel}
	t.Cleanup(cancel)
	return s, nil
}

// open sends a hello and waits for the welcome.
func open(t *testing.T, c *cp, h *kvcv1.Hello) (*cpStream, *kvcv1.Welcome, error) {
	s, err := dial(t, c)
	if err != nil {
		return nil, nil, err
	}
	if err := s.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: h}}); err != nil {
		// A server that ended the stream before reading the hello (a standby's Unavailable with
		// its leader hint) makes Send return io.EOF; the stream's status comes with Recv.
		if errors.Is(err, io.EOF) {
			if _, rerr := s.stream.Recv(); rerr != nil {
				return nil, nil, rerr
			}
		}
		return nil, nil, err
	}
	m, err := s.stream.Recv()
	if err != nil {
		return nil, nil, err
	}
	return s, m.GetWelcome(), nil
}

func (s *cpStream) send(m *kvcv1.ConnectRequest) error { return s.stream.Send(m) }

func decodeHello(id string) *kvcv1.Hello {
	return &kvcv1.Hello{WorkerId: id, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, Node: "n1", KvCapacityTokens: 100000, WorkerUrl: "http://" + id}
}

func resident(full bool, ids ...string) *kvcv1.ConnectRequest {
	rs := &kvcv1.ResidentSessions{FullSync: full}
	for i, id := range ids {
		rs.Sessions = append(rs.Sessions, &kvcv1.ResidentSession{SessionId: id, KvCommittedLen: int64(100 + i)})
	}
	return &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: rs}}
}

func code(err error) codes.Code { return status.Code(err) }

func metric(t *testing.T, c *cp, line string) bool {
	resp, err := http.Get("http://" + c.httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strings.Contains(string(b), line)
}

func TestConnectBadInput(t *testing.T) {
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a")
	c.waitLeader(t)

	long := strings.Repeat("w", kvcv1.MaxIDLen+1)
	for _, tc := range []struct {
		name  string
		first *kvcv1.ConnectRequest
		want  codes.Code
	}{
		{"load before hello", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Load{Load: &kvcv1.LoadReport{}}}, codes.FailedPrecondition},
		{"empty message first", &kvcv1.ConnectRequest{}, codes.FailedPrecondition},
		{"empty worker id", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE}}}, codes.InvalidArgument},
		{"oversized worker id", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: decodeHello(long)}}, codes.InvalidArgument},
		{"slash in worker id", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: decodeHello("a/b")}}, codes.InvalidArgument},
		{"unknown role", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{WorkerId: "x", Role: 7}}}, codes.InvalidArgument},
		{"unspecified role", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{WorkerId: "x"}}}, codes.InvalidArgument},
		{"negative gpu", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{WorkerId: "x", Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, GpuIndex: -1}}}, codes.InvalidArgument},
		{"negative capacity", &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{WorkerId: "x", Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, KvCapacityTokens: -5}}}, codes.InvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := dial(t, c)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.send(tc.first); err != nil {
				t.Fatal(err)
			}
			_, err = s.stream.Recv()
			if code(err) != tc.want {
				t.Fatalf("got %v, want %s", err, tc.want)
			}
			if status.Convert(err).Message() == "" {
				t.Fatal("no message")
			}
		})
	}

	t.Run("message over the size limit", func(t *testing.T) {
		raw, err := grpc.NewClient(c.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer raw.Close()
		st, err := kvcv1.NewSidecarServiceClient(raw).Connect(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		h := decodeHello("big")
		h.WorkerUrl = strings.Repeat("u", grpcx.ServerMaxRecvMsgSize+1)
		_ = st.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: h}})
		if _, err := st.Recv(); code(err) != codes.ResourceExhausted {
			t.Fatalf("got %v", err)
		}
	})

	t.Run("second hello ends the stream", func(t *testing.T) {
		s, _, err := open(t, c, decodeHello("twice"))
		if err != nil {
			t.Fatal(err)
		}
		_ = s.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: decodeHello("twice")}})
		if _, err := s.stream.Recv(); code(err) != codes.FailedPrecondition {
			t.Fatalf("got %v", err)
		}
	})

	t.Run("bad messages are dropped, the stream keeps working", func(t *testing.T) {
		s, w, err := open(t, c, decodeHello("d-good"))
		if err != nil || w.GetEpoch() == 0 || w.GetLeaderId() != "cp-a" || w.GetPolicy().GetDirectMaxUncachedTokens() != 8192 {
			t.Fatalf("welcome %v err %v", w, err)
		}
		// A duplicate worker id on a second live stream is refused; the first keeps working.
		if _, _, err := open(t, c, decodeHello("d-good")); code(err) != codes.AlreadyExists {
			t.Fatalf("duplicate: %v", err)
		}
		bad := []*kvcv1.ConnectRequest{
			{Msg: &kvcv1.ConnectRequest_Load{Load: &kvcv1.LoadReport{Load: &kvcv1.WorkerLoad{UsedTokens: -1}}}},
			{Msg: &kvcv1.ConnectRequest_Load{Load: &kvcv1.LoadReport{}}},
			{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{SessionId: "s", Kind: 99}}},
			{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{SessionId: "a/b", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED}}},
			{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{SessionId: "s", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: -4}}},
			{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{SessionId: "s", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED}}},
			resident(true, ""),
			resident(true, "dup", "dup"),
			{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: &kvcv1.ResidentSessions{Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "s"}}}}},
			{Msg: &kvcv1.ConnectRequest_Ack{Ack: &kvcv1.CommandAck{CommandId: 424242, Ok: true}}},
			{},
		}
		for _, m := range bad {
			if err := s.send(m); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Load{Load: &kvcv1.LoadReport{Load: &kvcv1.WorkerLoad{UsedTokens: 77}}}}); err != nil {
			t.Fatal(err)
		}
		if err := s.send(resident(true, "s-ok")); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "good messages applied", func() bool {
			r, err := c.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: "s-ok"})
			if err != nil || r.GetSession().GetDecodeWorker() != "d-good" {
				return false
			}
			w, err := c.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d-good"})
			return err == nil && w.GetWorker().GetLoad().GetUsedTokens() == 77
		})
		for _, id := range []string{"s", "dup"} {
			if _, err := c.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: id}); code(err) != codes.NotFound {
				t.Fatalf("rejected message created session %q: %v", id, err)
			}
		}
		for _, line := range []string{
			`kvc_cp_stream_messages_rejected_total{reason="invalid_load"} 2`,
			`kvc_cp_stream_messages_rejected_total{reason="unknown_event_kind"} 1`,
			`kvc_cp_stream_messages_rejected_total{reason="invalid_event"} 2`,
			`kvc_cp_stream_messages_rejected_total{reason="role_mismatch"} 2`,
			`kvc_cp_stream_messages_rejected_total{reason="invalid_resident"} 2`,
			`kvc_cp_stream_messages_rejected_total{reason="unknown_ack"} 1`,
			`kvc_cp_stream_messages_rejected_total{reason="empty_message"} 1`,
			`kvc_cp_stream_messages_rejected_total{reason="duplicate_worker"} 1`,
		} {
			if !metric(t, c, line) {
				t.Errorf("metric line missing: %s", line)
			}
		}
	})
}

func TestAdminBadInputAndCommands(t *testing.T) {
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a")
	epoch := c.waitLeader(t)
	ctx := t.Context()
	for _, tc := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"get worker empty id", func() error { _, err := c.admin.GetWorker(ctx, &kvcv1.GetWorkerRequest{}); return err }, codes.InvalidArgument},
		{"get session bad id", func() error {
			_, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "x\x01"})
			return err
		}, codes.InvalidArgument},
		{"list sessions page size", func() error {
			_, err := c.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{PageSize: 5000})
			return err
		}, codes.InvalidArgument},
		{"list sessions negative page", func() error {
			_, err := c.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{PageSize: -1})
			return err
		}, codes.InvalidArgument},
		{"list workers unknown role", func() error { _, err := c.admin.ListWorkers(ctx, &kvcv1.ListWorkersRequest{Role: 9}); return err }, codes.InvalidArgument},
		{"update policy nil", func() error { _, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{}); return err }, codes.InvalidArgument},
		{"update policy threshold 0", func() error {
			_, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{MigrationRejectThreshold: proto.Int32(0)}})
			return err
		}, codes.InvalidArgument},
		{"update policy headroom", func() error {
			_, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{DCapacityHeadroom: proto.Float64(1.5)}})
			return err
		}, codes.InvalidArgument},
		{"update policy negative tokens", func() error {
			_, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{DirectMaxUncachedTokens: proto.Int64(-1)}})
			return err
		}, codes.InvalidArgument},
		{"update policy override of an unknown worker", func() error {
			_, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{MaxConcurrentTransfersPerWorker: map[string]int32{"ghost": 2}}})
			return err
		}, codes.InvalidArgument},
		{"get session missing", func() error {
			_, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "nope"})
			return err
		}, codes.NotFound},
		{"drain missing", func() error {
			_, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "nope"})
			return err
		}, codes.NotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := code(tc.call()); got != tc.want {
				t.Fatalf("code %s, want %s", got, tc.want)
			}
		})
	}
	// Nothing reached etcd.
	cli := e.Client(t)
	store, _ := kvstore.New(cli)
	if _, ok, err := store.GetPolicy(ctx); ok || err != nil {
		t.Fatalf("a rejected update stored a policy (%v)", err)
	}

	s, w, err := open(t, c, decodeHello("d0"))
	if err != nil || w.GetEpoch() != epoch {
		t.Fatalf("open: %v %v", w, err)
	}
	up, err := c.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{SeedMinTurn: proto.Int32(2)}})
	if err != nil || up.GetPolicy().GetVersion() != 1 || up.GetPolicy().GetSeedMinTurn() != 2 {
		t.Fatalf("update %v %v", up, err)
	}
	if _, err := c.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d0"}); err != nil {
		t.Fatal(err)
	}
	var last uint64
	for _, want := range []string{"update_policy", "drain"} {
		m, err := s.stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		cmd := m.GetCommand()
		if cmd.GetEpoch() != epoch || cmd.GetCommandId() <= last {
			t.Fatalf("command %v (epoch %d, last id %d)", cmd, epoch, last)
		}
		last = cmd.GetCommandId()
		switch want {
		case "update_policy":
			if cmd.GetUpdatePolicy().GetPolicy().GetSeedMinTurn() != 2 {
				t.Fatalf("want policy push, got %v", cmd)
			}
		case "drain":
			if !cmd.GetDrain().GetDraining() {
				t.Fatalf("want drain, got %v", cmd)
			}
		}
		if err := s.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Ack{Ack: &kvcv1.CommandAck{CommandId: cmd.GetCommandId(), Ok: true}}}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "acks counted", func() bool { return metric(t, c, `kvc_cp_commands_total{result="acked"} 2`) })
	wr, err := c.admin.GetWorker(ctx, &kvcv1.GetWorkerRequest{WorkerId: "d0"})
	if err != nil || wr.GetWorker().GetState() != kvcv1.WorkerState_WORKER_STATE_DRAINING {
		t.Fatalf("worker %v %v", wr, err)
	}
	p, ok, err := store.GetPolicy(ctx)
	if err != nil || !ok || p.GetVersion() != 1 || p.GetSeedMinTurn() != 2 {
		t.Fatalf("stored policy %v %v %v", p, ok, err)
	}
}

func TestStandbyGatingAndReads(t *testing.T) {
	e := etcdtest.Start(t)
	a := startCP(t, e.Endpoints(), "cp-a")
	a.waitLeader(t)
	b := startCP(t, e.Endpoints(), "cp-b")
	waitFor(t, "standby sees leader", func() bool {
		r := b.leader(t)
		return r.GetLeaderId() == "cp-a" && !r.GetResponderIsLeader()
	})
	ctx := t.Context()
	wantHint := func(err error) {
		t.Helper()
		h, ok := cpclient.LeaderHintFrom(err)
		if code(err) != codes.Unavailable || !ok || h.GetLeaderAddr() != a.grpcAddr || h.GetLeaderId() != "cp-a" {
			t.Fatalf("standby answer %v (hint %v)", err, h)
		}
	}
	_, _, err := open(t, b, decodeHello("d0"))
	wantHint(err)
	rs, err := kvcv1.NewRouterServiceClient(b.conn).Route(ctx)
	if err == nil {
		_, err = rs.Recv()
	}
	wantHint(err)
	_, err = b.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{SeedMinTurn: proto.Int32(1)}})
	wantHint(err)
	_, err = b.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d0"})
	wantHint(err)

	hc := func(c *cp, svc string) healthpb.HealthCheckResponse_ServingStatus {
		r, err := healthpb.NewHealthClient(c.conn).Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetStatus()
	}
	for _, svc := range []string{"kvc.v1.RouterService", "kvc.v1.SidecarService"} {
		if hc(b, svc) != healthpb.HealthCheckResponse_NOT_SERVING || hc(a, svc) != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("%s health: leader %s standby %s", svc, hc(a, svc), hc(b, svc))
		}
	}
	if hc(b, "kvc.v1.AdminService") != healthpb.HealthCheckResponse_SERVING {
		t.Fatal("standby admin not serving")
	}

	// The standby reads what the leader persisted.
	s, _, err := open(t, a, decodeHello("d0"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.send(resident(true, "s1", "s2", "s3")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "standby reads the sessions from etcd", func() bool {
		r, err := b.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{WorkerId: "d0", PageSize: 2})
		if err != nil || len(r.GetSessions()) != 2 || r.GetNextPageToken() == "" {
			return false
		}
		r2, err := b.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{WorkerId: "d0", PageSize: 2, PageToken: r.GetNextPageToken()})
		return err == nil && len(r2.GetSessions()) == 1 && r2.GetNextPageToken() == ""
	})
	wb, err := b.admin.GetWorker(ctx, &kvcv1.GetWorkerRequest{WorkerId: "d0"})
	if err != nil || wb.GetWorker().GetConnectedTo() != "cp-a" {
		t.Fatalf("standby worker read %v %v", wb, err)
	}
	pb, err := b.admin.GetPolicy(ctx, &kvcv1.GetPolicyRequest{})
	if err != nil || pb.GetPolicy().GetMigrationRejectThreshold() != 3 {
		t.Fatalf("standby policy %v %v", pb, err)
	}
}

func TestStaleEpochHelloStepsDown(t *testing.T) {
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a")
	epoch := c.waitLeader(t)
	h := decodeHello("d0")
	h.LastEpochSeen = epoch + 1000
	_, _, err := open(t, c, h)
	if code(err) != codes.Unavailable || !strings.Contains(status.Convert(err).Message(), "stale") {
		t.Fatalf("stale hello: %v", err)
	}
	waitFor(t, "re-election with a new epoch", func() bool {
		r := c.leader(t)
		return r.GetResponderIsLeader() && r.GetEpoch() > epoch
	})
	if !metric(t, c, `kvc_cp_leadership_lost_total{reason="step_down"} 1`) {
		t.Fatal("step-down not counted")
	}
	if errors.Is(err, context.Canceled) {
		t.Fatal("unreachable")
	}
}

// TestGracefulHandover: a stopped leader flushes what it has not written yet and resigns, so
// the standby leads at once with every record.
func TestGracefulHandover(t *testing.T) {
	e := etcdtest.Start(t)
	a := startCP(t, e.Endpoints(), "cp-a", func(o *Options) { o.FlushDelay = time.Hour })
	a.waitLeader(t)
	b := startCP(t, e.Endpoints(), "cp-b")
	waitFor(t, "standby sees leader", func() bool { return b.leader(t).GetLeaderId() == "cp-a" })
	s, _, err := open(t, a, decodeHello("d0"))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.send(resident(true, "s1", "s2")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "leader applied the sync", func() bool {
		_, err := a.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: "s2"})
		return err == nil
	})
	if _, err := b.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: "s2"}); code(err) != codes.NotFound {
		t.Fatalf("written before the flush delay: %v", err)
	}
	stopped := time.Now()
	a.stop()
	waitFor(t, "cp-b leads", func() bool { return b.leader(t).GetResponderIsLeader() })
	t.Logf("graceful handover took %s", time.Since(stopped))
	for _, id := range []string{"s1", "s2"} {
		r, err := b.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: id})
		if err != nil || r.GetSession().GetDecodeWorker() != "d0" {
			t.Fatalf("%s on the new leader: %v %v", id, r, err)
		}
	}
}

// TestRouterAndGraceWiring: the leader's Route stream decides over the live state (workers
// registered through Connect), with the leader's epoch; a dropped sidecar stream makes the
// worker UNREACHABLE at once and its residency goes after the grace.
func TestRouterAndGraceWiring(t *testing.T) {
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a", func(o *Options) { o.UnreachableGrace = 300 * time.Millisecond })
	epoch := c.waitLeader(t)
	ctx := t.Context()
	d0, _, err := open(t, c, decodeHello("d0"))
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := open(t, c, &kvcv1.Hello{WorkerId: "p0", Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Node: "n1",
		KvCapacityTokens: 100000, WorkerUrl: "http://p0"}); err != nil {
		t.Fatal(err)
	}
	if err := d0.send(resident(true, "resident-1")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "session resident", func() bool {
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "resident-1"})
		return err == nil && r.GetSession().GetDecodeWorker() == "d0"
	})
	rs, err := kvcv1.NewRouterServiceClient(c.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "r1", SessionId: "new-session", InputTokens: 1000, MaxOutputTokens: 64,
	}}}); err != nil {
		t.Fatal(err)
	}
	resp, err := rs.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if d := resp.GetDecision(); d == nil || d.GetRequestId() != "r1" || d.GetEpoch() != epoch {
		t.Fatalf("route answer %v (epoch %d)", resp, epoch)
	}
	if err := rs.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{RequestId: "bad", InputTokens: -1}}}); err != nil {
		t.Fatal(err)
	}
	if resp, err := rs.Recv(); err != nil || resp.GetError() == nil {
		t.Fatalf("bad query answer %v %v", resp, err)
	}

	// Drop d0's stream: UNREACHABLE at once, residency dropped after the grace.
	d0.cancel()
	waitFor(t, "d0 unreachable", func() bool {
		w, err := c.admin.GetWorker(ctx, &kvcv1.GetWorkerRequest{WorkerId: "d0"})
		return err == nil && w.GetWorker().GetState() == kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
	})
	waitFor(t, "residency dropped after the grace", func() bool {
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "resident-1"})
		return err == nil && r.GetSession().GetDecodeWorker() == "" && r.GetSession().GetPreviousDecodeWorker() == "d0"
	})
	if !metric(t, c, "kvc_cp_residency_dropped_total 1") {
		t.Fatal("drop not counted")
	}
}
