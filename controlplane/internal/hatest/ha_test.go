package hatest

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/launch"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

const electionTTL = 2 * time.Second

var binary string

// TestMain takes kvc-controlplane from $KVC_BIN_DIR, or builds it; it fails the tests when a
// goroutine they started is still running at the end (with time for the stopped etcd members'
// connections to close).
func TestMain(m *testing.M) {
	bins, cleanup, err := launch.Binaries(os.Getenv("KVC_BIN_DIR"), map[string]string{"kvc-controlplane": "../.."})
	if err != nil {
		fmt.Fprintln(os.Stderr, "hatest:", err)
		cleanup()
		os.Exit(1)
	}
	binary = bins["kvc-controlplane"]
	etcdtest.VerifyTestMain(m, cleanup)
}

// proc is a running kvc-controlplane.
type proc struct {
	*launch.Process
	node     string
	addr     string
	httpAddr string
	conn     *grpc.ClientConn
	admin    kvcv1.AdminServiceClient
}

// start runs a kvc-controlplane with the test's flags plus extra; it is killed when the test ends.
func start(t *testing.T, node string, endpoints []string, prefix string, extra ...string) *proc {
	t.Helper()
	args := []string{
		"--node-id", node, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--etcd-endpoints", strings.Join(endpoints, ","), "--etcd-prefix", prefix,
		"--election-ttl", electionTTL.String(), "--flush-delay", "20ms", "--insecure",
	}
	lp, err := launch.Start(launch.Spec{Name: node, Bin: binary, Args: append(args, extra...), Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{Process: lp, node: node}
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("%s log (tail):\n%s", node, p.Tail(60))
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := p.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	p.addr, p.httpAddr = p.ReadyString("grpc_addr"), p.ReadyString("http_addr")
	p.conn = dialConn(t, p.addr)
	p.admin = kvcv1.NewAdminServiceClient(p.conn)
	return p
}

func dialConn(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func (p *proc) leader(t *testing.T) *kvcv1.GetLeaderResponse {
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	r, err := p.admin.GetLeader(ctx, &kvcv1.GetLeaderRequest{})
	if err != nil {
		return &kvcv1.GetLeaderResponse{}
	}
	return r
}

func waitFor(t *testing.T, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	launch.WaitForT(t, what, limit, 20*time.Millisecond, cond)
}

// countSessions pages through ListSessions on p and returns the records resident on worker.
func countSessions(t *testing.T, p *proc, worker string) (map[string]*kvcv1.SessionRecord, error) {
	out := map[string]*kvcv1.SessionRecord{}
	tok := ""
	for {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		r, err := p.admin.ListSessions(ctx, &kvcv1.ListSessionsRequest{PageSize: 64, PageToken: tok, WorkerId: worker})
		cancel()
		if err != nil {
			return nil, err
		}
		for _, s := range r.GetSessions() {
			out[s.GetSessionId()] = s
		}
		if r.GetNextPageToken() == "" {
			return out, nil
		}
		tok = r.GetNextPageToken()
	}
}

// sidecarClient speaks SidecarService the way a sidecar does: it follows leader hints.
type sidecarClient struct {
	t         *testing.T
	eps       *cpclient.Endpoints
	worker    string
	lastEpoch int64
	stream    grpc.BidiStreamingClient[kvcv1.ConnectRequest, kvcv1.ConnectResponse]
	welcome   *kvcv1.Welcome
	hops      []string
}

// connect dials until some replica welcomes it (bounded by limit).
func (s *sidecarClient) connect(limit time.Duration) {
	s.t.Helper()
	deadline := time.Now().Add(limit)
	bo := cpclient.Backoff{Min: 20 * time.Millisecond, Max: 200 * time.Millisecond}
	for {
		if time.Now().After(deadline) {
			s.t.Fatalf("sidecar could not connect; tried %v", s.hops)
		}
		addr := s.eps.Next()
		s.hops = append(s.hops, addr)
		conn := dialConn(s.t, addr)
		st, err := kvcv1.NewSidecarServiceClient(conn).Connect(s.t.Context())
		if err == nil {
			err = st.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{
				WorkerId: s.worker, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, Node: "n1",
				KvCapacityTokens: 1 << 20, LastEpochSeen: s.lastEpoch,
			}}})
		}
		var m *kvcv1.ConnectResponse
		if err == nil {
			m, err = st.Recv()
		}
		if err == nil && m.GetWelcome() != nil {
			s.stream, s.welcome = st, m.GetWelcome()
			s.lastEpoch = m.GetWelcome().GetEpoch()
			return
		}
		if !s.eps.Hint(err) {
			time.Sleep(bo.Next()) // reconnect backoff, as a sidecar does
		}
	}
}

func (s *sidecarClient) sync(ids []string) {
	s.t.Helper()
	rs := &kvcv1.ResidentSessions{FullSync: true}
	for i, id := range ids {
		rs.Sessions = append(rs.Sessions, &kvcv1.ResidentSession{SessionId: id, KvCommittedLen: int64(1000 + i), Generation: 1})
	}
	if err := s.stream.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: rs}}); err != nil {
		s.t.Fatal(err)
	}
}

