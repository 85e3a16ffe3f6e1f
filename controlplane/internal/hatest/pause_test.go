package hatest

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLeaderPause is reliability scenario 3: the leader is frozen (SIGSTOP) for 3×TTL while
// it holds a sidecar stream, a gateway stream and admin calls; the standby takes over; the
// old leader is resumed (SIGCONT) with calls queued in its sockets. It must act on none of
// them: no command reaches a sidecar from it, no write of its epoch is acked after the
// takeover, its queued route query is not decided under its epoch, and it ends up a standby
// (health NOT_SERVING, GetLeader naming the new leader).
func TestLeaderPause(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level scenario in -short")
	}
	if os.Getenv("KVC_TEST_ETCD_ENDPOINTS") != "" {
		t.Skip("needs the embedded etcd (reads its keys directly)")
	}
	cl := etcdtest.Start(t)
	cli := cl.Client(t)
	prefix := fmt.Sprintf("/kvc-hatest-pause-%d/", time.Now().UnixNano())
	// Every change is written at once (no deferred volatile flush), so that cp-a is quiet
	// when frozen and any acked write after that would be a zombie's.
	a := start(t, "cp-a", cl.Endpoints(), prefix, "--volatile-flush", "0s")
	waitFor(t, "cp-a leads", 15*time.Second, func() bool { return a.leader(t).GetResponderIsLeader() })
	b := start(t, "cp-b", cl.Endpoints(), prefix, "--volatile-flush", "0s")
	waitFor(t, "cp-b sees cp-a", 15*time.Second, func() bool { return b.leader(t).GetLeaderId() == "cp-a" })
	epochA := a.leader(t).GetEpoch()
	deposedAt := watchDelete(t, cli, prefix+"leader/", epochA)

	// One decode sidecar on cp-a, with sessions resident.
	var w epochWatch
	sc := &sidecarClient{t: t, eps: cpclient.NewEndpoints([]string{a.addr}), worker: "d0"}
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
	// A live command path: a drain round trip reaches the sidecar under epoch A.
	if _, err := a.admin.DrainWorker(t.Context(), &kvcv1.DrainWorkerRequest{WorkerId: "d0"}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.admin.DrainWorker(t.Context(), &kvcv1.DrainWorkerRequest{WorkerId: "d0", Undrain: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "drain commands delivered", 5*time.Second, func() bool { return len(w.commands("cp-a")) == 2 })
	gw := openRouter(t, a.conn)
	gw.query(t, "warm", ids[0], 1, 1200)
	if m, err := gw.next(t, 5*time.Second); err != nil || m.GetDecision().GetEpoch() != epochA {
		t.Fatalf("route before the pause: %v %v", m, err)
	}
	okBefore := quiesce(t, a)
	sentBefore := metric(t, a, `kvc_cp_commands_total{result="sent"}`)

	paused := time.Now()
	if !a.Signal(syscall.SIGSTOP) {
		t.Fatalf("SIGSTOP not sent: %s has exited", a.node)
	}
	// kill(2) returns before every thread of the target has stopped: on a loaded machine a
	// thread may still serve a call that is sent now. Wait until the kernel reports every
	// thread stopped, so the calls below really queue in the frozen leader's sockets.
	waitFor(t, "cp-a stopped", 5*time.Second, func() bool { return allThreadsStopped(a.PID) })
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			_ = a.Signal(syscall.SIGCONT)
		}
	}
	t.Cleanup(resume)

	// Calls that reach the frozen leader wait in its sockets and are served on resume.
	drainErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		_, err := a.admin.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d0"})
		drainErr <- err
	}()
	policyErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		defer cancel()
		_, err := a.admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{SeedMinTurn: proto.Int32(2)}})
		policyErr <- err
	}()
	gw.query(t, "queued", ids[1], 2, 1300)

	waitFor(t, "cp-b leads", electionTTL+10*time.Second, func() bool { return b.leader(t).GetResponderIsLeader() })
	took := time.Since(paused)
	lb := b.leader(t)
	epochB := lb.GetEpoch()
	t.Logf("takeover from a frozen leader took %s (TTL %s)", took, electionTTL)
	if took > electionTTL+2*time.Second || epochB <= epochA {
		t.Fatalf("cp-b led after %s with epoch %d (old %d)", took, epochB, epochA)
	}

	// The sidecar (a second stream, as after a re-home) sees the new epoch while its stream
	// to the frozen leader is still open: the worst case for a zombie command.
	sc2 := &sidecarClient{t: t, eps: cpclient.NewEndpoints([]string{b.addr}), worker: "d0", lastEpoch: epochA}
	sc2.connect(10 * time.Second)
	w.see(sc2.welcome.GetEpoch())
	if sc2.welcome.GetEpoch() != epochB {
		t.Fatalf("welcome from cp-b %v", sc2.welcome)
	}
	sc2.sync(ids)
	streamB := w.read("cp-b", sc2.stream)

	// Hold the pause for 3×TTL in all (a duration, not a synchronisation), then resume.
	hold := time.NewTimer(3*electionTTL - time.Since(paused))
	<-hold.C
	resume()
	resumedAt := time.Now()

	if err := waitErr(t, "queued drain on the resumed leader", drainErr, 20*time.Second); err == nil {
		t.Fatal("the resumed old leader accepted a drain")
	} else if h, ok := cpclient.LeaderHintFrom(err); ok && h.GetLeaderId() == "cp-a" {
		t.Fatalf("drain refused with a hint naming itself: %v", err)
	}
	if err := waitErr(t, "queued policy update", policyErr, 20*time.Second); err == nil {
		t.Fatal("the resumed old leader acked a policy write")
	}
	if m, err := gw.next(t, 20*time.Second); err == nil {
		if d := m.GetDecision(); d != nil && d.GetEpoch() == epochA {
			t.Fatalf("queued route query decided by the old leader under its epoch: %v", d)
		}
	}
	if err := waitErr(t, "old leader's sidecar stream ends", streamA, 20*time.Second); err == nil {
		t.Fatal("sidecar stream to the old leader ended without an error")
	}
	waitFor(t, "cp-a is a standby naming cp-b", 15*time.Second, func() bool {
		r := a.leader(t)
		return !r.GetResponderIsLeader() && r.GetLeaderId() == "cp-b" && r.GetEpoch() == epochB
	})
	for _, svc := range []string{sidecarSvc, routerSvc} {
		if st := health(t, a, svc); st != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("cp-a %s health %s after resume", svc, st)
		}
	}
	t.Logf("old leader standby %s after resume", time.Since(resumedAt))

	if s := w.stale(); len(s) > 0 {
		t.Fatalf("%d stale commands, first: %s", len(s), describe(s[0]))
	}
	if c := w.commands("cp-a"); len(c) != 2 {
		t.Fatalf("cp-a sent %d commands in all, want the 2 before the pause", len(c))
	}
	if got := metric(t, a, `kvc_cp_commands_total{result="sent"}`); got != sentBefore {
		t.Fatalf("cp-a commands sent %v -> %v across the pause", sentBefore, got)
	}
	if got := metric(t, a, `kvc_kvstore_txns_total{result="ok"}`); got != okBefore {
		t.Fatalf("cp-a acked writes %v -> %v after it was frozen", okBefore, got)
	}
	if lost := metric(t, a, `kvc_cp_leadership_lost_total{reason="renew_deadline"}`) +
		metric(t, a, `kvc_cp_leadership_lost_total{reason="session_lost"}`); lost != 1 {
		t.Fatalf("cp-a terms lost %v, want 1", lost)
	}
	// In etcd: every session record written after cp-a's key was deleted carries the new
	// epoch (the fence admits no write of cp-a's after that revision).
	var gone int64
	select {
	case gone = <-deposedAt:
	case <-time.After(5 * time.Second):
		t.Fatal("no delete of cp-a's election key seen")
	}
	resp, err := cli.Get(t.Context(), prefix+"sessions/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		var r kvcv1.SessionRecord
		if err := proto.Unmarshal(kv.Value, &r); err != nil {
			t.Fatalf("%s: %v", kv.Key, err)
		}
		if kv.ModRevision > gone && r.GetEpoch() < epochB {
			t.Fatalf("%s written at revision %d (after cp-a's key went at %d) under epoch %d", kv.Key, kv.ModRevision, gone, r.GetEpoch())
		}
	}
	if len(resp.Kvs) != n {
		t.Fatalf("%d session records, want %d", len(resp.Kvs), n)
	}
	// The new leader commands the sidecar normally.
	if _, err := b.admin.DrainWorker(t.Context(), &kvcv1.DrainWorkerRequest{WorkerId: "d0"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "drain from cp-b delivered", 5*time.Second, func() bool { return len(w.commands("cp-b")) == 1 })
	if c := w.commands("cp-b")[0]; c.epoch != epochB {
		t.Fatalf("cp-b command epoch %d", c.epoch)
	}
	select {
	case err := <-streamB:
		t.Fatalf("stream to cp-b ended: %v", err)
	default:
	}
}

// allThreadsStopped reports whether every thread of pid is in the stopped state ('T' in
// /proc/<pid>/task/<tid>/stat).
func allThreadsStopped(pid int) bool {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil || len(tasks) == 0 {
		return false
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
		if err != nil {
			return false
		}
		// The state follows the command name, which is in parentheses and may hold spaces.
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 || i+2 >= len(b) || b[i+2] != 'T' {
			return false
		}
	}
	return true
}
