package router

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
)

type fixture struct {
	t   *testing.T
	s   *Service
	c   *routertest.Cluster
	reg *prometheus.Registry
	now time.Time
}

func newFixture(t *testing.T, workers ...*kvcv1.Worker) *fixture {
	t.Helper()
	c := routertest.New(workers...)
	reg := prometheus.NewRegistry()
	s := New(c, zerolog.Nop(), reg)
	f := &fixture{t: t, s: s, c: c, reg: reg, now: time.Unix(1_700_000_000, 0)}
	s.now = func() time.Time { return f.now }
	return f
}

func query(session string, turn int32, input, out int64) *kvcv1.RouteRequest {
	return &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: fmt.Sprintf("r-%s-%d", session, turn), SessionId: session, Turn: turn,
		InputTokens: input, MaxOutputTokens: out, MultiturnHint: true,
	}}}
}

func outcome(id string, ok bool, kind kvcv1.RouteErrorKind, kvLen int64) *kvcv1.RouteRequest {
	return &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
		DecisionId: id, Success: ok, ErrorKind: kind, KvLenAfter: kvLen, TtftUs: 40_000,
	}}}
}

var okKind = kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE

func (f *fixture) decide(session string, turn int32, input, out int64) *kvcv1.RouteDecision {
	f.t.Helper()
	resp := f.s.Handle(query(session, turn, input, out))
	d := resp.GetDecision()
	if d == nil {
		f.t.Fatalf("query %s/%d: %v", session, turn, resp)
	}
	return d
}

// report sends decision id's outcome; a successful one of kvLen tokens on a decode worker
// that keeps the session is committed there first, as the worker's sidecar does before the
// worker answers (the commit is kv_committed_len's one writer; the outcome's kv_len_after
// only names the content's length).
func (f *fixture) report(id string, ok bool, kind kvcv1.RouteErrorKind, kvLen int64) {
	f.t.Helper()
	if ok && kvLen > 0 {
		f.commitFor(id, kvLen)
	}
	resp := f.s.Handle(outcome(id, ok, kind, kvLen))
	if resp.GetOutcomeAck().GetDecisionId() != id {
		f.t.Fatalf("outcome %s: %v", id, resp)
	}
}

// commitFor is the commit of kvLen tokens by the decode worker of decision id (when it keeps the
// session), through its sidecar.
func (f *fixture) commitFor(id string, kvLen int64) {
	f.t.Helper()
	if d, session := keeper(f.s, id); d != "" {
		f.c.Commit(d, session, kvLen)
	}
}

