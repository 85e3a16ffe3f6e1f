package server

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
)

func TestSinkDelta(t *testing.T) {
	tests := []struct {
		name   string
		chunks []string
		want   string
	}{
		{"incremental", []string{"a", "b", "c"}, "abc"},
		{"incremental repeats", []string{"a", "a", "a"}, "aaa"},
		{"cumulative", []string{"He", "Hello", "Hello w"}, "Hello w"},
		{"single", []string{"x"}, "x"},
		{"empty chunks", []string{"", "", "z"}, "z"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newSink(httptest.NewRecorder(), &api.Request{Kind: api.Chat, RID: "r"})
			var got strings.Builder
			for _, c := range tt.chunks {
				got.WriteString(s.delta(c))
			}
			if got.String() != tt.want || s.acc.String() != tt.want {
				t.Fatalf("got %q (acc %q), want %q", got.String(), s.acc.String(), tt.want)
			}
		})
	}
}

// A continuation's worker streams its text from the join (resume.go): the deltas continue
// after what the client has, whether the workers stream cumulative text or increments, and
// whether the style was known before the join or only after it.
func TestSinkDeltaAfterResume(t *testing.T) {
	tests := []struct {
		name          string
		before, after []string
		want          string
	}{
		{"incremental", []string{"a", "b"}, []string{"c", "d"}, "abcd"},
		{"cumulative", []string{"He", "Hell"}, []string{"o", "o w", "o wo"}, "Hello wo"},
		{"cumulative, one chunk before the join", []string{"He"}, []string{"ll", "llo"}, "Hello"},
		{"incremental repeats across the join", []string{"a", "a"}, []string{"a", "a"}, "aaaa"},
		{"nothing after the join", []string{"x", "xy"}, nil, "xy"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newSink(httptest.NewRecorder(), &api.Request{Kind: api.Chat, RID: "r"})
			var got strings.Builder
			for _, c := range tt.before {
				got.WriteString(s.delta(c))
			}
			s.resume(&resumeBase{})
			for _, c := range tt.after {
				got.WriteString(s.delta(c))
			}
			if got.String() != tt.want || s.acc.String() != tt.want {
				t.Fatalf("got %q (acc %q), want %q", got.String(), s.acc.String(), tt.want)
			}
		})
	}
}
