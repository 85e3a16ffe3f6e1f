package election

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestTermEndsAtRenewDeadline: the term context reports the renew deadline on the first Err
// call after it (no goroutine has to notice first), closes Done with cause ErrRenewDeadline,
// and IsLeader follows it.
func TestTermEndsAtRenewDeadline(t *testing.T) {
	e := &Elector{cfg: Config{RenewDeadline: time.Hour}, base: time.Now()}
	e.extend(e.mono()) // renewed now: valid for an hour
	ctx, cancel := context.WithCancelCause(context.Background())
	term := &Term{Context: ctx, cancel: cancel, e: e, epoch: 7}
	e.cur.Store(term)
	if term.Err() != nil || !e.IsLeader() || term.Epoch() != 7 {
		t.Fatalf("fresh term: err %v leader %v", term.Err(), e.IsLeader())
	}
	select {
	case <-term.Done():
		t.Fatal("done before the deadline")
	default:
	}
	e.validUntil.Store(0) // the deadline passed (a process resumed after SIGSTOP)
	if e.IsLeader() {
		t.Fatal("leader past the renew deadline")
	}
	if !errors.Is(term.Err(), context.Canceled) || !errors.Is(context.Cause(term), ErrRenewDeadline) {
		t.Fatalf("err %v cause %v", term.Err(), context.Cause(term))
	}
	select {
	case <-term.Done():
	default:
		t.Fatal("Done not closed once Err reported the deadline")
	}
	// A context derived from the term ends with it (the gate's streams, the state's goroutines).
	child, stop := context.WithCancel(term)
	defer stop()
	<-child.Done()
	e.extend(e.mono()) // a late renewal does not revive an ended term
	if term.Err() == nil || e.IsLeader() {
		t.Fatal("term revived")
	}
}