// keeper is the decode worker that keeps decision id's session and the session ("" when none).
func keeper(s *Service, id string) (decode, session string) {
	seq, ok := s.parseID(id)
	if !ok {
		return "", ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.led.pending.get(seq)
	if r == nil {
		r = s.late.m[seq]
	}
	if r == nil || r.decode == "" || !r.keep {
		return "", ""
	}
	return r.decode, r.session
}

func (f *fixture) session(id string) *kvcv1.SessionRecord {
	f.t.Helper()
	r, ok := f.c.Session(id)
	if !ok {
		f.t.Fatalf("no session %s", id)
	}
	return r
}

func (f *fixture) pending() int {
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	return f.s.led.pending.len()
}

// checkLedger verifies the per-worker sums equal the pending reservations and nothing is
// negative.
func (f *fixture) checkLedger() {
	f.t.Helper()
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	want := map[string]policy.Reserved{}
	var tokens int64
	for r := range f.s.led.pending.all() {
		if r.holdsDecode() {
			w := want[r.decode]
			w.Tokens += r.tokens
			if r.transfer {
				w.Transfers++
			}
			if r.transfer && r.landed {
				w.Landed++
			}
			if r.store && !r.landed {
				w.StoreTransfers++
			}
			if r.seed {
				w.Seeds++
			}
			if r.newSess {
				w.NewSession += r.tokens
			}
			want[r.decode] = w
		}
		if r.prefills && r.prefill != "" {
			w := want[r.prefill]
			w.Prefills++
			want[r.prefill] = w
		}
		if r.plain {
			w := want[r.decode]
			w.Plain++
			want[r.decode] = w
		}
		tokens += r.tokens
	}
	for id, a := range f.s.led.workers {
		w := a.held()
		if w.Tokens < 0 || w.Transfers < 0 || w.StoreTransfers < 0 || w.Seeds < 0 || w.Prefills < 0 || w.Plain < 0 || w.NewSession < 0 || w.NewSession > w.Tokens {
			f.t.Fatalf("negative reservation on %s: %+v", id, w)
		}
		if w != want[id] {
			f.t.Fatalf("ledger of %s is %+v, pending say %+v", id, w, want[id])
		}
	}
	for id, w := range want {
		if w != (policy.Reserved{}) && f.s.led.workers[id] == nil {
			f.t.Fatalf("ledger lost %s: %+v", id, w)
		}
	}
	if tokens != f.s.led.heldTokens || f.s.led.expiry.len() != f.s.led.pending.len() {
		f.t.Fatalf("held tokens %d vs %d, heap %d vs pending %d", f.s.led.heldTokens, tokens, f.s.led.expiry.len(), f.s.led.pending.len())
	}
}

func basicCluster() []*kvcv1.Worker {
	return []*kvcv1.Worker{routertest.Prefill("p1"), routertest.Prefill("p2"),
		routertest.Decode("d1", 200_000, 0), routertest.Decode("d2", 200_000, 0)}
}

func TestQueryValidation(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	long := strings.Repeat("x", 300)
	cases := []struct {
		name string
		q    *kvcv1.RouteQuery
		want string
	}{
		{"empty session", &kvcv1.RouteQuery{RequestId: "a", InputTokens: 10}, "session_id is required"},
		{"session with slash", &kvcv1.RouteQuery{RequestId: "a", SessionId: "a/b", InputTokens: 10}, "forbidden"},
		{"session too long", &kvcv1.RouteQuery{RequestId: "a", SessionId: long, InputTokens: 10}, "longer"},
		{"zero input", &kvcv1.RouteQuery{RequestId: "a", SessionId: "s", InputTokens: 0}, "input_tokens"},
		{"negative input", &kvcv1.RouteQuery{RequestId: "a", SessionId: "s", InputTokens: -5}, "input_tokens"},
		{"absurd input", &kvcv1.RouteQuery{RequestId: "a", SessionId: "s", InputTokens: 10_000_001}, "input_tokens"},
		{"negative output", &kvcv1.RouteQuery{RequestId: "a", SessionId: "s", InputTokens: 1, MaxOutputTokens: -1}, "max_output_tokens"},
		{"absurd output", &kvcv1.RouteQuery{RequestId: "a", SessionId: "s", InputTokens: 1, MaxOutputTokens: 1_000_001}, "max_output_tokens"},
		{"negative turn", &kvcv1.RouteQuery{RequestId: "a", SessionId: "s", InputTokens: 1, Turn: -1}, "turn"},
		{"request id too long", &kvcv1.RouteQuery{RequestId: long, SessionId: "s", InputTokens: 1}, "request_id"},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			resp := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: tt.q}})
			e := resp.GetError()
			if e == nil || e.Code != int32(codes.InvalidArgument) || !strings.Contains(e.Message, tt.want) {
				t.Fatalf("got %v, want INVALID_ARGUMENT mentioning %q", resp, tt.want)
			}
			if len(tt.q.RequestId) <= kvcv1.MaxIDLen && e.RequestId != tt.q.RequestId {
				t.Errorf("request_id %q not echoed", tt.q.RequestId)
			}
		})
	}
	for _, req := range []*kvcv1.RouteRequest{{}, {Kind: &kvcv1.RouteRequest_Query{}}, {Kind: &kvcv1.RouteRequest_Outcome{}}} {
		if e := f.s.Handle(req).GetError(); e == nil || e.Code != int32(codes.InvalidArgument) {
			t.Errorf("empty request %v: %v", req, e)
		}
	}
	if f.pending() != 0 {
		t.Fatalf("bad queries left %d reservations", f.pending())
	}
	// Limits themselves are valid; an unknown session is normal (first turn).
	d := f.decide("new-session", 0, 10_000_000, 1_000_000)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Reason != kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY {
		t.Errorf("huge first turn: %s/%s", d.Mode, d.Reason)
	}
	if d := f.decide("s1", 0, 1, 0); d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Errorf("first turn of a new session: %s", d.Mode)
	}
	if got := testutil.ToFloat64(f.s.m.errors.WithLabelValues("InvalidArgument")); got != float64(len(cases)+3) {
		t.Errorf("errors metric %v", got)
	}
}

