package hatest

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/netproxy"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// decodeSidecar is a decode sidecar's Handler for pkg/sidecar's real control-plane loop, with
// a fixed set of resident sessions.
type decodeSidecar struct {
	id       string
	sessions []string

	mu      sync.Mutex
	applied []*kvcv1.Command
}

func (d *decodeSidecar) Hello() *kvcv1.Hello {
	return &kvcv1.Hello{WorkerId: d.id, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, Node: "n1", KvCapacityTokens: 1 << 20}
}

func (d *decodeSidecar) Resync() *kvcv1.ResidentSessions {
	rs := &kvcv1.ResidentSessions{}
	for _, id := range d.sessions {
		rs.Sessions = append(rs.Sessions, &kvcv1.ResidentSession{SessionId: id, KvCommittedLen: 1000, Generation: 1})
	}
	return rs
}

func (d *decodeSidecar) Load() *kvcv1.WorkerLoad {
	return &kvcv1.WorkerLoad{ResidentSessions: int32(len(d.sessions))}
}

func (d *decodeSidecar) Policy(*kvcv1.Policy) {}

func (d *decodeSidecar) Apply(_ context.Context, cmd *kvcv1.Command) error {
	d.mu.Lock()
	d.applied = append(d.applied, cmd)
	d.mu.Unlock()
	return nil
}

// runAgent runs pkg/sidecar's control-plane loop for h until the test ends.
func runAgent(t *testing.T, h sidecar.Handler, endpoints ...string) *sidecar.ControlPlane {
	t.Helper()
	cp := sidecar.NewControlPlane(sidecar.CPConfig{
		Endpoints: endpoints, Heartbeat: 200 * time.Millisecond,
		BackoffMin: 20 * time.Millisecond, BackoffMax: 200 * time.Millisecond,
	}, h, zerolog.Nop())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = cp.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	wctx, wcancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer wcancel()
	if err := cp.WaitConnected(wctx, 0); err != nil {
		t.Fatalf("agent did not connect: %v", err)
	}
	return cp
}

func sessionIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("sess-%04d", i)
	}
	return ids
}

