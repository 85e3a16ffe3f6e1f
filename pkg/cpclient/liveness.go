package cpclient

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// DefaultLease is the control plane's default election TTL (kvc-controlplane --election-ttl):
// what a client assumes unless told the lease its control planes run with.
const DefaultLease = 5 * time.Second

// Liveness is how a client notices a control plane that stops answering while its connection
// stays up: a leader paused (SIGSTOP, a stalled VM) or behind a link that stopped forwarding.
// gRPC's own keepalive cannot do it in time (its client ping interval is at least 10 s, and the
// ping's timeout comes on top), and a long-lived stream has no deadline; so a client probes
// the connection it streams on with the health service and leaves it when nothing answered
// for Silence. Tuned to the election lease (LivenessFor): a paused leader loses its lease
// after the TTL, the standby leads, and the client, having left the silent one within half a
// lease, reaches the new leader within about a lease of the pause (issue 23 item 4).
type Liveness struct {
	// Silence is how long the connection may answer nothing before the client leaves it; it is
	// also the deadline of each probe. 0 disables the watch.
	Silence time.Duration
	// Interval is the pause between the end of one probe and the next.
	Interval time.Duration
}

// LivenessFor is the liveness for control planes running with election TTL lease (0:
// DefaultLease): silent for half a lease, probed every tenth (at least every 50 ms).
func LivenessFor(lease time.Duration) Liveness {
	if lease <= 0 {
		lease = DefaultLease
	}
	return Liveness{Silence: lease / 2, Interval: max(lease/10, 50*time.Millisecond)}
}

// SilentError is what Watch returns when the control plane answered nothing for Silence.
type SilentError struct {
	Silence time.Duration
	Err     error // the last probe's error
}

func (e *SilentError) Error() string {
	return fmt.Sprintf("control plane answered nothing for %s (paused or cut off): %v", e.Silence, e.Err)
}

func (e *SilentError) Unwrap() error { return e.Err }

// Watch probes cc until ctx ends (nil) or the control plane answers nothing for l.Silence
// (*SilentError); the caller then cancels its stream on cc and moves on. Any answer counts,
// an error status too (a refusal is an answer from a live process); only probes that time out
// or find no transport are silence. It blocks; run it beside the stream.
func (l Liveness) Watch(ctx context.Context, cc grpc.ClientConnInterface) error {
	if l.Silence <= 0 {
		<-ctx.Done()
		return nil
	}
	hc := healthpb.NewHealthClient(cc)
	last := time.Now()
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		pctx, cancel := context.WithDeadline(ctx, last.Add(l.Silence))
		_, err := hc.Check(pctx, &healthpb.HealthCheckRequest{})
		cancel()
		if ctx.Err() != nil {
			return nil
		}
		switch status.Code(err) {
		case codes.DeadlineExceeded, codes.Unavailable, codes.Canceled:
			if time.Since(last) >= l.Silence {
				return &SilentError{Silence: l.Silence, Err: err}
			}
		default:
			last = time.Now()
		}
		t.Reset(l.Interval)
	}
}

// Guard watches cc (Watch) beside a stream: streams opened under the returned context end
// when ctx does or when the connection goes silent. stop ends the watch and returns the
// *SilentError that ended the context, nil if none did.
func (l Liveness) Guard(ctx context.Context, cc grpc.ClientConnInterface) (_ context.Context, stop func() error) {
	gctx, cancel := context.WithCancelCause(ctx)
	done := make(chan error, 1)
	go func() {
		err := l.Watch(gctx, cc)
		if err != nil {
			cancel(err)
		}
		done <- err
	}()
	return gctx, func() error {
		cancel(context.Canceled)
		return <-done
	}
}
