package app

import (
	"math"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// claimant is a scripted sidecar that records the release commands it gets and the status its
// stream ended with.
type claimant struct {
	*cpStream
	mu       sync.Mutex
	released map[string]bool
	ended    chan error // the stream's end, once
}

func startClaimant(t *testing.T, c *cp, h *kvcv1.Hello) *claimant {
	t.Helper()
	var sc *cpStream
	waitFor(t, h.GetWorkerId()+" attached", func() bool {
		s, w, err := open(t, c, h)
		if err != nil || w == nil {
			return false // the worker's previous stream may not be detached yet
		}
		sc = s
		return true
	})
	cl := &claimant{cpStream: sc, released: map[string]bool{}, ended: make(chan error, 1)}
	go func() {
		for {
			m, err := sc.stream.Recv()
			if err != nil {
				cl.ended <- err
				return
			}
			cmd := m.GetCommand()
			if cmd == nil {
				continue
			}
			if r := cmd.GetReleaseSession(); r != nil {
				cl.mu.Lock()
				cl.released[r.GetSessionId()] = true
				cl.mu.Unlock()
			}
			_ = sc.send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Ack{Ack: &kvcv1.CommandAck{CommandId: cmd.GetCommandId(), Ok: true}}})
		}
	}()
	return cl
}

func (cl *claimant) wasReleased(id string) bool {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	return cl.released[id]
}

// refusal waits for the stream to end and returns its code (codes.OK: it did not end).
func (cl *claimant) refusal(within time.Duration) codes.Code {
	select {
	case err := <-cl.ended:
		return code(err)
	case <-time.After(within):
		return codes.OK
	}
}

func resync(full bool, rs ...*kvcv1.ResidentSession) *kvcv1.ConnectRequest {
	return &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: &kvcv1.ResidentSessions{FullSync: full, Sessions: rs}}}
}

func event(kind kvcv1.SessionEventKind, id string, kvLen int64, gen uint64) *kvcv1.ConnectRequest {
	return &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{
		SessionId: id, Kind: kind, KvLen: kvLen, Generation: gen}}}
}

