package cpclient

import (
	"context"
	"errors"
	"time"

	"github.com/rs/zerolog"
)

// MaxHintHops is how many leader hints in a row Follow goes to at once: two stale hints
// naming each other (mid-election) would otherwise make it dial as fast as the network answers.
const MaxHintHops = 2

// Session runs one connection to the control plane at addr until it ends and returns why it
// ended. served reports that the control plane answered on it (a sidecar's welcome, a route
// stream's first answer): the endpoint rounds and the backoff start over.
type Session func(ctx context.Context, addr string) (served bool, err error)

// FollowOption tunes Follow.
type FollowOption func(*follower)

// WithBackoff sets the pause between rounds (Backoff: Min 50 ms and Max DefaultBackoffMax when
// ≤ 0).
func WithBackoff(min, max time.Duration) FollowOption {
	return func(f *follower) { f.bo = Backoff{Min: min, Max: max} }
}

// WithLogger logs each session's end to l with msg as the message.
func WithLogger(l zerolog.Logger, msg string) FollowOption {
	return func(f *follower) { f.log, f.msg = l, msg }
}

// OnSilent calls fn with the address of a control plane left because it answered nothing
// (a *SilentError from the session; the endpoint is passed over for two silences).
func OnSilent(fn func(addr string)) FollowOption {
	return func(f *follower) { f.silent = fn }
}

type follower struct {
	bo     Backoff
	log    zerolog.Logger
	msg    string
	silent func(addr string)
	// wait pauses for d or until ctx ends (false); replaced in tests.
	wait func(ctx context.Context, d time.Duration) bool
}

// Follow keeps one session at a time to the control-plane leader until ctx ends (it then
// returns nil): it runs session on the endpoint eps names next, goes at once to the leader a
// refusal names (a LeaderHint; at most MaxHintHops in a row), at once to an endpoint not yet
// tried in this round (Endpoints), and otherwise pauses with backoff. A session that served
// resets the rounds and the backoff; one that ended silent (*SilentError) passes its endpoint
// over for a while (Endpoints.Silent). Both the sidecars and the gateway follow the leader
// with it.
func Follow(ctx context.Context, eps *Endpoints, session Session, opts ...FollowOption) error {
	f := &follower{log: zerolog.Nop(), msg: "control plane session ended", wait: sleep}
	for _, o := range opts {
		o(f)
	}
	hops := 0 // hints followed in a row without a pause
	for ctx.Err() == nil {
		addr := eps.Next()
		served, err := session(ctx, addr)
		if ctx.Err() != nil {
			return nil
		}
		var silent *SilentError
		if errors.As(err, &silent) {
			eps.Silent(addr, 2*silent.Silence) // a lease: its hints and its turn are passed over
			if f.silent != nil {
				f.silent(addr)
			}
		}
		followed := eps.Hint(err)
		ev := f.log.Warn()
		if followed {
			ev = f.log.Info() // a standby's refusal naming the leader: the usual way there
		}
		ev.Err(err).Str("addr", addr).Bool("served", served).Bool("leader_hint", followed).Msg(f.msg)
		if served {
			f.bo.Reset()
			eps.Reset()
			hops = 0 // a session that was served: its hint is a fresh leader change
		}
		if followed && hops < MaxHintHops {
			hops++
			continue // straight to the named leader
		}
		hops = 0
		if !served && !followed && !eps.Pause() {
			continue // an endpoint not tried in this round yet: at once
		}
		if !f.wait(ctx, f.bo.Next()) {
			return nil
		}
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
