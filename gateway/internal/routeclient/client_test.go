package routeclient

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	"github.com/kvcentric/kvcentric/pkg/netproxy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func direct(q *kvcv1.RouteQuery) *kvcv1.RouteResponse {
	return fakecp.Decision(q, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, nil, &kvcv1.WorkerRef{WorkerId: "d0"}, fakecp.Direct())
}

// start runs a client against addrs and waits until its stream is up (when wantUp).
func start(t *testing.T, addrs []string, timeout time.Duration, obs Observer) *Client {
	t.Helper()
	c := New(addrs, timeout, zerolog.Nop(), obs)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = c.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return c
}

func TestDecide(t *testing.T) {
	tests := []struct {
		name     string
		decide   fakecp.Decider
		wantMode kvcv1.RouteMode
		wantErr  func(error) bool
	}{
		{"decision", direct, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, nil},
		{"route error", func(q *kvcv1.RouteQuery) *kvcv1.RouteResponse {
			return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Error{Error: &kvcv1.RouteError{RequestId: q.GetRequestId(), Code: 3, Message: "bad session"}}}
		}, 0, func(err error) bool {
			var re *RejectedError
			return errors.As(err, &re) && re.Code == codes.InvalidArgument
		}},
		{"no answer", func(*kvcv1.RouteQuery) *kvcv1.RouteResponse { return nil }, 0, func(err error) bool { return errors.Is(err, ErrUnavailable) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cp := fakecp.Start(t, tt.decide)
			c := start(t, []string{cp.Addr}, 300*time.Millisecond, Observer{})
			d, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 10})
			if tt.wantErr != nil {
				if !tt.wantErr(err) {
					t.Fatalf("err = %v", err)
				}
				return
			}
			if err != nil || d.GetMode() != tt.wantMode {
				t.Fatalf("got %v, %v", d, err)
			}
		})
	}
}

func TestConcurrentDecideAndReport(t *testing.T) {
	cp := fakecp.Start(t, direct)
	c := start(t, []string{cp.Addr}, 2*time.Second, Observer{})
	const n = 64
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			sid := fmt.Sprintf("s%d", i)
			d, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: sid, InputTokens: 10})
			if err != nil {
				errs <- err
				return
			}
			if d.GetRequestId() == "" || d.GetDecisionId() != "d-"+d.GetRequestId() {
				errs <- fmt.Errorf("mismatched decision %v", d)
				return
			}
			if err := c.Report(&kvcv1.RouteOutcome{DecisionId: d.GetDecisionId(), Success: true}); err != nil {
				errs <- err
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for i := 0; i < n; i++ {
		select {
		case o := <-cp.Outcomes:
			if !o.GetNoAck() { // the client reads no acknowledgement: it asks for none
				t.Fatalf("outcome %s reported without no_ack", o.GetDecisionId())
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("only %d outcomes arrived", i)
		}
	}
}

func TestFollowsLeaderHint(t *testing.T) {
	leader := fakecp.Start(t, direct)
	standby := fakecp.Start(t, direct)
	standby.SetStandby(leader.Addr)
	up := make(chan string, 8)
	c := start(t, []string{standby.Addr}, time.Second, Observer{Connected: func(addr string, ok bool) {
		if ok {
			up <- addr
		}
	}})
	deadline := time.After(5 * time.Second)
	for {
		d, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 1})
		if err == nil && d.GetMode() == kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
			break
		}
		select {
		case <-deadline:
			t.Fatalf("never reached the leader: %v", err)
		case <-up: // a stream came up: try again
		}
	}
	select {
	case q := <-leader.Queries:
		if q.GetSessionId() != "s" {
			t.Fatalf("leader got %v", q)
		}
	default:
		t.Fatal("the leader saw no query")
	}
}

// TestStaleHintsDoNotSpin: two standbys naming each other (stale hints mid-election) are
// followed twice in a row at most, then the client pauses with backoff as for any refusal,
// instead of dialing as fast as the loopback answers.
func TestStaleHintsDoNotSpin(t *testing.T) {
	a := fakecp.Start(t, direct)
	b := fakecp.Start(t, direct)
	a.SetStandby(b.Addr)
	b.SetStandby(a.Addr)
	start(t, []string{a.Addr}, time.Second, Observer{})
	time.Sleep(500 * time.Millisecond) // a rate is measured over a window, not a sync point
	// with backoff from 50 ms: a few rounds of up to 3 streams; spinning: thousands
	if n := a.Streams.Load() + b.Streams.Load(); n == 0 || n > 60 {
		t.Fatalf("%d Route streams in 0.5 s between two standbys naming each other", n)
	}
}

func TestFailsFastWhenDown(t *testing.T) {
	cp := fakecp.Start(t, direct)
	addr := cp.Addr
	cp.Stop()
	c := start(t, []string{addr}, time.Second, Observer{})
	// The first call may wait up to the route timeout (start-up grace); after that, at once.
	if _, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 1}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v", err)
	}
	t0 := time.Now()
	if _, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 1}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v", err)
	}
	if el := time.Since(t0); el > 500*time.Millisecond {
		// Not a performance claim: a down control plane must not cost every request the timeout.
		t.Fatalf("second Decide waited %v", el)
	}
}

