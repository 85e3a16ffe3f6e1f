package app

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// startCPProc runs a kvc-controlplane process on embedded etcd with election TTL ttl.
func startCPProc(t *testing.T, bin, node string, etcd []string, ttl time.Duration) (*proc, kvcv1.AdminServiceClient) {
	t.Helper()
	p := startProc(t, node, bin, "--node-id", node, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
		"--etcd-endpoints", etcd[0], "--election-ttl", ttl.String(), "--insecure", "--log-level", "info")
	conn, err := grpc.NewClient(p.str("grpc_addr"), append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return p, kvcv1.NewAdminServiceClient(conn)
}

// TestPausedLeaderFollowedRealProcesses (issue 23 item 4): two real control planes on embedded
// etcd (election TTL 2 s) and a sidecar's control-plane loop (pkg/sidecar, tuned with --cp-lease
// to that TTL). The leader's process is stopped (SIGSTOP) and stays stopped past its lease: its
// TCP connections stay up and answer nothing. The sidecar must leave it and reach the new
// leader within the lease plus a margin (TTL 2 s + 2 s), not at gRPC's keepalive limit (10 s
// ping + 5 s timeout), where it waited before.
func TestPausedLeaderFollowedRealProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("real processes")
	}
	bins := procBinaries(t)
	e := etcdtest.Start(t)
	const ttl = 2 * time.Second
	a, aAdmin := startCPProc(t, bins["kvc-controlplane"], "cp-a", e.Endpoints(), ttl)
	waitFor(t, "cp-a leading", func() bool {
		r, err := aAdmin.GetLeader(t.Context(), &kvcv1.GetLeaderRequest{})
		return err == nil && r.GetResponderIsLeader()
	})
	b, bAdmin := startCPProc(t, bins["kvc-controlplane"], "cp-b", e.Endpoints(), ttl)
	t.Cleanup(func() { _ = a.Signal(syscall.SIGCONT) }) // before startProc's SIGTERM (cleanups run last first)

	reg := prometheus.NewRegistry()
	loop := sidecar.NewControlPlane(sidecar.CPConfig{Endpoints: []string{a.str("grpc_addr"), b.str("grpc_addr")},
		Heartbeat: 100 * time.Millisecond, Lease: ttl, Registerer: reg}, tlsHandler{id: "d9"}, zerolog.Nop())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { _ = loop.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "the sidecar on cp-a", func() bool {
		up, addr := loop.Connected()
		return up && addr == a.str("grpc_addr")
	})

	paused := time.Now()
	if !a.Signal(syscall.SIGSTOP) {
		t.Fatal("SIGSTOP not sent: cp-a has exited")
	}
	deadline := paused.Add(ttl + 2*time.Second)
	for {
		up, addr := loop.Connected()
		if up && addr == b.str("grpc_addr") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sidecar is not on cp-b %s after cp-a was paused (connected %v to %s)", time.Since(paused), up, addr)
		}
		time.Sleep(10 * time.Millisecond) // polling the loop's state against a deadline
	}
	took := time.Since(paused)
	r, err := bAdmin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d9"})
	if err != nil || r.GetWorker().GetConnectedTo() != "cp-b" {
		t.Fatalf("cp-b's record of d9: %v %v", r.GetWorker(), err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	left := 0.0
	for _, mf := range mfs {
		if mf.GetName() == "kvc_sidecar_cp_silent_total" {
			left = mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	if left < 1 {
		t.Fatalf("kvc_sidecar_cp_silent_total = %v after leaving the paused leader, want ≥ 1", left)
	}
	t.Logf("the sidecar reached the new leader %s after the leader was paused (election TTL %s)", took.Round(10*time.Millisecond), ttl)
}