// TestGenerationClaimsRefused (issue 23 item 2): a real control plane on embedded etcd, real
// gRPC services, scripted sidecars. Sessions are seeded through the router (their generations
// issued by this leader), then sidecars claim generations the control plane never issued: a
// resync of 2^60 and a commit of 2^64-1 on the worker's own session, a snapshot of 2^60, a
// resync of another worker's session at a generation of this term above the session's, and a
// commit of a session never seeded. Each ends the sidecar's stream with a stable code
// (OUT_OF_RANGE, PERMISSION_DENIED), is counted, and changes nothing: the session stays on its
// worker at its generation and that worker is not told to release it. Honest reports go on
// being applied, and the next leader numbers its generations above the first one's.
func TestGenerationClaimsRefused(t *testing.T) {
	e := etcdtest.Start(t)
	c := startCP(t, e.Endpoints(), "cp-a")
	c.waitLeader(t)
	ctx := t.Context()

	cls := map[string]*claimant{}
	for _, h := range []*kvcv1.Hello{decodeHello("d1"), decodeHello("d2"), prefillHello("p1")} {
		cls[h.GetWorkerId()] = startClaimant(t, c, h)
	}
	for _, d := range []string{"d1", "d2"} {
		// A decode sidecar's full resync right after it attaches, as every sidecar sends: its
		// commits are then current (a commit before it may be a replay from a cut-off stream).
		if err := cls[d].send(resync(true)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "3 workers ready", func() bool {
		r, err := c.admin.ListWorkers(ctx, &kvcv1.ListWorkersRequest{})
		n := 0
		for _, w := range r.GetWorkers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return err == nil && n == 3
	})
	rs, err := kvcv1.NewRouterServiceClient(c.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	session := func(id string) *kvcv1.SessionRecord {
		t.Helper()
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: id})
		if err != nil {
			t.Fatalf("GetSession %s: %v", id, err)
		}
		return r.GetSession()
	}
	seed := func(rid, id string) *kvcv1.RouteDecision {
		t.Helper()
		d := route(t, rs, &kvcv1.RouteQuery{RequestId: rid, SessionId: id, InputTokens: 1000, MaxOutputTokens: 16, MultiturnHint: true})
		if d.GetDecode().GetWorkerId() == "" {
			t.Fatalf("%s: decision %v names no decode worker", rid, d)
		}
		// The decode worker commits through its sidecar (kv_committed_len's one writer), then
		// the gateway reports the outcome; the two streams may arrive in either order.
		if err := cls[d.GetDecode().GetWorkerId()].send(event(kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, id, 1000, 0)); err != nil {
			t.Fatal(err)
		}
		reportOutcome(t, rs, d, 1000)
		waitFor(t, id+" committed", func() bool {
			r := session(id)
			return r.GetDecodeWorker() == d.GetDecode().GetWorkerId() && r.GetKvCommittedLen() == 1000
		})
		return d
	}

	// s-1 seeded on dA at generation G (the term's first).
	dA := seed("q1", "s-1").GetDecode().GetWorkerId()
	dB := map[string]string{"d1": "d2", "d2": "d1"}[dA]
	g := session("s-1").GetGeneration()
	if g == 0 || session("s-1").GetDecodeWorker() != dA {
		t.Fatalf("s-1 after its seed: %v", session("s-1"))
	}
	// s-2 seeded, released, seeded again: the leader has issued G+1.
	d2 := seed("q2", "s-2").GetDecode().GetWorkerId()
	if err := cls[d2].send(event(kvcv1.SessionEventKind_SESSION_EVENT_KIND_RELEASED, "s-2", 1000, g)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "s-2 released", func() bool { return session("s-2").GetDecodeWorker() == "" })
	seed("q3", "s-2")
	if got := session("s-2").GetGeneration(); got != g+1 {
		t.Fatalf("s-2's second residency has generation %d, want %d", got, g+1)
	}

	outer := t // the sidecars' streams outlive each case
	for _, tc := range []struct {
		name   string
		worker string
		claim  *kvcv1.ConnectRequest
		want   codes.Code
	}{
		{"another worker's session at a generation of this term", dB,
			resync(false, &kvcv1.ResidentSession{SessionId: "s-1", KvCommittedLen: 1000, Generation: g + 1}), codes.PermissionDenied},
		{"resync of 2^60 on its own session", dA,
			resync(true, &kvcv1.ResidentSession{SessionId: "s-1", KvCommittedLen: 1000, Generation: 1 << 60}), codes.OutOfRange},
		{"commit of 2^64-1 on its own session", dA,
			event(kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, "s-1", 1100, math.MaxUint64), codes.OutOfRange},
		{"commit of a session never seeded", dB,
			event(kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, "s-never", 10, g), codes.PermissionDenied},
		{"snapshot of 2^60", "p1",
			&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: &kvcv1.ResidentSessions{
				Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "s-1", Seqlen: 1000, Generation: 1 << 60}}}}}, codes.OutOfRange},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := cls[tc.worker]
			if err := cl.send(tc.claim); err != nil {
				t.Fatal(err)
			}
			if got := cl.refusal(5 * time.Second); got != tc.want {
				t.Fatalf("stream ended with %v, want %v", got, tc.want)
			}
			rec := session("s-1")
			if rec.GetDecodeWorker() != dA || rec.GetGeneration() != g || rec.GetKvCommittedLen() != 1000 || rec.GetSnapshot() != nil {
				t.Fatalf("s-1 after the refused claim: %v (want on %s at generation %d, 1000 committed, no snapshot)", rec, dA, g)
			}
			if _, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "s-never"}); code(err) != codes.NotFound {
				t.Fatalf("s-never: %v, want NotFound", err)
			}
			cls[tc.worker] = startClaimant(outer, c, map[string]*kvcv1.Hello{"d1": decodeHello("d1"), "d2": decodeHello("d2"), "p1": prefillHello("p1")}[tc.worker])
			if cls[dA].wasReleased("s-1") {
				t.Fatalf("%s was told to release s-1", dA)
			}
		})
	}
	for _, line := range []string{
		`kvc_cp_generation_claims_refused_total{reason="above_issued"} 3`,
		`kvc_cp_generation_claims_refused_total{reason="not_given"} 2`,
		`kvc_cp_stream_messages_rejected_total{reason="generation_above_issued"} 3`,
		`kvc_cp_stream_messages_rejected_total{reason="generation_not_given"} 2`,
	} {
		if !metric(t, c, line) {
			t.Errorf("metric %s missing", line)
		}
	}

	// Honest reports are applied: the holder's own generation, an earlier term's generation of
	// a session this leader holds no residency for (a copy an earlier leader gave out).
	if err := cls[dA].send(resync(false, &kvcv1.ResidentSession{SessionId: "s-1", KvCommittedLen: 1200, Generation: g})); err != nil {
		t.Fatal(err)
	}
	if err := cls[dB].send(resync(false, &kvcv1.ResidentSession{SessionId: "s-old", KvCommittedLen: 300, Generation: 5})); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "honest reports applied", func() bool {
		r, err := c.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "s-old"})
		return session("s-1").GetKvCommittedLen() == 1200 && err == nil && r.GetSession().GetDecodeWorker() == dB
	})
	if got := cls[dA].refusal(0); got != codes.OK {
		t.Fatalf("an honest report ended the stream: %v", got)
	}

	// The next leader's generations are above every one the first leader issued.
	_ = rs.CloseSend()
	c.stop()
	c2 := startCP(t, e.Endpoints(), "cp-b")
	c2.waitLeader(t)
	for _, h := range []*kvcv1.Hello{decodeHello("d1"), decodeHello("d2"), prefillHello("p1")} {
		// a full resync from each: the new leader places sessions once every decode worker sent one
		if err := startClaimant(t, c2, h).send(resync(true)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "3 workers ready on cp-b", func() bool {
		r, err := c2.admin.ListWorkers(ctx, &kvcv1.ListWorkersRequest{})
		n := 0
		for _, w := range r.GetWorkers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return err == nil && n == 3
	})
	rs2, err := kvcv1.NewRouterServiceClient(c2.conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	d := route(t, rs2, &kvcv1.RouteQuery{RequestId: "q4", SessionId: "s-new", InputTokens: 1000, MaxOutputTokens: 16, MultiturnHint: true})
	reportOutcome(t, rs2, d, 1000)
	r, err := c2.admin.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: "s-new"})
	if err != nil || r.GetSession().GetGeneration() <= g+1 {
		t.Fatalf("the next leader's first generation: %v %v, want above %d", r.GetSession(), err, g+1)
	}
}