// TestAgentRehomesFromCutOffLeader runs scenario 4 with the real sidecar loop (pkg/sidecar):
// when the leader is cut off from etcd, the agent's stream ends at the leader's renew
// deadline, and the agent finds the new leader (hints, backoff) and resyncs there.
func TestAgentRehomesFromCutOffLeader(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level scenario in -short")
	}
	if os.Getenv("KVC_TEST_ETCD_ENDPOINTS") != "" {
		t.Skip("needs the embedded etcd")
	}
	cl := etcdtest.Start(t)
	px, err := netproxy.New(strings.TrimPrefix(cl.Endpoints()[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	prefix := fmt.Sprintf("/kvc-hatest-agentcut-%d/", time.Now().UnixNano())
	a := start(t, "cp-a", []string{"http://" + px.Addr()}, prefix)
	waitFor(t, "cp-a leads", 15*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	b := start(t, "cp-b", cl.Endpoints(), prefix)
	waitFor(t, "cp-b sees cp-a", 15*time.Second, func() bool { return b.leader(t).GetLeaderId() == "cp-a" })
	epochA := a.leader(t).GetEpoch()

	const n = 30
	sc := &decodeSidecar{id: "d0", sessions: sessionIDs(n)}
	cp := runAgent(t, sc, b.addr, a.addr) // the standby first: it follows the hint
	if ok, addr := cp.Connected(); !ok || addr != a.addr || cp.MaxEpoch() != epochA {
		t.Fatalf("agent on %s epoch %d, want cp-a epoch %d", addr, cp.MaxEpoch(), epochA)
	}
	waitFor(t, "sessions persisted", 15*time.Second, func() bool {
		got, err := countSessions(t, b, "d0")
		return err == nil && len(got) == n
	})

	cut := time.Now()
	px.Blackhole()
	waitFor(t, "cp-b leads", electionTTL+10*time.Second, func() bool { return b.leader(t).GetResponderIsLeader() })
	led := time.Since(cut)
	epochB := b.leader(t).GetEpoch()
	waitFor(t, "the agent re-homes to cp-b", 10*time.Second, func() bool {
		ok, addr := cp.Connected()
		return ok && addr == b.addr
	})
	rehomed := time.Since(cut)
	if rehomed > led+time.Second || cp.MaxEpoch() != epochB {
		t.Fatalf("agent re-homed %s after the cut (cp-b led after %s), epoch %d want %d", rehomed, led, cp.MaxEpoch(), epochB)
	}
	waitFor(t, "d0 resynced on cp-b", 5*time.Second, func() bool {
		got, err := countSessions(t, b, "d0")
		r, werr := b.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d0"})
		return err == nil && werr == nil && len(got) == n && r.GetWorker().GetConnectedTo() == "cp-b" &&
			r.GetWorker().GetState() == kvcv1.WorkerState_WORKER_STATE_READY
	})
	// The new leader's command reaches the agent.
	if _, err := b.admin.DrainWorker(t.Context(), &kvcv1.DrainWorkerRequest{WorkerId: "d0"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "drain applied", 5*time.Second, func() bool {
		sc.mu.Lock()
		defer sc.mu.Unlock()
		return len(sc.applied) == 1 && sc.applied[0].GetEpoch() == epochB
	})
	px.Heal()
	waitFor(t, "cp-a standby", 20*time.Second, func() bool {
		r := a.leader(t)
		return !r.GetResponderIsLeader() && r.GetLeaderId() == "cp-b"
	})
	if ok, addr := cp.Connected(); !ok || addr != b.addr {
		t.Fatalf("agent left cp-b after the heal: %v %s", ok, addr)
	}
	t.Logf("agent: cp-b led %s after the cut; the agent was on it %s after the cut", led, rehomed)
}

// TestAgentHalfOpen runs scenario 9 with the real sidecar loop: its link black-holed, the
// control plane cuts the stream by keepalive; after Heal the agent reconnects with backoff
// and resyncs.
func TestAgentHalfOpen(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level scenario in -short")
	}
	if os.Getenv("KVC_TEST_ETCD_ENDPOINTS") != "" {
		t.Skip("needs the embedded etcd")
	}
	const kaTime, kaTimeout = time.Second, 2 * time.Second
	cl := etcdtest.Start(t)
	prefix := fmt.Sprintf("/kvc-hatest-agenthalf-%d/", time.Now().UnixNano())
	a := start(t, "cp-a", cl.Endpoints(), prefix,
		"--grpc-keepalive-time", kaTime.String(), "--grpc-keepalive-timeout", kaTimeout.String())
	waitFor(t, "cp-a leads", 15*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	px, err := netproxy.New(a.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	const n = 30
	cp := runAgent(t, &decodeSidecar{id: "d0", sessions: sessionIDs(n)}, px.Addr())
	state := func() kvcv1.WorkerState {
		r, err := a.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d0"})
		if err != nil {
			return kvcv1.WorkerState_WORKER_STATE_UNSPECIFIED
		}
		return r.GetWorker().GetState()
	}
	waitFor(t, "d0 ready with its sessions", 10*time.Second, func() bool {
		got, err := countSessions(t, a, "d0")
		return err == nil && len(got) == n && state() == kvcv1.WorkerState_WORKER_STATE_READY
	})
	connects := cp.Connects()

	cut := time.Now()
	px.Blackhole()
	limit := kaTime + kaTimeout + 3*time.Second
	waitFor(t, "d0 unreachable", 2*limit, func() bool { return state() == kvcv1.WorkerState_WORKER_STATE_UNREACHABLE })
	if d := time.Since(cut); d > limit {
		t.Fatalf("d0 unreachable %s after the black hole, want <= %s", d, limit)
	}
	healed := time.Now()
	px.Heal()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := cp.WaitConnected(ctx, connects); err != nil {
		t.Fatalf("agent did not reconnect after heal: %v", err)
	}
	waitFor(t, "d0 ready again", 5*time.Second, func() bool {
		got, err := countSessions(t, a, "d0")
		return err == nil && len(got) == n && state() == kvcv1.WorkerState_WORKER_STATE_READY
	})
	t.Logf("agent: d0 unreachable after the black hole; reconnected and resynced %s after heal", time.Since(healed))
}
