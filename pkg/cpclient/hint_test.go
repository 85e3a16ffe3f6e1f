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