func TestOutcomeErrors(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 1000, 100)
	f.checkLedger()
	bad := []struct {
		name string
		o    *kvcv1.RouteOutcome
		code codes.Code
	}{
		{"empty id", &kvcv1.RouteOutcome{Success: true}, codes.InvalidArgument},
		{"negative ttft", &kvcv1.RouteOutcome{DecisionId: d.DecisionId, Success: true, TtftUs: -1}, codes.InvalidArgument},
		{"negative latency", &kvcv1.RouteOutcome{DecisionId: d.DecisionId, Success: true, LatencyUs: -1}, codes.InvalidArgument},
		{"absurd kv len", &kvcv1.RouteOutcome{DecisionId: d.DecisionId, Success: true, KvLenAfter: 1 << 40}, codes.InvalidArgument},
		{"success with an error", &kvcv1.RouteOutcome{DecisionId: d.DecisionId, Success: true, ErrorKind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT}, codes.InvalidArgument},
		{"failure without kind", &kvcv1.RouteOutcome{DecisionId: d.DecisionId}, codes.InvalidArgument},
		{"unknown kind", &kvcv1.RouteOutcome{DecisionId: d.DecisionId, ErrorKind: 77}, codes.InvalidArgument},
		{"unknown executed mode", &kvcv1.RouteOutcome{DecisionId: d.DecisionId, Success: true, ExecutedMode: 9}, codes.InvalidArgument},
		{"foreign id", &kvcv1.RouteOutcome{DecisionId: "d00000000-1", Success: true}, codes.NotFound},
		{"never issued", &kvcv1.RouteOutcome{DecisionId: f.s.id(999), Success: true}, codes.NotFound},
		{"garbage suffix", &kvcv1.RouteOutcome{DecisionId: f.s.prefix + "x1", Success: true}, codes.NotFound},
		{"seq zero", &kvcv1.RouteOutcome{DecisionId: f.s.prefix + "0", Success: true}, codes.NotFound},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			e := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: tt.o}}).GetError()
			if e == nil || e.Code != int32(tt.code) || e.DecisionId != tt.o.DecisionId {
				t.Fatalf("got %v, want code %s", e, tt.code)
			}
		})
	}
	if f.pending() != 1 {
		t.Fatalf("bad outcomes touched the reservation: %d pending", f.pending())
	}
	f.report(d.DecisionId, true, okKind, 1100)
	f.checkLedger()
	if f.pending() != 0 {
		t.Fatal("reservation not released")
	}
	e := f.s.Handle(outcome(d.DecisionId, true, okKind, 1100)).GetError()
	if e == nil || e.Code != int32(codes.FailedPrecondition) {
		t.Fatalf("second outcome: %v", e)
	}
	e = f.s.Handle(outcome(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)).GetError()
	if e == nil || e.Code != int32(codes.FailedPrecondition) {
		t.Fatalf("third outcome: %v", e)
	}
	rec := f.session("s")
	if rec.Generation != 1 || len(rec.DRejects) != 0 {
		t.Errorf("a duplicate outcome changed the session: %v", rec)
	}
	f.checkLedger()
}

