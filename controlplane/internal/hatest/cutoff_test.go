package hatest

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/netproxy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLeaderCutOffFromEtcd is reliability scenario 4: the leader's link to etcd is
// black-holed (no connection closed, nothing answered) while it still reaches its sidecar
// and gateway. It must demote itself on its own clock within its renew deadline (< TTL):
// gated services NOT_SERVING, its streams ended, no command and no acked write after that.
// The other replica leads by TTL + 2 s, the sidecar re-homes to it, and after Heal the old
// leader rejoins as a standby naming the new one.
func TestLeaderCutOffFromEtcd(t *testing.T) {
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
	prefix := fmt.Sprintf("/kvc-hatest-cut-%d/", time.Now().UnixNano())
	a := start(t, "cp-a", []string{"http://" + px.Addr()}, prefix, "--volatile-flush", "0s")
	waitFor(t, "cp-a leads", 15*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	b := start(t, "cp-b", cl.Endpoints(), prefix, "--volatile-flush", "0s")
	waitFor(t, "cp-b sees cp-a", 15*time.Second, func() bool { return b.leader(t).GetLeaderId() == "cp-a" })
	epochA := a.leader(t).GetEpoch()

	var w epochWatch
	sc := &sidecarClient{t: t, eps: cpclient.NewEndpoints([]string{a.addr, b.addr}), worker: "d0"}
	sc.connect(10 * time.Second)
	w.see(sc.welcome.GetEpoch())
	const n = 50
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
	gw := openRouter(t, a.conn)
	gw.query(t, "warm", ids[0], 1, 1200)
	if m, err := gw.next(t, 5*time.Second); err != nil || m.GetDecision().GetEpoch() != epochA {
		t.Fatalf("route before the cut: %v %v", m, err)
	}
	okBefore := quiesce(t, a)
	sentBefore := metric(t, a, `kvc_cp_commands_total{result="sent"}`)

	cut := time.Now()
	px.Blackhole()
	waitFor(t, "cp-a demotes itself", electionTTL, func() bool {
		return health(t, a, sidecarSvc) == healthpb.HealthCheckResponse_NOT_SERVING &&
			health(t, a, routerSvc) == healthpb.HealthCheckResponse_NOT_SERVING &&
			!a.leader(t).GetResponderIsLeader()
	})
	demoted := time.Since(cut)
	if err := waitErr(t, "cp-a ends its sidecar stream", streamA, electionTTL); err == nil {
		t.Fatal("sidecar stream ended without an error")
	}
	streamEnded := time.Since(cut)
	if _, err := gw.next(t, electionTTL); err == nil {
		t.Fatal("gateway stream to the demoted leader still answers")
	}
	// A call on the demoted replica is refused without naming itself.
	if _, err := a.admin.DrainWorker(t.Context(), &kvcv1.DrainWorkerRequest{WorkerId: "d0"}); err == nil {
		t.Fatal("demoted replica accepted a drain")
	} else if h, ok := cpclient.LeaderHintFrom(err); ok && h.GetLeaderId() == "cp-a" {
		t.Fatalf("demoted replica hints at itself: %v", err)
	}
	if demoted >= electionTTL || streamEnded >= electionTTL {
		t.Fatalf("demoted after %s, stream ended after %s: want < TTL %s", demoted, streamEnded, electionTTL)
	}

	waitFor(t, "cp-b leads", electionTTL+10*time.Second, func() bool { return b.leader(t).GetResponderIsLeader() })
	took := time.Since(cut)
	epochB := b.leader(t).GetEpoch()
	if took > electionTTL+2*time.Second || epochB <= epochA {
		t.Fatalf("cp-b led after %s with epoch %d (old %d)", took, epochB, epochA)
	}
	// The sidecar re-homes (it is configured with both replicas and follows hints).
	sc.connect(10 * time.Second)
	rehomed := time.Since(cut)
	w.see(sc.welcome.GetEpoch())
	if sc.welcome.GetLeaderId() != "cp-b" || sc.welcome.GetEpoch() != epochB {
		t.Fatalf("re-homed welcome %v", sc.welcome)
	}
	sc.sync(ids)
	streamB := w.read("cp-b", sc.stream)
	waitFor(t, "d0 ready on cp-b", 5*time.Second, func() bool {
		r, err := b.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d0"})
		return err == nil && r.GetWorker().GetState() == kvcv1.WorkerState_WORKER_STATE_READY && r.GetWorker().GetConnectedTo() == "cp-b"
	})
	gwB := openRouter(t, b.conn)
	gwB.query(t, "after", ids[1], 2, 1300)
	if m, err := gwB.next(t, 5*time.Second); err != nil || m.GetDecision().GetEpoch() != epochB ||
		m.GetDecision().GetDecode().GetWorkerId() != "d0" {
		t.Fatalf("route on the new leader: %v %v", m, err)
	}
	t.Logf("cut-off leader demoted after %s (stream ended %s, TTL %s); new leader after %s; sidecar re-homed after %s",
		demoted, streamEnded, electionTTL, took, rehomed)

	healed := time.Now()
	px.Heal()
	waitFor(t, "cp-a rejoins as a standby naming cp-b", 20*time.Second, func() bool {
		r := a.leader(t)
		return !r.GetResponderIsLeader() && r.GetLeaderId() == "cp-b" && r.GetEpoch() == epochB
	})
	t.Logf("old leader standby %s after heal", time.Since(healed))
	if r := b.leader(t); !r.GetResponderIsLeader() || r.GetEpoch() != epochB {
		t.Fatalf("cp-b after heal: %v", r)
	}
	if st := health(t, a, sidecarSvc); st != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Fatalf("cp-a sidecar health %s after heal", st)
	}
	if s := w.stale(); len(s) > 0 {
		t.Fatalf("%d stale commands, first: %s", len(s), describe(s[0]))
	}
	if got := metric(t, a, `kvc_cp_commands_total{result="sent"}`); got != sentBefore {
		t.Fatalf("cp-a commands sent %v -> %v after the cut", sentBefore, got)
	}
	if got := metric(t, a, `kvc_kvstore_txns_total{result="ok"}`); got != okBefore {
		t.Fatalf("cp-a acked writes %v -> %v after the cut", okBefore, got)
	}
	if got := metric(t, a, `kvc_cp_leadership_lost_total{reason="renew_deadline"}`); got != 1 {
		t.Fatalf("cp-a renew_deadline terms %v, want 1", got)
	}
	got, err := countSessions(t, b, "d0")
	if err != nil || len(got) != n {
		t.Fatalf("cp-b has %d of %d sessions (%v)", len(got), n, err)
	}
	select {
	case err := <-streamB:
		t.Fatalf("stream to cp-b ended: %v", err)
	default:
	}
	// cp-a is a working standby again: it campaigns, and takes over when cp-b dies.
	killed := time.Now()
	b.Kill() // SIGKILL
	waitFor(t, "cp-a leads again", electionTTL+10*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	if took := time.Since(killed); took > electionTTL+2*time.Second {
		t.Fatalf("cp-a took %s to take over from the killed cp-b", took)
	} else {
		t.Logf("the healed old leader took over %s after cp-b was killed", took)
	}
	if e := a.leader(t).GetEpoch(); e <= epochB {
		t.Fatalf("cp-a epoch %d after %d", e, epochB)
	}
}
