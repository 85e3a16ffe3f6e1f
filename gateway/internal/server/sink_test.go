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