func TestSessionLifecycle(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	f.c.UpdateWorker("p1", func(w *kvcv1.Worker) { w.Load.SnapshotBytesUsed = 1 << 20 })
	// Turn 0: new session -> SEED.
	d := f.decide("s", 0, 4000, 200)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || d.Reason != kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION ||
		d.Prefill == nil || d.Decode == nil || d.BootstrapRoom == 0 || d.ReservedTokens != 4200 ||
		d.PrefillPriority != policy.PrefillPriorityLow || d.Epoch != 1 || d.Turn != 0 {
		t.Fatalf("seed: %v", d)
	}
	seedD := d.Decode.WorkerId
	if d.BootstrapRoom <= 0 || d.BootstrapRoom > 1<<53 {
		t.Errorf("room %d not in (0, 2^53]", d.BootstrapRoom)
	}
	if d.Decode.PeerAddr != seedD+":7000" || d.Decode.TransferEndpoint != seedD+":7001" || d.Decode.WorkerUrl != "http://"+seedD {
		t.Errorf("worker ref %v", d.Decode)
	}
	f.report(d.DecisionId, true, okKind, 4150)
	rec := f.session("s")
	if rec.DecodeWorker != seedD || rec.KvCommittedLen != 4150 || rec.Generation != 1 || rec.Migrations != 0 {
		t.Fatalf("after seed: %v", rec)
	}
	cmds := f.c.Commands(seedD)
	if len(cmds) != 1 || cmds[0].GetSetSnapshotTarget().GetPrefillWorkerId() != "p2" ||
		cmds[0].GetSetSnapshotTarget().GetGeneration() != 1 || cmds[0].GetSetSnapshotTarget().GetPeerAddr() != "p2:7000" ||
		cmds[0].GetSetSnapshotTarget().GetValidBaseLen() != 0 {
		t.Fatalf("snapshot target: %v", cmds)
	}
	// Turn 1: small append -> DIRECT_TO_D (turn counted by the control plane).
	d = f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "t1", SessionId: "s", InputTokens: 4500, MaxOutputTokens: 200}}}).GetDecision()
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.WorkerId != seedD || d.CachedTokens != 4150 ||
		d.ReservedTokens != 550 || d.Prefill != nil || d.BootstrapRoom != 0 || d.Turn != 1 {
		t.Fatalf("direct: %v", d)
	}
	f.report(d.DecisionId, true, okKind, 4700)
	if rec = f.session("s"); rec.KvCommittedLen != 4700 || rec.Turn != 1 {
		t.Fatalf("after direct: %v", rec)
	}
	// Turn 2: append over the limit -> PD_FALLBACK / REAL_LARGE_APPEND onto the session's own D,
	// which keeps the received KV as the session's: kv_committed_len catches up. (With local
	// large appends on, the idle D would prefill it itself: TestDecideEveryModeAndReason.)
	if err := f.c.SetPolicy(&kvcv1.Policy{LocalAppendMaxTokens: proto.Int64(0)}); err != nil {
		t.Fatal(err)
	}
	d = f.decide("s", 2, 4700+9000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Reason != kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND ||
		d.PrefillPriority != policy.PrefillPriorityLow || d.BootstrapRoom == 0 || d.Prefill == nil ||
		d.Decode.GetWorkerId() != seedD || d.ReservedTokens != 9_100 {
		t.Fatalf("large append: %v", d)
	}
	f.report(d.DecisionId, true, okKind, 13_800)
	if rec = f.session("s"); rec.DecodeWorker != seedD || rec.KvCommittedLen != 13_800 || rec.Generation != 1 {
		t.Fatalf("after the large append: %v", rec)
	}
	if c := f.c.Commands(seedD); len(c) != 1 {
		t.Errorf("a large append on the same D sends no command: %v", c)
	}
	// Turn 3: the next small append goes direct again, against the new length.
	d = f.decide("s", 3, 14_000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != seedD || d.CachedTokens != 13_800 ||
		d.ReservedTokens != 300 {
		t.Fatalf("after a large append the session must go direct again: %v", d)
	}
	f.report(d.DecisionId, true, okKind, 14_100)
	// The D releases the session; p2 holds a snapshot (what state does on RELEASED and
	// SNAPSHOT_INGESTED events).
	f.c.UpdateSession("s", func(r *kvcv1.SessionRecord) {
		r.PreviousDecodeWorker = r.DecodeWorker
		r.DecodeWorker = ""
		r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p2", Seqlen: 14_100, Generation: 1, UpdatedUnixMs: f.now.UnixMilli()}
	})
	f.c.UpdateWorker(seedD, func(w *kvcv1.Worker) { w.Load.UsedTokens = 199_000 }) // and it is full now
	d = f.decide("s", 4, 14_100+2000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT ||
		d.Prefill.WorkerId != "p2" || d.SnapshotSeqlen != 14_100 || d.SnapshotGeneration != 1 || d.CachedTokens != 14_100 {
		t.Fatalf("reseed: %v", d)
	}
	newD := d.Decode.WorkerId
	if newD == seedD {
		t.Fatalf("reseed onto the full D %s", newD)
	}
	push := f.c.Commands("p2")
	if len(push) != 1 {
		t.Fatalf("p2 commands: %v", push)
	}
	ps := push[0].GetPushSnapshot()
	if ps.GetSessionId() != "s" || ps.GetDecodeWorkerId() != newD || ps.GetDecodePeerAddr() != newD+":7000" ||
		ps.GetDecodeTransferEndpoint() != newD+":7001" || ps.GetRoom() != d.BootstrapRoom || ps.GetDecisionId() != d.DecisionId ||
		ps.GetSeqlen() != 14_100 || ps.GetGeneration() != 1 {
		t.Fatalf("push_snapshot: %v", ps)
	}
	// A second query of the same session while the reseed is in flight does not race it.
	d2 := f.decide("s", 4, 14_100+2000, 100)
	if d2.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d2.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT {
		t.Fatalf("concurrent reseed: %v", d2)
	}
	f.report(d2.DecisionId, true, okKind, 0)
	f.report(d.DecisionId, true, okKind, 16_200)
	rec = f.session("s")
	if rec.DecodeWorker != newD || rec.Generation != 2 || rec.Migrations != 1 || rec.PreviousDecodeWorker != seedD || rec.KvCommittedLen != 16_200 {
		t.Fatalf("after reseed: %v", rec)
	}
	if c := f.c.Commands(seedD); len(c) != 2 || c[1].GetReleaseSession().GetSessionId() != "s" {
		t.Errorf("old D not told to release: %v", c)
	}
	if c := f.c.Commands(newD); len(c) != 1 || c[0].GetSetSnapshotTarget().GetPrefillWorkerId() != "p2" || c[0].GetSetSnapshotTarget().GetGeneration() != 2 {
		t.Errorf("new D's snapshot target (should stay with the holder p2): %v", c)
	} else if st := c[0].GetSetSnapshotTarget(); st.GetValidBaseLen() != 14_100 || st.GetBaseGeneration() != 1 {
		// the reseed wrote p2's generation-1 snapshot [0, 14,100) into newD: the next push appends
		t.Errorf("new D's target without the reseed's valid base: %v", st)
	}
	if got := testutil.ToFloat64(f.s.m.migrations); got != 1 {
		t.Errorf("migrations metric %v", got)
	}
	for _, mr := range []struct {
		mode, reason string
		n            float64
	}{{"SEED", "NEW_SESSION", 1}, {"DIRECT_TO_D", "SESSION_RESIDENT", 2}, {"PD_FALLBACK", "REAL_LARGE_APPEND", 1},
		{"RESEED_SNAPSHOT", "SNAPSHOT_HIT", 1}, {"PD_FALLBACK", "SESSION_NOT_RESIDENT", 1}} {
		if got := testutil.ToFloat64(f.s.m.decisions.WithLabelValues(mr.mode, mr.reason)); got != mr.n {
			t.Errorf("decisions{%s,%s} = %v, want %v", mr.mode, mr.reason, got, mr.n)
		}
	}
	f.checkLedger()
	if f.pending() != 0 {
		t.Errorf("%d reservations left", f.pending())
	}
}

func TestPushSnapshotUnsendableFallsBackToPrefill(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", Generation: 1, PreviousDecodeWorker: "d1", LastSeenUnixMs: 1,
		Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 5000, Generation: 1, UpdatedUnixMs: f.now.UnixMilli()}})
	f.c.SetOffline("p1", true)
	d := f.decide("s", 4, 5500, 10)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING {
		t.Fatalf("got %s/%s", d.Mode, d.Reason)
	}
	if f.pending() != 1 {
		t.Fatalf("pending %d", f.pending())
	}
	f.checkLedger()
	if got := testutil.ToFloat64(f.s.m.commands.WithLabelValues("push_snapshot", "error")); got != 1 {
		t.Errorf("command error metric %v", got)
	}
}