func TestFailover(t *testing.T) {
	cases := []struct {
		name    string
		members int
	}{{"etcd-1", 1}, {"etcd-3", 3}}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.members > 1 && testing.Short() {
				t.Skip("3-member etcd in -short")
			}
			var endpoints []string
			prefix := fmt.Sprintf("/kvc-hatest-%d-%s/", time.Now().UnixNano(), tc.name)
			if ext := os.Getenv("KVC_TEST_ETCD_ENDPOINTS"); ext != "" {
				if tc.members > 1 {
					t.Skip("external etcd: one run is enough")
				}
				endpoints = strings.Split(ext, ",")
			} else {
				endpoints = etcdtest.StartN(t, tc.members).Endpoints()
			}
			failover(t, endpoints, prefix)
		})
	}
}

func failover(t *testing.T, endpoints []string, prefix string) {
	a := start(t, "cp-a", endpoints, prefix)
	waitFor(t, "cp-a leads", 15*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	b := start(t, "cp-b", endpoints, prefix)
	waitFor(t, "cp-b sees cp-a", 15*time.Second, func() bool {
		r := b.leader(t)
		return r.GetLeaderId() == "cp-a" && !r.GetResponderIsLeader()
	})
	epochA := a.leader(t).GetEpoch()

	// A sidecar configured with both replicas, standby first: it must follow the hint.
	sc := &sidecarClient{t: t, eps: cpclient.NewEndpoints([]string{b.addr, a.addr}), worker: "d0"}
	sc.connect(10 * time.Second)
	if sc.welcome.GetLeaderId() != "cp-a" || sc.welcome.GetEpoch() != epochA {
		t.Fatalf("welcome %v, want cp-a epoch %d", sc.welcome, epochA)
	}
	if len(sc.hops) < 2 || sc.hops[0] != b.addr || sc.hops[1] != a.addr {
		t.Fatalf("hops %v: want the standby, then the hinted leader", sc.hops)
	}
	const n = 200
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("sess-%04d", i)
	}
	sc.sync(ids)
	// Written behind: wait until the standby (which reads etcd) sees every record.
	waitFor(t, "sessions persisted", 15*time.Second, func() bool {
		got, err := countSessions(t, b, "d0")
		return err == nil && len(got) == n
	})

	killed := time.Now()
	a.Kill() // SIGKILL
	waitFor(t, "cp-b leads", electionTTL+10*time.Second, func() bool { return b.leader(t).GetResponderIsLeader() })
	took := time.Since(killed)
	t.Logf("failover took %s (election TTL %s)", took, electionTTL)
	if took > electionTTL+2*time.Second {
		t.Fatalf("standby took %s to lead, want <= %s", took, electionTTL+2*time.Second)
	}
	lb := b.leader(t)
	if lb.GetLeaderId() != "cp-b" || lb.GetEpoch() <= epochA {
		t.Fatalf("new leader %v (old epoch %d)", lb, epochA)
	}
	// Every record written before the kill is readable from the new leader (its memory).
	got, err := countSessions(t, b, "d0")
	if err != nil || len(got) != n {
		t.Fatalf("new leader has %d of %d sessions (err %v)", len(got), n, err)
	}
	w, err := b.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d0"})
	if err != nil || w.GetWorker().GetState() != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE {
		t.Fatalf("before resync d0 = %v (%v), want UNREACHABLE", w.GetWorker(), err)
	}

	// The sidecar's stream died with cp-a; it re-homes to cp-b and resyncs (10 sessions were
	// evicted on the worker meanwhile).
	if _, err := sc.stream.Recv(); err == nil {
		t.Fatal("stream to the killed leader still delivers")
	}
	sc.connect(10 * time.Second)
	if sc.welcome.GetLeaderId() != "cp-b" || sc.welcome.GetEpoch() != lb.GetEpoch() || sc.welcome.GetLeaderAddr() != b.addr {
		t.Fatalf("re-homed welcome %v", sc.welcome)
	}
	sc.sync(ids[:n-10])
	waitFor(t, "resync applied", 10*time.Second, func() bool {
		got, err := countSessions(t, b, "d0")
		return err == nil && len(got) == n-10
	})
	for _, id := range ids[n-10:] {
		r, err := b.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: id})
		if err != nil || r.GetSession().GetDecodeWorker() != "" || r.GetSession().GetPreviousDecodeWorker() != "d0" {
			t.Fatalf("%s after resync: %v %v", id, r.GetSession(), err)
		}
	}
	w, err = b.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d0"})
	if err != nil || w.GetWorker().GetState() != kvcv1.WorkerState_WORKER_STATE_READY || w.GetWorker().GetConnectedTo() != "cp-b" {
		t.Fatalf("after resync d0 = %v (%v)", w.GetWorker(), err)
	}
	r, err := b.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: ids[n-1]})
	if err != nil || r.GetSession().GetEpoch() != lb.GetEpoch() {
		t.Fatalf("changed record not written under the new epoch: %v %v", r.GetSession(), err)
	}
}
