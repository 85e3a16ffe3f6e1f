package cpclient

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// end is how one scripted session ends.
type end struct {
	served bool
	err    error
}

// TestFollow drives Follow with scripted sessions that end as a control plane's do today (a
// standby's UNAVAILABLE with a LeaderHint, a served stream that ends naming the new leader, a
// refusal, a silent leader) and checks the order of dials and pauses ("|"). The run ends when an
// endpoint's script runs out (that session cancels the context) or at the pause limit.
func TestFollow(t *testing.T) {
	hint := func(addr string) error {
		return NotLeaderError(&kvcv1.LeaderHint{LeaderId: addr, LeaderAddr: addr, Epoch: 2})
	}
	refused := errors.New("connection refused")
	tests := []struct {
		name    string
		addrs   []string
		script  map[string][]end
		pauses  int // the run ends at this pause
		want    string
		silents []string
	}{
		{"a standby's hint is followed at once", []string{"standby", "other"},
			map[string][]end{"standby": {{false, hint("leader")}}}, 1, "standby leader", nil},
		{"a leader change ends a served stream: the new leader at once", []string{"a"},
			map[string][]end{"a": {{true, hint("b")}}, "b": {{true, hint("c")}}}, 1, "a b c", nil},
		{"stale hints naming each other: two hops, then a pause", []string{"a"},
			map[string][]end{"a": {{false, hint("b")}, {false, hint("b")}, {false, hint("b")}}, "b": {{false, hint("a")}, {false, hint("a")}, {false, hint("a")}}},
			2, "a b a | b a b |", nil},
		{"a refusal: every endpoint once, then a pause", []string{"a", "b"},
			map[string][]end{"a": {{false, refused}, {false, refused}}, "b": {{false, refused}, {false, refused}}}, 2, "a b | a b |", nil},
		{"a served stream that ends: a short pause, then the rounds anew", []string{"a", "b"},
			map[string][]end{"a": {{true, refused}}, "b": {{false, refused}}}, 2, "a | b a", nil},
		{"a silent leader's own hint is not followed, nor its turn taken", []string{"a", "b"},
			map[string][]end{"a": {{true, &SilentError{Silence: time.Hour, Err: hint("a")}}}, "b": {{false, hint("a")}, {false, hint("a")}}},
			2, "a | b b |", []string{"a"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			var trace, silents []string
			next := map[string]int{}
			session := func(ctx context.Context, addr string) (bool, error) {
				trace = append(trace, addr)
				i := next[addr]
				next[addr]++
				if i >= len(tt.script[addr]) {
					cancel()
					return false, ctx.Err()
				}
				return tt.script[addr][i].served, tt.script[addr][i].err
			}
			pauses := 0
			f := func(f *follower) {
				f.wait = func(_ context.Context, d time.Duration) bool {
					if d <= 0 {
						t.Errorf("pause of %v", d)
					}
					trace = append(trace, "|")
					pauses++
					return pauses < tt.pauses
				}
			}
			err := Follow(ctx, NewEndpoints(tt.addrs), session, f, WithBackoff(time.Hour, time.Hour),
				OnSilent(func(addr string) { silents = append(silents, addr) }))
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(trace, " "); got != tt.want {
				t.Fatalf("dials and pauses %q, want %q", got, tt.want)
			}
			if !slices.Equal(silents, tt.silents) {
				t.Fatalf("silent endpoints %v, want %v", silents, tt.silents)
			}
		})
	}
}

// Follow returns nil when its context ends in the middle of a pause.
func TestFollowStopsInPause(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	paused := make(chan struct{})
	go func() {
		done <- Follow(ctx, NewEndpoints([]string{"a"}), func(context.Context, string) (bool, error) {
			return false, errors.New("refused")
		}, WithBackoff(time.Hour, time.Hour), func(f *follower) {
			f.wait = func(ctx context.Context, d time.Duration) bool { close(paused); return sleep(ctx, d) }
		})
	}()
	<-paused
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