func TestSnapshotFailedOutcomeDropsSnapshot(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", Generation: 1, LastSeenUnixMs: 1,
		Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 5000, Generation: 1, UpdatedUnixMs: f.now.UnixMilli()}})
	d := f.decide("s", 4, 5500, 10)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
		t.Fatalf("got %s", d.Mode)
	}
	f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SNAPSHOT_FAILED, 0)
	if d = f.decide("s", 5, 5500, 10); d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING {
		t.Fatalf("after a failed snapshot: %s/%s", d.Mode, d.Reason)
	}
}

func TestGatewayFallbackDoesNotMakeResident(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 1000, 10)
	resp := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
		DecisionId: d.DecisionId, Success: true, ExecutedMode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK}}})
	if resp.GetOutcomeAck() == nil {
		t.Fatal(resp)
	}
	if rec := f.session("s"); rec.DecodeWorker != "" || rec.Generation != 0 {
		t.Fatalf("resident after a fallback execution: %v", rec)
	}
}

func TestReservationExpiry(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	a := f.decide("a", 0, 1000, 10)
	f.now = f.now.Add(time.Second)
	b := f.decide("b", 0, 1000, 10)
	timeout := time.Duration(policy.DefaultReservationTimeoutMs) * time.Millisecond
	if n := f.s.expire(f.now.Add(timeout - 2*time.Second)); n != 0 {
		t.Fatalf("expired %d early", n)
	}
	if n := f.s.expire(f.now.Add(timeout - time.Second)); n != 1 {
		t.Fatalf("expired %d, want 1", n)
	}
	f.checkLedger()
	// A late outcome still applies (late.go); once only.
	if ack := f.s.Handle(outcome(a.DecisionId, true, okKind, 0)).GetOutcomeAck(); ack == nil {
		t.Fatal("outcome after expiry not acknowledged")
	}
	f.checkLedger()
	if e := f.s.Handle(outcome(a.DecisionId, true, okKind, 0)).GetError(); e == nil || e.Code != int32(codes.FailedPrecondition) {
		t.Fatalf("second outcome after expiry: %v", e)
	}
	f.report(b.DecisionId, true, okKind, 0)
	if f.pending() != 0 || testutil.ToFloat64(f.s.m.expired) != 1 {
		t.Fatalf("pending %d expired %v", f.pending(), testutil.ToFloat64(f.s.m.expired))
	}
	// A hot-reloaded timeout applies to new reservations.
	if err := f.c.SetPolicy(&kvcv1.Policy{ReservationTimeoutMs: proto.Int64(1000)}); err != nil {
		t.Fatal(err)
	}
	f.decide("c", 0, 1000, 10)
	if n := f.s.expire(f.now.Add(time.Second)); n != 1 {
		t.Fatalf("expired %d with the new timeout", n)
	}
	f.checkLedger()
}

