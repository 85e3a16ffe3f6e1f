package router

import (
	"context"
	"io"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// aheadStream is a Route stream whose Send blocks until released and whose Recv reports each
// call: it shows how far the receiving goroutine reads while the handler is busy.
type aheadStream struct {
	grpc.ServerStream
	ctx     context.Context
	reqs    []*kvcv1.RouteRequest
	recvs   chan int      // the number of each Recv call
	sending chan struct{} // closed when the first Send starts
	release chan struct{} // Sends return once closed
	sent    []*kvcv1.RouteResponse
	n       int
}

func (a *aheadStream) Context() context.Context { return a.ctx }

func (a *aheadStream) Recv() (*kvcv1.RouteRequest, error) {
	a.n++
	a.recvs <- a.n
	if a.n <= len(a.reqs) {
		return a.reqs[a.n-1], nil
	}
	<-a.release // the client closes the stream once answered
	return nil, io.EOF
}

func (a *aheadStream) Send(resp *kvcv1.RouteResponse) error {
	if len(a.sent) == 0 {
		close(a.sending)
	}
	<-a.release
	a.sent = append(a.sent, resp)
	return nil
}

// TestRouteReceivesAheadOfTheHandler: while the handler is held in its first answer's Send,
// the stream's receiving goroutine goes on reading the messages behind it (up to recvAhead),
// instead of parking with the second one until the handler takes it (a wake-up per message
// on a pipelined stream). Every message is still answered, in order.
func TestRouteReceivesAheadOfTheHandler(t *testing.T) {
	s := New(routertest.New(), zerolog.Nop(), nil)
	const n = 8
	a := &aheadStream{ctx: context.Background(), recvs: make(chan int, n+1),
		sending: make(chan struct{}), release: make(chan struct{})}
	for range n {
		a.reqs = append(a.reqs, &kvcv1.RouteRequest{}) // neither query nor outcome: a RouteError each
	}
	done := make(chan error, 1)
	go func() { done <- s.Route(a) }()
	timeout := time.After(10 * time.Second) // a guard against a hang, not a synchronization
	select {
	case <-a.sending:
	case <-timeout:
		t.Fatal("no answer started")
	}
	// The handler is in its first Send; the receiver must get to Recv call n+1 (the one after
	// the last message) without it.
	for want := 1; want <= n+1; want++ {
		select {
		case got := <-a.recvs:
			if got != want {
				t.Fatalf("Recv call %d, want %d", got, want)
			}
		case <-timeout:
			t.Fatalf("the receiver stopped at Recv call %d while the handler was busy (want %d)", want-1, n+1)
		}
	}
	close(a.release)
	if err := <-done; err != nil {
		t.Fatalf("Route: %v", err)
	}
	if len(a.sent) != n {
		t.Fatalf("%d answers, want %d", len(a.sent), n)
	}
	for i, resp := range a.sent {
		if resp.GetError() == nil {
			t.Fatalf("answer %d: %v, want a RouteError", i, resp)
		}
	}
}
