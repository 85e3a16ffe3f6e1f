package worker

import (
	"testing"
	"time"
)

// TestBusyClock: overlapping work counts once, idle gaps not at all, and a running stretch is
// included when read.
func TestBusyClock(t *testing.T) {
	base := time.Unix(1000, 0)
	at := base
	b := newBusyClock(func() time.Time { return at })
	step := func(d time.Duration) { at = at.Add(d) }
	tests := []struct {
		name string
		run  func()
		want float64
	}{
		{"idle", func() { step(time.Second) }, 0},
		{"one request for 2s", func() { b.begin(); step(2 * time.Second); b.end() }, 2},
		{"idle gap", func() { step(5 * time.Second) }, 2},
		{"two overlapping for 1s + 1s alone", func() {
			b.begin()
			step(500 * time.Millisecond)
			b.begin()
			step(time.Second)
			b.end()
			step(500 * time.Millisecond)
			b.end()
		}, 4},
		{"running stretch read while busy", func() { b.begin(); step(3 * time.Second) }, 7},
		{"its end adds nothing more", func() { b.end(); step(time.Second) }, 7},
		{"an unmatched end is ignored", func() { b.end() }, 7},
	}
	for _, tt := range tests {
		tt.run()
		if got := b.seconds(); got != tt.want {
			t.Fatalf("%s: busy %v s, want %v", tt.name, got, tt.want)
		}
	}
}
