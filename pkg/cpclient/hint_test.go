package cpclient

import (
	"errors"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestLeaderHintRoundTrip(t *testing.T) {
	tests := []struct {
		name     string
		err      error
		wantAddr string
		wantOK   bool
	}{
		{"hint", NotLeaderError(&kvcv1.LeaderHint{LeaderId: "cp-1", LeaderAddr: "127.0.0.1:7000", Epoch: 5}), "127.0.0.1:7000", true},
		{"no leader yet", NotLeaderError(&kvcv1.LeaderHint{}), "", false},
		{"nil hint", NotLeaderError(nil), "", false},
		{"plain error", errors.New("boom"), "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, ok := LeaderHintFrom(tt.err)
			if ok != tt.wantOK || h.GetLeaderAddr() != tt.wantAddr {
				t.Fatalf("got (%v, %v), want (%q, %v)", h, ok, tt.wantAddr, tt.wantOK)
			}
		})
	}
}

func TestEndpointsFollowHint(t *testing.T) {
	e := NewEndpoints([]string{"a", "b"})
	if got := e.Next(); got != "a" {
		t.Fatalf("first = %q", got)
	}
	if !e.Hint(NotLeaderError(&kvcv1.LeaderHint{LeaderId: "x", LeaderAddr: "leader:1"})) {
		t.Fatal("hint not found")
	}
	if got := e.Next(); got != "leader:1" {
		t.Fatalf("after hint = %q", got)
	}
	if got := e.Next(); got != "b" {
		t.Fatalf("rotation = %q", got)
	}
}

// TestEndpointsRounds: a reconnect loop pauses only once every endpoint was tried since the
// last pause (by rotation or as a hinted leader), so a standby that leads is reached within one
// pause; it never goes more than one round without a pause.
func TestEndpointsRounds(t *testing.T) {
	hint := func(addr string) error { return NotLeaderError(&kvcv1.LeaderHint{LeaderId: "x", LeaderAddr: addr}) }
	type step struct {
		want  string // Next's answer
		err   error  // the attempt's error: a hint is followed, else the loop asks Pause
		pause bool   // Pause's answer after a failure without a hint
	}
	for _, tc := range []struct {
		name  string
		addrs []string
		steps []step
	}{
		{"refusals: the other endpoint at once, then a pause", []string{"a", "b"}, []step{
			{"a", nil, false}, {"b", nil, true}, {"a", nil, false}, {"b", nil, true}}},
		{"failover: the standby names the dead leader", []string{"standby", "dead"}, []step{
			{"standby", hint("dead"), false}, {"dead", nil, true}, // both tried: pause
			{"dead", nil, false}, {"standby", hint("dead"), false}, {"dead", nil, true}}},
		{"a hinted address that is no endpoint does not count", []string{"a", "b"}, []step{
			{"a", hint("elsewhere:1"), false}, {"elsewhere:1", nil, false}, {"b", nil, true}}},
		{"duplicate endpoints", []string{"a", "a"}, []step{{"a", nil, true}, {"a", nil, true}}},
		{"one endpoint", []string{"a"}, []step{{"a", nil, true}, {"a", nil, true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := NewEndpoints(tc.addrs)
			for i, st := range tc.steps {
				if got := e.Next(); got != st.want {
					t.Fatalf("step %d: Next %q, want %q", i, got, st.want)
				}
				if st.err != nil {
					if !e.Hint(st.err) {
						t.Fatalf("step %d: hint not found", i)
					}
					continue
				}
				if got := e.Pause(); got != st.pause {
					t.Fatalf("step %d (%s): Pause %v, want %v", i, st.want, got, st.pause)
				}
			}
		})
	}
	// Reset starts a new round; without hints a round never outlasts the distinct endpoints.
	e := NewEndpoints([]string{"a", "b", "c"})
	e.Next()
	e.Reset()
	for i, since := 0, 0; i < 30; i++ {
		e.Next()
		if since++; e.Pause() {
			since = 0
		}
		if since >= 3 {
			t.Fatalf("attempt %d: %d attempts without a pause", i, since)
		}
	}
}

func TestBackoffBounds(t *testing.T) {
	b := Backoff{Min: 10, Max: 100}
	for i := 0; i < 50; i++ {
		d := b.Next()
		if d < 5 || d > 105 {
			t.Fatalf("delay %v out of bounds", d)
		}
	}
}

// The default ceiling keeps a client that retried through a whole election within ~0.4 s of
// the new leader (issue 16 finding 3).
func TestBackoffDefaultCeiling(t *testing.T) {
	var b Backoff
	for i := 0; i < 100; i++ {
		if d := b.Next(); d <= 0 || d > DefaultBackoffMax+25*time.Millisecond {
			t.Fatalf("delay %d: %v, above the default ceiling %v", i, d, DefaultBackoffMax)
		}
	}
}
