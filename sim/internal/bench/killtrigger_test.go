package bench

import (
	"testing"

	"github.com/kvcentric/kvcentric/sim/internal/report"
)

func TestAfterRequests(t *testing.T) {
	fired := func(a *afterRequests) bool {
		select {
		case <-a.fired:
			return true
		default:
			return false
		}
	}
	tests := []struct {
		name string
		n    int
		recs []report.Record
		want bool
	}{
		{"n ok fire it", 2, []report.Record{{OK: true}, {OK: true}}, true},
		{"failures do not count", 2, []report.Record{{OK: true}, {OK: false}, {OK: false}}, false},
		{"one short", 3, []report.Record{{OK: true}, {OK: true}}, false},
		{"more than n close once", 1, []report.Record{{OK: true}, {OK: true}, {OK: true}}, true},
		{"after failures", 2, []report.Record{{OK: false}, {OK: true}, {OK: false}, {OK: true}}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := newAfterRequests(tc.n)
			calls := 0
			cb := a.wrap(func(done, total int, last *report.Record) { calls++ })
			for i := range tc.recs {
				if fired(a) && i < tc.n {
					t.Fatalf("fired after %d records", i)
				}
				cb(i+1, len(tc.recs), &tc.recs[i])
			}
			cb(len(tc.recs), len(tc.recs), nil) // a nil record is ignored
			if got := fired(a); got != tc.want {
				t.Fatalf("fired %v, want %v", got, tc.want)
			}
			if calls != len(tc.recs)+1 {
				t.Fatalf("next called %d times, want %d", calls, len(tc.recs)+1)
			}
		})
	}
}