func TestPolicyHotReload(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	if err := f.c.SetPolicy(&kvcv1.Policy{KvCentricEnabled: proto.Bool(false)}); err != nil {
		t.Fatal(err)
	}
	if d := f.decide("a", 0, 1000, 10); d.Reason != kvcv1.RouteReason_ROUTE_REASON_KV_CENTRIC_DISABLED {
		t.Fatalf("got %s", d.Reason)
	}
	if err := f.c.SetPolicy(&kvcv1.Policy{KvCentricEnabled: proto.Bool(true), SeedMinTurn: proto.Int32(2)}); err != nil {
		t.Fatal(err)
	}
	if d := f.decide("b", 0, 1000, 10); d.Reason != kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_EARLY_TURN {
		t.Fatalf("got %s", d.Reason)
	}
	// The control plane counts turns for clients that do not: third query of b is turn 2.
	f.decide("b", 0, 1100, 10)
	if d := f.decide("b", 0, 1200, 10); d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || d.Turn != 2 {
		t.Fatalf("turn 2: %s turn %d", d.Mode, d.Turn)
	}
}

func TestNotLeading(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	f.c.SetEpoch(0)
	d := f.decide("a", 0, 1000, 10)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Reason != kvcv1.RouteReason_ROUTE_REASON_CONTROL_PLANE_UNAVAILABLE {
		t.Fatalf("got %s/%s", d.Mode, d.Reason)
	}
	if _, ok := f.c.Session("a"); ok {
		t.Fatal("a non-leader wrote a session")
	}
	f.report(d.DecisionId, true, okKind, 0)
}

// sharedCluster: many Ds for concurrency tests.
func manyDecode(n int, capacity int64) []*kvcv1.Worker {
	ws := []*kvcv1.Worker{routertest.Prefill("p1"), routertest.Prefill("p2")}
	for i := range n {
		ws = append(ws, routertest.Decode(fmt.Sprintf("d%d", i), capacity, 0))
	}
	return ws
}

// Concurrent decisions cannot over-admit a D: 64 goroutines race for one D's tokens.
func TestConcurrentDecisionsDoNotOverAdmit(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d0", 100_000, 0))
	if err := f.c.SetPolicy(&kvcv1.Policy{DCapacityHeadroom: proto.Float64(0), MaxConcurrentTransfers: proto.Int32(0)}); err != nil {
		t.Fatal(err)
	}
	const goroutines, each = 64, 20
	var mu sync.Mutex
	var seeds []*kvcv1.RouteDecision
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				resp := f.s.Handle(query(fmt.Sprintf("s-%d-%d", g, i), 0, 900, 100))
				d := resp.GetDecision()
				if d == nil {
					t.Errorf("no decision: %v", resp)
					return
				}
				if d.Mode == kvcv1.RouteMode_ROUTE_MODE_SEED {
					mu.Lock()
					seeds = append(seeds, d)
					mu.Unlock()
				} else if d.Reason != kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY {
					t.Errorf("unexpected %s/%s", d.Mode, d.Reason)
				}
			}
		}()
	}
	wg.Wait()
	var reserved int64
	for _, d := range seeds {
		reserved += d.ReservedTokens
	}
	if len(seeds) != 100 || reserved != 100_000 {
		t.Fatalf("admitted %d seeds reserving %d tokens; capacity fits exactly 100 (100000 tokens)", len(seeds), reserved)
	}
	f.checkLedger()
	// Outcomes from many goroutines release everything exactly once.
	for i, d := range seeds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f.s.Handle(outcome(d.DecisionId, i%2 == 0, map[bool]kvcv1.RouteErrorKind{true: okKind, false: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT}[i%2 == 0], 0))
			f.s.Handle(outcome(d.DecisionId, true, okKind, 0)) // duplicate: must not release twice
		}()
	}
	wg.Wait()
	f.checkLedger()
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	// Only the fallbacks (never reported here) still hold what they reserved on d0: a refused
	// seed's fallback keeps the session there, so its pages count (input + max_output) and it
	// holds the session's transfer; it is no plain P/D request. Its pages are a new session's
	// (Reserved.NewSession: the new-session bound is off here).
	n := int64(goroutines*each - 100)
	if w := f.s.led.workers["d0"]; w == nil || w.held() != (policy.Reserved{Tokens: n * 1000, Transfers: int32(n), NewSession: n * 1000}) || f.s.led.heldTokens != n*1000 || f.s.led.pending.len() != int(n) {
		t.Fatalf("left over: %+v %d %d", f.s.led.workers["d0"], f.s.led.heldTokens, f.s.led.pending.len())
	}
}

// Regression: a fallback names a D but reserves nothing there; releasing it after the D's last
// real reservation is gone must not touch the (deleted) per-worker entry.
func TestFallbackOutcomeAfterDirectOutcome(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 200_000, 0))
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d1", KvCommittedLen: 1000, Generation: 1, LastSeenUnixMs: 1})
	direct := f.decide("s", 1, 1500, 10)
	if err := f.c.SetPolicy(&kvcv1.Policy{KvCentricEnabled: proto.Bool(false)}); err != nil {
		t.Fatal(err)
	}
	fb := f.decide("t", 2, 1500, 10)
	if direct.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || fb.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || fb.Decode.GetWorkerId() != "d1" {
		t.Fatalf("setup: %s %s", direct.Mode, fb.Mode)
	}
	f.report(direct.DecisionId, true, okKind, 0)
	f.checkLedger()
	f.report(fb.DecisionId, true, okKind, 0)
	f.checkLedger()
}

