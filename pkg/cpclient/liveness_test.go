package cpclient

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvcentric/kvcentric/pkg/netproxy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// serve runs a real gRPC server on loopback port 0 (with the health service when withHealth)
// behind a netproxy, and returns the proxy and a client connection through it.
func serve(t *testing.T, withHealth bool) (*netproxy.Proxy, *grpc.ClientConn) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	if withHealth {
		healthpb.RegisterHealthServer(srv, health.NewServer())
	}
	go func() { _ = srv.Serve(lis) }()
	px, err := netproxy.New(lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(px.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cc.Close()
		_ = px.Close()
		srv.Stop()
	})
	return px, cc
}

// TestLivenessWatch: a connection that answers (SERVING, or an error status: a live process)
// is kept for as long as it is watched; one whose link stops forwarding (a paused leader, a
// frozen listener: the TCP connection stays up and nothing comes back) is left once nothing
// answered for Silence, not before, and within Silence + Interval + slack.
func TestLivenessWatch(t *testing.T) {
	l := Liveness{Silence: 800 * time.Millisecond, Interval: 50 * time.Millisecond}
	for _, tc := range []struct {
		name       string
		withHealth bool
		freeze     bool
	}{
		{"answering", true, false},
		{"answering with an error status (no health service)", false, false},
		{"frozen link", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			px, cc := serve(t, tc.withHealth)
			var frozeAt time.Time
			ctx, cancel := context.WithTimeout(t.Context(), 3*l.Silence)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- l.Watch(ctx, cc) }()
			if tc.freeze {
				// a first probe answered before the freeze: the watch has a live connection
				waitServing(t, cc, tc.withHealth)
				frozeAt = time.Now()
				px.Blackhole()
			}
			err := <-done
			var se *SilentError
			switch {
			case !tc.freeze && err != nil:
				t.Fatalf("a live connection was left: %v", err)
			case tc.freeze && !errors.As(err, &se):
				t.Fatalf("frozen link: Watch returned %v, want a *SilentError", err)
			case tc.freeze:
				if d := time.Since(frozeAt); d < l.Silence-l.Interval || d > l.Silence+l.Interval+time.Second {
					t.Fatalf("frozen link left %s after the freeze, want about %s", d, l.Silence)
				}
			}
		})
	}
}

func waitServing(t *testing.T, cc *grpc.ClientConn, _ bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if _, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatal(err)
	}
}

// TestLivenessFor: the watch is tuned to the election lease: silent for half of it, probed every
// tenth (at least 50 ms); no lease given means the control plane's default.
func TestLivenessFor(t *testing.T) {
	for _, tc := range []struct {
		lease             time.Duration
		silence, interval time.Duration
	}{
		{0, DefaultLease / 2, DefaultLease / 10},
		{3 * time.Second, 1500 * time.Millisecond, 300 * time.Millisecond},
		{200 * time.Millisecond, 100 * time.Millisecond, 50 * time.Millisecond},
	} {
		if got := LivenessFor(tc.lease); got.Silence != tc.silence || got.Interval != tc.interval {
			t.Errorf("LivenessFor(%s) = %+v, want silence %s interval %s", tc.lease, got, tc.silence, tc.interval)
		}
	}
}

// TestEndpointsSilent: a silent endpoint's hints are not followed and the rotation passes it
// over while another is left in the round (the round still ends); once the mark expires it is
// tried again.
func TestEndpointsSilent(t *testing.T) {
	e := NewEndpoints([]string{"a", "b"})
	e.Silent("a", time.Hour)
	if e.Hint(NotLeaderError(&kvcv1LeaderHint)) {
		t.Fatal("followed a hint naming a silent endpoint")
	}
	for round := range 3 {
		if got := e.Next(); got != "b" {
			t.Fatalf("round %d: Next = %q, want b (a is silent)", round, got)
		}
		if !e.Pause() {
			t.Fatalf("round %d: the round did not end", round)
		}
	}
	e.Silent("a", 0)
	seen := map[string]bool{e.Next(): true, e.Next(): true}
	if !seen["a"] || !seen["b"] {
		t.Fatalf("after the mark expired the rotation gave %v", seen)
	}
	if !e.Hint(NotLeaderError(&kvcv1LeaderHint)) || e.Next() != "a" {
		t.Fatal("a hint naming a no longer silent endpoint was not followed")
	}
}

var kvcv1LeaderHint = kvcv1.LeaderHint{LeaderId: "cp-a", LeaderAddr: "a", Epoch: 3}
