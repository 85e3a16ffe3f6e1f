package router

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestRouteStreamEndReleases (issue 23 item 6): the reservations of decisions a Route stream
// got and did not report are released when the stream ends — at once when the client closed
// it, after StreamEndGrace when it broke (an outcome on the gateway's next stream within the
// grace still applies) — not at the 30 s reservation timeout. A reported decision is not
// touched.
func TestRouteStreamEndReleases(t *testing.T) {
	for _, tc := range []struct {
		name      string
		report    bool // the outcome goes on the same stream before it ends
		broken    bool // the client cancels instead of closing
		lateOK    bool // an outcome after the end (another stream) within the grace
		how       string
		heldAfter bool // the reservation still held right after the end
	}{
		{name: "closed after one query", how: "closed"},
		{name: "broken, outcome on the next stream", broken: true, lateOK: true, how: "broken", heldAfter: true},
		{name: "broken, no outcome", broken: true, how: "broken", heldAfter: true},
		{name: "reported, then closed", report: true, how: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, basicCluster()...)
			conn := serve(t, f.s)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			sctx, scancel := context.WithCancel(ctx)
			defer scancel()
			st, err := kvcv1.NewRouterServiceClient(conn).Route(sctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Send(query("s", 0, 3000, 100)); err != nil {
				t.Fatal(err)
			}
			resp, err := st.Recv()
			d := resp.GetDecision()
			if err != nil || d.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED {
				t.Fatalf("decision %v %v", resp, err)
			}
			dw := d.GetDecode().GetWorkerId()
			held := func() int64 {
				f.s.mu.Lock()
				defer f.s.mu.Unlock()
				return f.s.led.Reserved(dw).Tokens
			}
			if held() == 0 {
				t.Fatal("the decision holds nothing on its decode worker")
			}
			if tc.report {
				if err := st.Send(outcome(d.DecisionId, true, okKind, 3100)); err != nil {
					t.Fatal(err)
				}
				if a, err := st.Recv(); err != nil || a.GetOutcomeAck() == nil {
					t.Fatalf("ack %v %v", a, err)
				}
			}
			if tc.broken {
				scancel()
			} else if err := st.CloseSend(); err != nil {
				t.Fatal(err)
			}
			_, _ = st.Recv() // EOF or Canceled
			if tc.how == "" {
				return // nothing left to release (held() is the settled success's, not a reservation)
			}
			counted := func() float64 { return testutil.ToFloat64(f.s.m.streamEnd.WithLabelValues(tc.how)) }
			deadline := time.Now().Add(5 * time.Second)
			for counted() != 1 {
				if time.Now().After(deadline) {
					t.Fatalf("kvc_router_reservations_stream_end_total{how=%q} = %v, want 1", tc.how, counted())
				}
				time.Sleep(5 * time.Millisecond) // the server notices the stream end on its own goroutine
			}
			if got := held() != 0; got != tc.heldAfter {
				t.Fatalf("held after the end: %v, want %v", got, tc.heldAfter)
			}
			switch {
			case tc.lateOK:
				if late := f.s.Handle(outcome(d.DecisionId, true, okKind, 3100)); late.GetOutcomeAck() == nil {
					t.Fatalf("an outcome within the grace was refused: %v", late)
				}
			case tc.heldAfter:
				f.now = f.now.Add(StreamEndGrace - time.Millisecond)
				if f.s.expire(f.now) != 0 {
					t.Fatal("released before the grace ran out")
				}
				f.now = f.now.Add(time.Millisecond)
				if n := f.s.expire(f.now); n != 1 || held() != 0 {
					t.Fatalf("%d released at the grace, %d tokens still held", n, held())
				}
			default:
				if late := f.s.Handle(outcome(d.DecisionId, true, okKind, 3100)); late.GetError().GetCode() != int32(codes.FailedPrecondition) {
					t.Fatalf("outcome after the release: %v, want FAILED_PRECONDITION", late)
				}
			}
		})
	}
}