func TestLeadershipChangeDropsReservations(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("a", 0, 1000, 10)
	f.s.OnLeadershipChange(false)
	if f.pending() != 0 {
		t.Fatal("reservations kept across a term")
	}
	f.checkLedger()
	if e := f.s.Handle(outcome(d.DecisionId, true, okKind, 0)).GetError(); e.GetCode() != int32(codes.FailedPrecondition) {
		t.Fatalf("outcome of a dropped decision: %v", e)
	}
	f.s.OnLeadershipChange(true)
	if d2 := f.decide("b", 0, 1000, 10); d2.DecisionId == d.DecisionId {
		t.Fatal("decision id reused")
	}
}

// A large append is a PD_FALLBACK onto the session's own D: a rejection by D counts like one
// of a direct turn, a success catches kv_committed_len up (so every later turn is measured
// against the new length and goes direct), and an outcome for a residency the session has
// meanwhile left changes nothing.
func TestLargeAppendOutcomes(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	if err := f.c.SetPolicy(&kvcv1.Policy{LocalAppendMaxTokens: proto.Int64(0)}); err != nil { // the large appends P prefills
		t.Fatal(err)
	}
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d2", KvCommittedLen: 10_000, Generation: 1, LastSeenUnixMs: 1})
	large := kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND

	d := f.decide("s", 1, 20_000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Reason != large || d.Decode.GetWorkerId() != "d2" || d.ReservedTokens != 10_100 {
		t.Fatalf("large append: %v", d)
	}
	f.s.mu.Lock()
	held := f.s.led.Reserved("d2").Tokens
	f.s.mu.Unlock()
	if held != 10_100 {
		t.Errorf("reserved on d2: %d, want 10100 (the append and the output)", held)
	}
	f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)
	if rec := f.session("s"); rec.DRejects["d2"] != 1 || rec.KvCommittedLen != 10_000 {
		t.Fatalf("after a rejection: %v", rec)
	}
	if got := testutil.ToFloat64(f.s.m.rejected.WithLabelValues("d2", "d")); got != 1 {
		t.Errorf("rejected{d2,d} = %v", got)
	}

	d = f.decide("s", 1, 20_000, 100)
	f.report(d.DecisionId, true, okKind, 20_100)
	if rec := f.session("s"); rec.DecodeWorker != "d2" || rec.KvCommittedLen != 20_100 || len(rec.DRejects) != 0 || rec.Generation != 1 {
		t.Fatalf("after a large append: %v", rec)
	}
	for turn := int32(2); turn < 6; turn++ {
		in := 20_100 + int64(turn)*300
		d = f.decide("s", turn, in, 10)
		if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != "d2" {
			t.Fatalf("turn %d after the large append: %v", turn, d)
		}
		f.report(d.DecisionId, true, okKind, in+10)
	}

	// A large append whose session moves before its outcome arrives.
	d = f.decide("s", 6, 40_000, 100)
	if d.Reason != large {
		t.Fatalf("second large append: %v", d)
	}
	f.c.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.DecodeWorker, r.PreviousDecodeWorker = "", "d2" })
	before := f.session("s").KvCommittedLen
	f.s.Handle(outcome(d.DecisionId, true, okKind, 40_100)) // no commit: d2 does not hold it
	if rec := f.session("s"); rec.DecodeWorker != "" || rec.KvCommittedLen != before {
		t.Fatalf("an outcome for a left residency changed the session: %v", rec)
	}
	if c := f.c.Commands("d2"); len(c) != 0 {
		t.Errorf("large appends on the same D send no command: %v", c)
	}
	f.checkLedger()
	if f.pending() != 0 {
		t.Errorf("%d reservations left", f.pending())
	}
}