func TestOrphanDecisionIsReleased(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan struct{}, 1)
	var once sync.Once
	cp := fakecp.Start(t, func(q *kvcv1.RouteQuery) *kvcv1.RouteResponse {
		arrived <- struct{}{}
		<-release // answer only after the client gave up
		return direct(q)
	})
	orphans := make(chan struct{}, 1)
	c := start(t, []string{cp.Addr}, 100*time.Millisecond, Observer{Orphan: func() { orphans <- struct{}{} }})
	// The query must reach the control plane before the route timeout: on a loaded machine the
	// stream may not be up within 100 ms, and a query never sent leaves no decision to orphan.
	waitConnected(t, c)
	_, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 1})
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v", err)
	}
	select {
	case <-arrived:
	case <-time.After(5 * time.Second):
		t.Fatal("the query never reached the control plane")
	}
	once.Do(func() { close(release) })
	select {
	case o := <-cp.Outcomes:
		if o.GetErrorKind() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED || o.GetSuccess() {
			t.Fatalf("outcome %v", o)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no release outcome for the orphaned decision")
	}
	<-orphans
}

// TestRehomesOnFailover: the serving replica dies; the stream re-homes on the other one and
// decisions continue.
func TestRehomesOnFailover(t *testing.T) {
	a := fakecp.Start(t, direct)
	b := fakecp.Start(t, direct)
	up := make(chan string, 16)
	c := start(t, []string{a.Addr, b.Addr}, time.Second, Observer{Connected: func(addr string, ok bool) {
		if ok {
			up <- addr
		}
	}})
	if got := <-up; got != a.Addr {
		t.Fatalf("first stream to %s", got)
	}
	if _, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 1}); err != nil {
		t.Fatal(err)
	}
	a.Stop()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case addr := <-up:
			if addr != b.Addr {
				continue // a reconnect attempt to the dead one may still come up first
			}
		case <-deadline:
			t.Fatal("never re-homed")
		}
		break
	}
	if _, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 1}); err != nil {
		t.Fatalf("after failover: %v", err)
	}
	select {
	case <-b.Queries:
	default:
		t.Fatal("the second replica saw no query")
	}
}

// TestFrozenControlPlaneLeft (issue 23 item 4): the route stream's control plane stops
// answering while its connection stays up (a paused leader; here its link frozen by a netproxy
// that stops forwarding). The client leaves it once nothing answered for half the lease
// (SetLease) and serves decisions from the other endpoint; before, the stream stayed on the
// silent one until gRPC's keepalive gave up (10 s ping + 5 s timeout), every query waiting out
// the route timeout.
func TestFrozenControlPlaneLeft(t *testing.T) {
	a, b := fakecp.Start(t, direct), fakecp.Start(t, direct)
	px, err := netproxy.New(a.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	const lease = 1200 * time.Millisecond
	up, silent := make(chan string, 16), make(chan string, 16)
	c := New([]string{px.Addr(), b.Addr}, 300*time.Millisecond, zerolog.Nop(), Observer{Connected: func(addr string, on bool) {
		if on {
			select {
			case up <- addr:
			default:
			}
		}
	}, Silent: func(addr string) {
		select {
		case silent <- addr:
		default:
		}
	}})
	c.SetLease(lease)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = c.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	if got := <-up; got != px.Addr() {
		t.Fatalf("first stream on %s, want the proxied endpoint", got)
	}
	if _, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 10}); err != nil {
		t.Fatalf("decision before the freeze: %v", err)
	}
	frozen := time.Now()
	px.Blackhole()
	limit := time.NewTimer(lease/2 + 2*time.Second)
	defer limit.Stop()
	for {
		select {
		case addr := <-up:
			if addr != b.Addr {
				continue // the frozen endpoint may be tried again in a later round; it cannot serve
			}
			took := time.Since(frozen)
			if took < lease/2 {
				t.Fatalf("left the frozen endpoint after %s, before half the lease (%s)", took, lease/2)
			}
			if _, err := c.Decide(context.Background(), &kvcv1.RouteQuery{SessionId: "s", InputTokens: 10}); err != nil {
				t.Fatalf("decision after the move: %v", err)
			}
			select {
			case addr := <-silent:
				if addr != px.Addr() {
					t.Fatalf("Observer.Silent named %s, want the frozen %s", addr, px.Addr())
				}
			default:
				t.Fatal("leaving the frozen endpoint was not reported (Observer.Silent: kvc_gateway_control_plane_silent_total)")
			}
			return
		case <-limit.C:
			t.Fatalf("still not on the other endpoint %s after the freeze", time.Since(frozen))
		}
	}
}

// waitConnected waits until c has a Route stream up (or fails the test after 10 s).
func waitConnected(t *testing.T, c *Client) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !c.Connected() {
		if time.Now().After(deadline) {
			t.Fatal("route stream not up within 10 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
