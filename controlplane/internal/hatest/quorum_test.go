package hatest

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// leaderLog polls GetLeader on every replica until stopped and keeps what each replica
// claimed: who led under which epoch.
type leaderLog struct {
	mu     sync.Mutex
	claims map[int64]map[string]bool // epoch -> nodes that answered "I lead" under it
	order  []int64                   // epochs claimed, in poll order
	stop   chan struct{}
	done   chan struct{}
}

func pollLeaders(t *testing.T, ps ...*proc) *leaderLog {
	l := &leaderLog{claims: map[int64]map[string]bool{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(l.done)
		for {
			for _, p := range ps {
				ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
				r, err := p.admin.GetLeader(ctx, &kvcv1.GetLeaderRequest{})
				cancel()
				if err == nil && r.GetResponderIsLeader() {
					l.mu.Lock()
					if l.claims[r.GetEpoch()] == nil {
						l.claims[r.GetEpoch()] = map[string]bool{}
					}
					l.claims[r.GetEpoch()][p.node] = true
					l.order = append(l.order, r.GetEpoch())
					l.mu.Unlock()
				}
			}
			select {
			case <-l.stop:
				return
			case <-time.After(20 * time.Millisecond): // poll period
			}
		}
	}()
	t.Cleanup(l.halt)
	return l
}

func (l *leaderLog) halt() {
	select {
	case <-l.stop:
	default:
		close(l.stop)
	}
	<-l.done
}

// check fails when two replicas claimed one epoch or a claimed epoch went backwards.
func (l *leaderLog) check(t *testing.T) {
	t.Helper()
	l.halt()
	l.mu.Lock()
	defer l.mu.Unlock()
	for e, nodes := range l.claims {
		if len(nodes) > 1 {
			t.Fatalf("epoch %d claimed by %v", e, nodes)
		}
	}
	for i := 1; i < len(l.order); i++ {
		if l.order[i] < l.order[i-1] {
			t.Fatalf("leader epoch went back from %d to %d", l.order[i-1], l.order[i])
		}
	}
}

// TestEtcdQuorumLoss is reliability scenario 7: two of three etcd members stop for 3×TTL.
// Design: without quorum no replica may lead (the leader cannot renew its lease, so it
// demotes itself at its renew deadline): gated services NOT_SERVING on both, writes refused,
// gateways fall back (control-plane-unavailable). Pass: no write acked during the outage, no
// two replicas ever lead under one epoch, and within TTL + 10 s of the members' restart one
// leader serves with every session record intact and the sidecar resynced.
func TestEtcdQuorumLoss(t *testing.T) {
	if os.Getenv("KVC_TEST_ETCD_ENDPOINTS") != "" {
		t.Skip("needs the embedded etcd")
	}
	if testing.Short() {
		t.Skip("3-member etcd in -short")
	}
	cl := etcdtest.StartN(t, 3)
	prefix := fmt.Sprintf("/kvc-hatest-quorum-%d/", time.Now().UnixNano())
	a := start(t, "cp-a", cl.Endpoints(), prefix, "--volatile-flush", "0s")
	waitFor(t, "cp-a leads", 15*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	b := start(t, "cp-b", cl.Endpoints(), prefix, "--volatile-flush", "0s")
	waitFor(t, "cp-b sees cp-a", 15*time.Second, func() bool { return b.leader(t).GetLeaderId() == "cp-a" })
	epochA := a.leader(t).GetEpoch()
	leaders := pollLeaders(t, a, b)

	var w epochWatch
	sc := &sidecarClient{t: t, eps: cpclient.NewEndpoints([]string{a.addr, b.addr}), worker: "d0"}
	sc.connect(10 * time.Second)
	w.see(sc.welcome.GetEpoch())
	const n = 100
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("sess-%04d", i)
	}
	sc.sync(ids)
	streamA := w.read("cp-a", sc.stream)
	waitFor(t, "sessions persisted", 15*time.Second, func() bool {
		got, err := countSessions(t, b, "d0")
		return err == nil && len(got) == n
	})
	okA, okB := quiesce(t, a), quiesce(t, b)

	// Stop two members at once. Kill halts a member's raft node at once, then waits (up to
	// etcd's request timeout, ~7 s) for its client streams to close: run both in the
	// background and wait for them before the restart.
	lost := time.Now()
	killed := make(chan struct{}, 2)
	for _, i := range []int{1, 2} {
		go func() { cl.Member(i).Kill(); killed <- struct{}{} }()
	}
	// The isolated etcd leader keeps answering lease renewals until it notices it lost its
	// quorum (about one election timeout, 1 s); cp-a demotes itself its renew deadline later.
	waitFor(t, "cp-a demotes itself", electionTTL+2*time.Second, func() bool {
		return health(t, a, sidecarSvc) == healthpb.HealthCheckResponse_NOT_SERVING && !a.leader(t).GetResponderIsLeader()
	})
	demoted := time.Since(lost)
	if err := waitErr(t, "sidecar stream to cp-a ends", streamA, time.Second); err == nil {
		t.Fatal("sidecar stream ended without an error")
	}
	// While quorum is lost: nobody leads, nothing is acked, routing is refused.
	for _, p := range []*proc{a, b} {
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		_, err := p.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{SeedMinTurn: proto.Int32(3)}})
		cancel()
		if err == nil {
			t.Fatalf("%s acked a policy write without quorum", p.node)
		}
		gw := openRouter(t, p.conn)
		gw.query(t, "outage", ids[0], 3, 1500)
		if m, err := gw.next(t, 5*time.Second); err == nil {
			t.Fatalf("%s routed without quorum: %v", p.node, m)
		}
	}
	hold := time.NewTimer(3*electionTTL - time.Since(lost)) // the outage's length
	<-hold.C
	for _, p := range []*proc{a, b} {
		if p.leader(t).GetResponderIsLeader() || health(t, p, sidecarSvc) != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("%s leads or serves without quorum", p.node)
		}
	}
	if got := metric(t, a, `kvc_kvstore_txns_total{result="ok"}`); got != okA {
		t.Fatalf("cp-a acked writes %v -> %v without quorum", okA, got)
	}
	if got := metric(t, b, `kvc_kvstore_txns_total{result="ok"}`); got != okB {
		t.Fatalf("cp-b acked writes %v -> %v without quorum", okB, got)
	}

	for range 2 {
		select {
		case <-killed:
		case <-time.After(30 * time.Second):
			t.Fatal("etcd members did not stop")
		}
	}
	restored := time.Now()
	cl.Member(1).Restart(t)
	cl.Member(2).Restart(t)
	var lead *proc
	waitFor(t, "a leader after recovery", electionTTL+10*time.Second, func() bool {
		for _, p := range []*proc{a, b} {
			if p.leader(t).GetResponderIsLeader() {
				lead = p
				return true
			}
		}
		return false
	})
	converged := time.Since(restored)
	epoch := lead.leader(t).GetEpoch()
	if epoch <= epochA {
		t.Fatalf("epoch %d after recovery (was %d)", epoch, epochA)
	}
	sc.connect(10 * time.Second)
	w.see(sc.welcome.GetEpoch())
	if sc.welcome.GetLeaderId() != lead.node || sc.welcome.GetEpoch() != epoch {
		t.Fatalf("welcome %v, want %s epoch %d", sc.welcome, lead.node, epoch)
	}
	sc.sync(ids)
	_ = w.read(lead.node, sc.stream)
	waitFor(t, "d0 ready", 5*time.Second, func() bool {
		r, err := lead.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d0"})
		return err == nil && r.GetWorker().GetState() == kvcv1.WorkerState_WORKER_STATE_READY
	})
	got, err := countSessions(t, lead, "d0")
	if err != nil || len(got) != n {
		t.Fatalf("%s has %d of %d sessions after recovery (%v)", lead.node, len(got), n, err)
	}
	gw := openRouter(t, lead.conn)
	gw.query(t, "recovered", ids[0], 3, 1500)
	if m, err := gw.next(t, 5*time.Second); err != nil || m.GetDecision().GetEpoch() != epoch ||
		m.GetDecision().GetMode() != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
		t.Fatalf("route after recovery: %v %v", m, err)
	}
	t.Logf("quorum lost: leader demoted after %s (TTL %s); after restart %s leads in %s (epoch %d -> %d)",
		demoted, electionTTL, lead.node, converged, epochA, epoch)
	leaders.check(t)
	if s := w.stale(); len(s) > 0 {
		t.Fatalf("%d stale commands, first: %s", len(s), describe(s[0]))
	}
}
