package hatest

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/netproxy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestHalfOpenSidecarStream is reliability scenario 9: a decode sidecar's stream to the leader
// is black-holed (no FIN, no RST: the connection stays open, nothing crosses). The leader's
// gRPC keepalive (here 1 s / 2 s) must cut it and mark the worker unreachable within Time +
// Timeout (+3 s of slack for a loaded machine); meanwhile no decision sends a session to it; after Heal the
// sidecar reconnects and resyncs, and residency matches what it reports (none orphaned).
func TestHalfOpenSidecarStream(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level scenario in -short")
	}
	if os.Getenv("KVC_TEST_ETCD_ENDPOINTS") != "" {
		t.Skip("needs the embedded etcd")
	}
	// A 1 s ping timeout is too tight for the healthy streams of a test process sharing two
	// busy cores (a stall of its goroutines over 1 s cut d1 too): 2 s. The bound on the
	// detection allows 3 s of scheduling slack on such a machine; without keepalive (or with
	// the old 30 s + 10 s) the worker would stay routable for 40 s or more.
	const kaTime, kaTimeout = time.Second, 2 * time.Second
	cl := etcdtest.Start(t)
	prefix := fmt.Sprintf("/kvc-hatest-halfopen-%d/", time.Now().UnixNano())
	a := start(t, "cp-a", cl.Endpoints(), prefix,
		"--grpc-keepalive-time", kaTime.String(), "--grpc-keepalive-timeout", kaTimeout.String())
	waitFor(t, "cp-a leads", 15*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	px, err := netproxy.New(a.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })

	var w epochWatch
	sc := &sidecarClient{t: t, eps: cpclient.NewEndpoints([]string{px.Addr()}), worker: "d0"}
	sc.connect(10 * time.Second)
	w.see(sc.welcome.GetEpoch())
	const n = 50
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("sess-%04d", i)
	}
	sc.sync(ids)
	stream0 := w.read("d0-before", sc.stream)
	// A second decode worker on a healthy link.
	other := &sidecarClient{t: t, eps: cpclient.NewEndpoints([]string{a.addr}), worker: "d1"}
	other.connect(10 * time.Second)
	other.sync(nil)
	stateOf := func(id string) kvcv1.WorkerState {
		r, err := a.admin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: id})
		if err != nil {
			return kvcv1.WorkerState_WORKER_STATE_UNSPECIFIED
		}
		return r.GetWorker().GetState()
	}
	waitFor(t, "both workers ready with d0's sessions", 10*time.Second, func() bool {
		got, err := countSessions(t, a, "d0")
		return err == nil && len(got) == n && stateOf("d0") == kvcv1.WorkerState_WORKER_STATE_READY &&
			stateOf("d1") == kvcv1.WorkerState_WORKER_STATE_READY
	})
	gw := openRouter(t, a.conn)
	gw.query(t, "before", ids[0], 1, 1200)
	if m, err := gw.next(t, 5*time.Second); err != nil || m.GetDecision().GetDecode().GetWorkerId() != "d0" {
		t.Fatalf("route before: %v %v", m, err)
	}

	cut := time.Now()
	px.Blackhole()
	limit := kaTime + kaTimeout + 3*time.Second
	waitFor(t, "d0 unreachable", 2*limit, func() bool { return stateOf("d0") == kvcv1.WorkerState_WORKER_STATE_UNREACHABLE })
	detected := time.Since(cut)
	if detected > limit {
		t.Fatalf("d0 marked unreachable %s after the black hole, want <= %s", detected, limit)
	}
	// No decision sends anything to d0 while it is unreachable: not its resident sessions,
	// not new ones.
	for i, q := range []struct {
		session string
		turn    int32
	}{{ids[0], 2}, {ids[1], 1}, {"new-session", 0}, {"new-session-2", 1}} {
		gw.query(t, fmt.Sprintf("during-%d", i), q.session, q.turn, 1500)
		m, err := gw.next(t, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if d := m.GetDecision(); d == nil || d.GetDecode().GetWorkerId() == "d0" || d.GetPrefill().GetWorkerId() == "d0" {
			t.Fatalf("query for %s while d0 is unreachable: %v", q.session, m)
		}
	}
	select {
	case err := <-stream0:
		t.Fatalf("the sidecar saw its stream end through the black hole: %v", err)
	default:
	}

	healed := time.Now()
	px.Heal()
	if err := waitErr(t, "the dead stream ends after heal", stream0, 10*time.Second); err == nil {
		t.Fatal("the cut stream ended without an error")
	}
	sc.connect(10 * time.Second) // through the healed proxy, with backoff
	w.see(sc.welcome.GetEpoch())
	// 10 sessions were evicted on the worker meanwhile.
	sc.sync(ids[:n-10])
	_ = w.read("d0-after", sc.stream)
	waitFor(t, "d0 resynced", 10*time.Second, func() bool {
		got, err := countSessions(t, a, "d0")
		return err == nil && len(got) == n-10 && stateOf("d0") == kvcv1.WorkerState_WORKER_STATE_READY
	})
	resynced := time.Since(healed)
	got, _ := countSessions(t, a, "d0")
	for _, id := range ids[:n-10] {
		if got[id] == nil {
			t.Fatalf("%s reported by d0 but not resident there", id)
		}
	}
	for _, id := range ids[n-10:] {
		r, err := a.admin.GetSession(t.Context(), &kvcv1.GetSessionRequest{SessionId: id})
		if err != nil || r.GetSession().GetDecodeWorker() != "" {
			t.Fatalf("%s after resync: %v %v", id, r.GetSession(), err)
		}
	}
	gw.query(t, "after", ids[0], 3, 1700)
	if m, err := gw.next(t, 5*time.Second); err != nil || m.GetDecision().GetDecode().GetWorkerId() != "d0" {
		t.Fatalf("route after resync: %v %v", m, err)
	}
	if s := w.stale(); len(s) > 0 {
		t.Fatalf("%d stale commands, first: %s", len(s), describe(s[0]))
	}
	t.Logf("half-open stream: worker unreachable %s after the black hole (keepalive %s + %s); reconnected and resynced %s after heal",
		detected, kaTime, kaTimeout, resynced)
}
