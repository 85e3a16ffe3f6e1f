package server

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"google.golang.org/grpc"
)

// lapsing is a term context whose Err reports its end before Done is closed (the election's
// Term past the renew deadline, before anything has cancelled it).
type lapsing struct {
	context.Context
	lapsed atomic.Bool
}

func (l *lapsing) Err() error {
	if l.lapsed.Load() {
		return context.DeadlineExceeded
	}
	return l.Context.Err()
}

func TestGate(t *testing.T) {
	errNL := errors.New("not leader")
	g := NewGate(func() error { return errNL }, nil)
	unary := func(method string) error {
		_, err := g.Unary(t.Context(), nil, &grpc.UnaryServerInfo{FullMethod: method}, func(context.Context, any) (any, error) { return nil, nil })
		return err
	}
	const gated, open = "/kvc.v1.RouterService/Route", "/kvc.v1.AdminService/GetLeader"
	if err := unary(gated); !errors.Is(err, errNL) {
		t.Fatalf("closed gate admitted %s: %v", gated, err)
	}
	if err := unary(open); err != nil {
		t.Fatalf("closed gate refused %s: %v", open, err)
	}

	base, endTerm := context.WithCancel(context.Background())
	defer endTerm()
	term := &lapsing{Context: base}
	g.Open(term)
	if err := unary(gated); err != nil {
		t.Fatalf("open gate refused: %v", err)
	}
	// An admitted call ends when the gate closes.
	admitted := make(chan context.Context)
	done := make(chan error)
	go func() {
		_, err := g.Unary(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: gated}, func(ctx context.Context, _ any) (any, error) {
			admitted <- ctx
			<-ctx.Done()
			return nil, ctx.Err()
		})
		done <- err
	}()
	<-admitted
	g.Close()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("admitted call after Close: %v", err)
	}
	if err := unary(gated); !errors.Is(err, errNL) {
		t.Fatalf("closed gate admitted: %v", err)
	}

	// Past the renew deadline (Err reports it, Done not closed yet): refused at once.
	g.Open(term)
	term.lapsed.Store(true)
	if err := unary(gated); !errors.Is(err, errNL) {
		t.Fatalf("lapsed term admitted: %v", err)
	}
	term.lapsed.Store(false)
	// The term ends: admitted calls end with it.
	go func() {
		_, err := g.Unary(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: gated}, func(ctx context.Context, _ any) (any, error) {
			admitted <- ctx
			<-ctx.Done()
			return nil, ctx.Err()
		})
		done <- err
	}()
	<-admitted
	endTerm()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("admitted call after the term ended: %v", err)
	}
	if err := unary(gated); !errors.Is(err, errNL) {
		t.Fatalf("ended term admitted: %v", err)
	}
}
