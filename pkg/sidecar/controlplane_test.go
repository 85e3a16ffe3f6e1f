package sidecar_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/pkg/sidecar/cptest"
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

func startLoop(t *testing.T, eps []string, h sidecar.Handler) *sidecar.ControlPlane {
	t.Helper()
	cp := sidecar.NewControlPlane(sidecar.CPConfig{Endpoints: eps, Heartbeat: 20 * time.Millisecond, BackoffMin: 5 * time.Millisecond,
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
	// The loop counts itself connected after it sent the resync and the first load report:
	// wait for that instead of racing it (a flake under -race on a loaded machine).
	if err := cp.WaitConnected(ctx, 0); err != nil {
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

// TestControlPlaneTriesEveryEndpointBeforePausing: a refused endpoint does not make the loop
// back off before it tried the others (cpclient.Endpoints rounds): with a backoff of an hour, a
// dead first endpoint must not keep the sidecar from the leader named second.
func TestControlPlaneTriesEveryEndpointBeforePausing(t *testing.T) {
	srv, err := cptest.Start(3, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	if err := ln.Close(); err != nil { // nothing listens there: connection refused
		t.Fatal(err)
	}
	cp := sidecar.NewControlPlane(sidecar.CPConfig{Endpoints: []string{dead, srv.Addr}, Heartbeat: 20 * time.Millisecond,
		BackoffMin: time.Hour, BackoffMax: time.Hour}, &fakeHandler{id: "d1"}, zerolog.Nop())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = cp.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	if err := cp.WaitConnected(wctx(t), 0); err != nil {
		t.Fatal(err)
	}
	if ok, addr := cp.Connected(); !ok || addr != srv.Addr {
		t.Fatalf("connected=%v to %s, want %s", ok, addr, srv.Addr)
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

// Events raised while the stream is down are kept and sent on the next connection, in order,
// after the hello and before the full resync; over the bound the oldest are dropped and counted.
func TestControlPlaneEventsRaisedWhileDisconnected(t *testing.T) {
	tests := []struct {
		name        string
		buffer      int
		raised      int
		wantFrom    int // first raised event expected to arrive
		wantDropped float64
	}{
		{"all kept", 16, 6, 0, 0},
		{"bound hit: oldest dropped", 4, 6, 2, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv, err := cptest.Start(1, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer srv.Close()
			reg := prometheus.NewRegistry()
			h := &fakeHandler{id: "d9"}
			cp := sidecar.NewControlPlane(sidecar.CPConfig{Endpoints: []string{srv.Addr}, Heartbeat: time.Hour,
				BackoffMin: 5 * time.Millisecond, BackoffMax: 20 * time.Millisecond, EventBuffer: tt.buffer, Registerer: reg},
				h, zerolog.Nop())
			runCtx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { _ = cp.Run(runCtx); close(done) }()
			defer func() { cancel(); <-done }()
			ctx := wctx(t)
			if err := cp.WaitConnected(ctx, 0); err != nil {
				t.Fatal(err)
			}
			// Connected: an event goes out at once.
			cp.Report(&kvcv1.SessionEvent{SessionId: "live", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: 1})
			if err := srv.Wait(ctx, func(v *cptest.View) bool { return len(v.Events()) == 1 }); err != nil {
				t.Fatal(err)
			}
			// Cut the stream and refuse reconnects until the sidecar has seen a refusal: from then
			// on its loop is between connections.
			srv.SetStandby(&kvcv1.LeaderHint{})
			srv.Kick()
			if err := srv.Wait(ctx, func(v *cptest.View) bool { return v.Refused() > 0 }); err != nil {
				t.Fatal(err)
			}
			if ok, _ := cp.Connected(); ok {
				t.Fatal("still connected after the cut")
			}
			kinds := []kvcv1.SessionEventKind{kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_DONE,
				kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_FAILED}
			for i := 0; i < tt.raised; i++ {
				cp.Report(&kvcv1.SessionEvent{SessionId: fmt.Sprintf("s%d", i), Kind: kinds[i%len(kinds)], Room: int64(i)})
			}
			if n, want := cp.PendingEvents(), tt.raised-int(tt.wantDropped); n != want {
				t.Fatalf("%d events pending, want %d", n, want)
			}
			srv.SetStandby(nil)
			if err := cp.WaitConnected(ctx, 1); err != nil {
				t.Fatal(err)
			}
			var second []cptest.Msg
			if err := srv.Wait(ctx, func(v *cptest.View) bool {
				second = second[:0]
				for _, m := range v.Messages("d9") {
					if m.Conn == 2 {
						second = append(second, m)
					}
				}
				return len(second) > 0 && second[len(second)-1].Type == "load"
			}); err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, m := range second {
				if m.Type == "event" {
					got = append(got, "event "+m.Ev.GetSessionId())
				} else {
					got = append(got, m.Type)
				}
			}
			want := []string{"hello"}
			for i := tt.wantFrom; i < tt.raised; i++ {
				want = append(want, fmt.Sprintf("event s%d", i))
			}
			want = append(want, "resync", "load")
			if !slices.Equal(got, want) {
				t.Fatalf("second connection sent\n %v\nwant\n %v", got, want)
			}
			if n := cp.PendingEvents(); n != 0 {
				t.Fatalf("%d events still pending", n)
			}
			if d := counterValue(t, reg, "kvc_sidecar_cp_events_dropped_total"); d != tt.wantDropped {
				t.Fatalf("dropped counter %v, want %v", d, tt.wantDropped)
			}
			if r := counterValue(t, reg, "kvc_sidecar_cp_events_replayed_total"); r != float64(tt.raised)-tt.wantDropped {
				t.Fatalf("replayed counter %v, want %v", r, float64(tt.raised)-tt.wantDropped)
			}
		})
	}
}

func counterValue(t *testing.T, g prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("metric %s not registered", name)
	return 0
}
