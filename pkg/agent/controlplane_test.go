package agent_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/agent"
	"github.com/kvcentric/kvcentric/pkg/agent/cptest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type fakeHandler struct {
	mu      sync.Mutex
	id      string
	applied []uint64
	policy  *kvcv1.Policy
}

func (h *fakeHandler) Hello() *kvcv1.Hello {
	return &kvcv1.Hello{WorkerId: h.id, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE}
}
func (h *fakeHandler) Resync() *kvcv1.ResidentSessions {
	return &kvcv1.ResidentSessions{Sessions: []*kvcv1.ResidentSession{{SessionId: "s1", KvCommittedLen: 42}}}
}
func (h *fakeHandler) Load() *kvcv1.WorkerLoad { return &kvcv1.WorkerLoad{UsedTokens: 42} }
func (h *fakeHandler) Policy(p *kvcv1.Policy) {
	h.mu.Lock()
	h.policy = p
	h.mu.Unlock()
}
func (h *fakeHandler) Apply(_ context.Context, c *kvcv1.Command) error {
	h.mu.Lock()
	h.applied = append(h.applied, c.GetCommandId())
	h.mu.Unlock()
	return nil
}
func (h *fakeHandler) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.applied)
}

func startLoop(t *testing.T, eps []string, h agent.Handler) *agent.ControlPlane {
	t.Helper()
	cp := agent.NewControlPlane(agent.CPConfig{Endpoints: eps, Heartbeat: 20 * time.Millisecond, BackoffMin: 5 * time.Millisecond,
		BackoffMax: 50 * time.Millisecond}, h, zerolog.Nop())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = cp.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return cp
}

func wctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestControlPlaneHelloResyncCommands(t *testing.T) {
	delta := int64(77)
	srv, err := cptest.Start(5, &kvcv1.Policy{SnapshotDeltaTokens: &delta})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h := &fakeHandler{id: "d0"}
	startLoop(t, []string{srv.Addr}, h)
	ctx := wctx(t)
	if err := srv.Wait(ctx, func(v *cptest.View) bool {
		return v.Resync("d0") != nil && v.Load("d0").GetUsedTokens() == 42
	}); err != nil {
		t.Fatal(err)
	}
	if rs := func() *kvcv1.ResidentSessions {
		var r *kvcv1.ResidentSessions
		_ = srv.Wait(ctx, func(v *cptest.View) bool { r = v.Resync("d0"); return true })
		return r
	}(); !rs.GetFullSync() || rs.GetSessions()[0].GetSessionId() != "s1" {
		t.Fatalf("resync %v", rs)
	}
	h.mu.Lock()
	if h.policy.GetSnapshotDeltaTokens() != 77 {
		t.Fatalf("policy from welcome not applied: %v", h.policy)
	}
	h.mu.Unlock()

	tests := []struct {
		name     string
		cmd      *kvcv1.Command
		wantOK   bool
		wantRuns int
	}{
		{"fresh", &kvcv1.Command{CommandId: 1, Epoch: 5, Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}, true, 1},
		{"duplicate", &kvcv1.Command{CommandId: 1, Epoch: 5, Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}, true, 1},
		{"newer epoch", &kvcv1.Command{CommandId: 2, Epoch: 6, Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}, true, 2},
		{"stale epoch", &kvcv1.Command{CommandId: 3, Epoch: 5, Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}, false, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			id, err := srv.Send("d0", tt.cmd)
			if err != nil {
				t.Fatal(err)
			}
			var ack *kvcv1.CommandAck
			if err := srv.Wait(ctx, func(v *cptest.View) bool { ack = v.Ack(id); return ack != nil }); err != nil {
				t.Fatal(err)
			}
			if ack.GetOk() != tt.wantOK || h.count() != tt.wantRuns {
				t.Fatalf("ack %v, applied %d times; want ok=%v runs=%d", ack, h.count(), tt.wantOK, tt.wantRuns)
			}
			// the ack map is keyed by id: clear it for a re-sent id
			_ = srv.Wait(ctx, func(v *cptest.View) bool { return true })
		})
	}
}

func TestControlPlaneFollowsLeaderAndResyncs(t *testing.T) {
	leader, err := cptest.Start(3, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer leader.Close()
	standby, err := cptest.Start(3, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer standby.Close()
	standby.SetStandby(&kvcv1.LeaderHint{LeaderId: "cp-a", LeaderAddr: leader.Addr, Epoch: 3})
	h := &fakeHandler{id: "d1"}
	cp := startLoop(t, []string{standby.Addr}, h) // only the standby is configured
	ctx := wctx(t)
	if err := leader.Wait(ctx, func(v *cptest.View) bool { return v.Resync("d1") != nil }); err != nil {
		t.Fatal(err)
	}
	if ok, addr := cp.Connected(); !ok || addr != leader.Addr {
		t.Fatalf("connected=%v to %s, want the leader %s", ok, addr, leader.Addr)
	}
	// The leader dies; the standby takes over (serves) with a higher epoch: the sidecar re-homes
	// through its configured endpoint and resyncs.
	n := cp.Connects()
	leader.Close()
	standby.SetEpoch(4)
	standby.SetStandby(nil)
	if err := cp.WaitConnected(ctx, n); err != nil {
		t.Fatal(err)
	}
	if err := standby.Wait(ctx, func(v *cptest.View) bool { return v.Resync("d1").GetFullSync() }); err != nil {
		t.Fatal(err)
	}
	if cp.MaxEpoch() != 4 {
		t.Fatalf("max epoch %d", cp.MaxEpoch())
	}
}

func TestControlPlaneRefusesStaleLeader(t *testing.T) {
	srv, err := cptest.Start(9, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h := &fakeHandler{id: "d2"}
	cp := startLoop(t, []string{srv.Addr}, h)
	ctx := wctx(t)
	if err := cp.WaitConnected(ctx, 0); err != nil {
		t.Fatal(err)
	}
	// a command of epoch 10 raises the bar; a leader welcoming with epoch 9 is then refused
	id, _ := srv.Send("d2", &kvcv1.Command{Epoch: 10, Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}})
	if err := srv.Wait(ctx, func(v *cptest.View) bool { return v.Ack(id) != nil }); err != nil {
		t.Fatal(err)
	}
	srv.Kick()
	if err := srv.Wait(ctx, func(v *cptest.View) bool { return v.Connects("d2") >= 4 }); err != nil {
		t.Fatal(err)
	}
	if n := cp.Connects(); n != 1 {
		t.Fatalf("stale leader accepted: %d connections", n)
	}
	srv.SetEpoch(11)
	if err := cp.WaitConnected(ctx, 1); err != nil {
		t.Fatal(err)
	}
}
