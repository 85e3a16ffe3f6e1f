package cpclient

import (
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// NotLeaderError builds the UNAVAILABLE error a standby returns for leader-only calls, carrying
// the leader's address (when known) as a kvc.v1.LeaderHint detail.
func NotLeaderError(hint *kvcv1.LeaderHint) error {
	msg := "not the leader"
	if hint.GetLeaderAddr() != "" {
		msg += "; leader is " + hint.GetLeaderId() + " at " + hint.GetLeaderAddr()
	} else {
		msg += "; no leader elected yet"
	}
	st := status.New(codes.Unavailable, msg)
	if hint != nil {
		if withHint, err := st.WithDetails(hint); err == nil {
			st = withHint
		}
	}
	return st.Err()
}

// LeaderHintFrom extracts the leader hint from an error, if it carries one.
func LeaderHintFrom(err error) (*kvcv1.LeaderHint, bool) {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable {
		return nil, false
	}
	for _, d := range st.Details() {
		if h, ok := d.(*kvcv1.LeaderHint); ok && h.GetLeaderAddr() != "" {
			return h, true
		}
	}
	return nil, false
}

// Endpoints is a list of control plane addresses that remembers the last known leader. Next
// returns the address to try: the hinted leader first, else the endpoints in rotation.
//
// A reconnect loop pauses (backs off) once per round, when every endpoint has been tried since
// the last pause (Pause), not after each failed attempt: during a failover the standby names the
// dead leader until its lease expires, and a client that slept after each refusal reached the
// standby, once it led, only every other pause (up to two backoff ceilings after the election).
type Endpoints struct {
	mu     sync.Mutex
	addrs  []string
	next   int
	leader string
	tried  map[string]bool // endpoints tried since the last pause
	// distinct is the number of distinct endpoints (a round is over when tried holds as many)
	distinct int
	// silent: endpoints that answered nothing (Liveness), until when they are passed over
	silent map[string]time.Time
}

// NewEndpoints returns an endpoint list; addrs must not be empty.
func NewEndpoints(addrs []string) *Endpoints {
	e := &Endpoints{addrs: append([]string(nil), addrs...), tried: make(map[string]bool, len(addrs)), silent: map[string]time.Time{}}
	seen := make(map[string]bool, len(addrs))
	for _, a := range addrs {
		seen[a] = true
	}
	e.distinct = len(seen)
	return e
}

// Next returns the address to dial now.
func (e *Endpoints) Next() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.leader != "" {
		l := e.leader
		e.leader = ""
		e.markLocked(l)
		return l
	}
	if len(e.addrs) == 0 {
		return ""
	}
	// A silent endpoint is passed over while another is left in the round (it counts as tried,
	// so the round still ends and the loop pauses); when only silent ones are left it is tried.
	now := time.Now()
	for range e.addrs {
		a := e.addrs[e.next%len(e.addrs)]
		if !now.Before(e.silent[a]) || e.tried[a] {
			break
		}
		e.markLocked(a)
		e.next++
	}
	a := e.addrs[e.next%len(e.addrs)]
	e.next++
	e.markLocked(a)
	return a
}

// Silent records that a answered nothing (Liveness.Watch gave up on it): for d, hints naming it
// are not followed and the rotation passes it over while another endpoint is left in the
// round. A paused leader stays named by the standby until its lease expires; following that
// hint would cost another silence each time.
func (e *Endpoints) Silent(a string, d time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.silent[a] = time.Now().Add(d)
}

// markLocked records that a was tried in this round (when it is one of the endpoints).
func (e *Endpoints) markLocked(a string) {
	for _, x := range e.addrs {
		if x == a {
			e.tried[a] = true
			return
		}
	}
}

// Pause reports whether a reconnect loop should back off now, after a failed attempt: once
// every endpoint has been tried since the last pause (by rotation or as a hinted leader), and
// then it starts a new round. Before that the loop tries the next endpoint at once; at most
// len(addrs) rotation picks complete a round, so the loop never spins.
func (e *Endpoints) Pause() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.tried) < e.distinct {
		return false
	}
	clear(e.tried)
	return true
}

// Reset starts a new round (a connection was served).
func (e *Endpoints) Reset() {
	e.mu.Lock()
	defer e.mu.Unlock()
	clear(e.tried)
}

// Hint records the leader named by err (if any) so that the next Next returns it. It reports
// whether a hint was found and followed (not one naming a Silent endpoint).
func (e *Endpoints) Hint(err error) bool {
	h, ok := LeaderHintFrom(err)
	if !ok {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if time.Now().Before(e.silent[h.GetLeaderAddr()]) {
		return false // a leader that answered nothing just now: not followed (Silent)
	}
	e.leader = h.GetLeaderAddr()
	return true
}

// Backoff is jittered exponential backoff for reconnect loops. The default ceiling
// (DefaultBackoffMax) is short on purpose: during a failover a client retries a standby that
// refuses ("no leader elected yet") and a dead leader's address for a whole election TTL, and a
// ceiling of seconds made sidecars and gateways reach the new leader 1.2–2.5 s after it led
// (issue 16 finding 3). Each attempt is one cheap refused call.
type Backoff struct {
	Min, Max time.Duration
	cur      time.Duration
}

// Next returns the next delay (full jitter between Min and the current ceiling).
func (b *Backoff) Next() time.Duration {
	if b.Min <= 0 {
		b.Min = 50 * time.Millisecond
	}
	if b.Max <= 0 {
		b.Max = DefaultBackoffMax
	}
	if b.cur < b.Min {
		b.cur = b.Min
	} else {
		b.cur *= 2
		if b.cur > b.Max {
			b.cur = b.Max
		}
	}
	return b.Min/2 + time.Duration(rand.Int64N(int64(b.cur)))
}

// DefaultBackoffMax is Backoff's ceiling when Max is not set.
const DefaultBackoffMax = 400 * time.Millisecond

// Reset returns the backoff to its minimum after a success.
func (b *Backoff) Reset() { b.cur = 0 }