// TestSessionNotResidentOutcome: D answered that it no longer holds the session (it evicted it
// before the control plane heard): the residency is dropped at once and the retry reseeds from
// the snapshot; a report against a generation that has moved on changes nothing.
func TestSessionNotResidentOutcome(t *testing.T) {
	tests := []struct {
		name        string
		reseedFirst bool // the session was reseeded (new generation) before the report arrived
		wantMode    kvcv1.RouteMode
	}{
		{"drops residency, retry reseeds", false, kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT},
		{"stale report keeps the newer residency", true, kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, basicCluster()...)
			f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d1", KvCommittedLen: 5000, Generation: 3, Turn: 4, LastSeenUnixMs: 1,
				Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 5000, Generation: 3, UpdatedUnixMs: f.now.UnixMilli()}})
			d := f.decide("s", 5, 5200, 10)
			if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != "d1" {
				t.Fatalf("first decision: %s on %s", d.Mode, d.Decode.GetWorkerId())
			}
			if tt.reseedFirst {
				f.c.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Generation = 4 })
			}
			f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_SESSION_NOT_RESIDENT, 0)
			rec := f.session("s")
			if tt.reseedFirst {
				if rec.DecodeWorker != "d1" {
					t.Fatalf("a stale report dropped the newer residency: %v", rec)
				}
			} else if rec.DecodeWorker != "" || rec.PreviousDecodeWorker != "d1" || len(rec.DRejects) != 0 {
				t.Fatalf("after SESSION_NOT_RESIDENT: %v", rec)
			}
			d = f.decide("s", 5, 5200, 10)
			if d.Mode != tt.wantMode {
				t.Fatalf("retry: %s/%s, want %s", d.Mode, d.Reason, tt.wantMode)
			}
			if got := testutil.ToFloat64(f.s.m.rejected.WithLabelValues("d1", "not_resident")); got != 1 {
				t.Fatalf("not_resident rejections %v", got)
			}
			f.checkLedger()
		})
	}
}

// TestHandleAckInTheDecisionsBlock: Handle answers a decision and, later, its outcome from one
// block (the ack's memory is the decision's answer's); the decision the caller keeps is
// unchanged by the outcome, each outcome gets its own ack, and an outcome through a Route
// stream's pooled path, or of a decision a stream answered, still gets one.
func TestHandleAckInTheDecisionsBlock(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	var decs []*kvcv1.RouteDecision
	var ids []string
	for i := range 3 {
		d := f.decide(fmt.Sprintf("s-ack-%d", i), 0, 1_000, 50)
		decs, ids = append(decs, d), append(ids, strings.Clone(d.DecisionId))
	}
	snap := proto.Clone(decs[0]).(*kvcv1.RouteDecision)
	ack0 := f.s.Handle(outcome(ids[0], true, okKind, 1_050)).GetOutcomeAck()
	ack1 := f.s.Handle(outcome(ids[1], true, okKind, 1_050)).GetOutcomeAck()
	if ack0.GetDecisionId() != ids[0] || ack1.GetDecisionId() != ids[1] || ack0 == ack1 {
		t.Fatalf("acks %v %v for %s %s", ack0, ack1, ids[0], ids[1])
	}
	if !proto.Equal(decs[0], snap) {
		t.Fatalf("the decision changed with its outcome: %v, was %v", decs[0], snap)
	}
	// The third decision's outcome through the stream's path (a pooled ack).
	resp, m := f.s.handle(outcome(ids[2], true, okKind, 1_050), true)
	if resp.GetOutcomeAck().GetDecisionId() != ids[2] || m == nil {
		t.Fatalf("pooled outcome: %v", resp)
	}
	m.recycle()
	// A decision answered on the stream's path, its outcome through Handle.
	resp, m = f.s.handle(query("s-ack-pooled", 0, 1_000, 50), true)
	id := strings.Clone(resp.GetDecision().GetDecisionId())
	m.recycle()
	if got := f.s.Handle(outcome(id, true, okKind, 1_050)).GetOutcomeAck().GetDecisionId(); got != id {
		t.Fatalf("outcome of a stream's decision through Handle: ack for %q, want %q", got, id)
	}
}

// TestReservationsReusedAcrossGoroutines: decisions and outcomes from several goroutines at once
// hand their reservations back and take them again (Service.freed, pushed without the lock,
// taken under it); every outcome is acknowledged for its own decision, nothing stays pending and
// the ledger adds up (run under -race).
func TestReservationsReusedAcrossGoroutines(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	const workers, each = 4, 300
	var wg sync.WaitGroup
	errs := make(chan string, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				d := f.s.Handle(query(fmt.Sprintf("s-%d-%d", w, i%7), 0, 1_000, 10)).GetDecision()
				if d == nil {
					errs <- "no decision"
					return
				}
				id := strings.Clone(d.DecisionId)
				if got := f.s.Handle(outcome(id, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_TIMEOUT, 0)).GetOutcomeAck().GetDecisionId(); got != id {
					errs <- fmt.Sprintf("outcome of %s acknowledged as %q", id, got)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	if n := f.pending(); n != 0 {
		t.Fatalf("%d reservations pending after every outcome", n)
	}
	f.checkLedger()
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	free := 0
	for r := f.s.spare; r != nil; r = r.nextFree {
		free++
	}
	for r := f.s.freed.Load(); r != nil; r = r.nextFree {
		free++
	}
	if free == 0 || free > workers {
		t.Fatalf("%d reservations free for reuse after %d decisions of %d goroutines, want 1..%d", free, workers*each, workers, workers)
	}
}
