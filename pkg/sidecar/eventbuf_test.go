package sidecar

import (
	"fmt"
	"io"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestEventBuffer(t *testing.T) {
	ev := func(i int) *kvcv1.SessionEvent { return &kvcv1.SessionEvent{SessionId: fmt.Sprintf("s%d", i)} }
	ids := func(evs []*kvcv1.SessionEvent) []string {
		var out []string
		for _, e := range evs {
			out = append(out, e.GetSessionId())
		}
		return out
	}
	tests := []struct {
		name        string
		max         int
		push        int // s0..s(push-1)
		take        int // taken, then (when putBack) put back after one more push
		putBack     bool
		wantRest    []string
		wantDropped float64
	}{
		{"under the bound", 4, 3, 0, false, []string{"s0", "s1", "s2"}, 0},
		{"oldest dropped", 3, 5, 0, false, []string{"s2", "s3", "s4"}, 2},
		{"take some", 4, 4, 2, false, []string{"s2", "s3"}, 0},
		{"put back keeps order", 4, 3, 2, true, []string{"s0", "s1", "s2", "s3"}, 0},
		{"put back over the bound drops oldest", 3, 3, 2, true, []string{"s1", "s2", "s3"}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := newEventBuffer(tt.max, nil)
			for i := 0; i < tt.push; i++ {
				b.push(ev(i))
			}
			if tt.take > 0 {
				taken := b.take(tt.take)
				if len(taken) != tt.take || taken[0].GetSessionId() != "s0" {
					t.Fatalf("took %v", ids(taken))
				}
				if tt.putBack {
					b.push(ev(tt.push)) // raised while the taken ones were being sent
					b.putBack(taken)
				}
			}
			if got := ids(b.take(0)); !slices.Equal(got, tt.wantRest) {
				t.Fatalf("queued %v, want %v", got, tt.wantRest)
			}
			if d := testutil.ToFloat64(b.dropped); d != tt.wantDropped {
				t.Fatalf("dropped %v, want %v", d, tt.wantDropped)
			}
			if g := testutil.ToFloat64(b.buffered); g != 0 {
				t.Fatalf("buffered gauge %v after taking all", g)
			}
		})
	}
}

// failingStream accepts ok Sends, then fails every one.
type failingStream struct {
	grpc.BidiStreamingClient[kvcv1.ConnectRequest, kvcv1.ConnectResponse]
	ok   int
	sent []string
}

func (s *failingStream) Send(m *kvcv1.ConnectRequest) error {
	if len(s.sent) >= s.ok {
		return io.EOF
	}
	s.sent = append(s.sent, m.GetSessionEvent().GetSessionId())
	return nil
}

// Events whose Send failed stay queued, in order, ahead of those raised meanwhile.
func TestSendBufferedKeepsUnsent(t *testing.T) {
	c := NewControlPlane(CPConfig{Endpoints: []string{"x"}, EventBuffer: 8}, nil, zerolog.Nop())
	for i := 0; i < 5; i++ {
		c.Report(&kvcv1.SessionEvent{SessionId: fmt.Sprintf("s%d", i)})
	}
	st := &failingStream{ok: 2}
	n, err := c.sendBuffered(st, 0)
	if n != 2 || err == nil || !slices.Equal(st.sent, []string{"s0", "s1"}) {
		t.Fatalf("sent %d %v, err %v", n, st.sent, err)
	}
	c.Report(&kvcv1.SessionEvent{SessionId: "s5"})
	st = &failingStream{ok: 100}
	if n, err := c.sendBuffered(st, 0); n != 4 || err != nil || !slices.Equal(st.sent, []string{"s2", "s3", "s4", "s5"}) {
		t.Fatalf("then sent %d %v, err %v", n, st.sent, err)
	}
}
