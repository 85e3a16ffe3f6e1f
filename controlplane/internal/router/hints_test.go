package router

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func (f *fixture) decideHinted(session string, turn int32, input, out, pinMs int64, low bool) *kvcv1.RouteDecision {
	f.t.Helper()
	resp := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "h", SessionId: session, Turn: turn, InputTokens: input, MaxOutputTokens: out, MultiturnHint: true,
		PinMs: pinMs, LowPriority: low,
	}}})
	d := resp.GetDecision()
	if d == nil {
		f.t.Fatalf("query %s/%d: %v", session, turn, resp)
	}
	return d
}

func lastTarget(t *testing.T, c *routertest.Cluster, worker string) *kvcv1.SetSnapshotTargetCommand {
	t.Helper()
	cmds := c.Commands(worker)
	for i := len(cmds) - 1; i >= 0; i-- {
		if tg := cmds[i].GetSetSnapshotTarget(); tg != nil {
			return tg
		}
	}
	t.Fatalf("no snapshot target on %s: %v", worker, cmds)
	return nil
}

func lastHints(t *testing.T, c *routertest.Cluster, worker string) *kvcv1.SetSessionHintsCommand {
	t.Helper()
	cmds := c.Commands(worker)
	if len(cmds) == 0 || cmds[len(cmds)-1].GetSetSessionHints() == nil {
		t.Fatalf("no session hints last on %s: %v", worker, cmds)
	}
	return cmds[len(cmds)-1].GetSetSessionHints()
}

// TestAgentPin: a pin is granted when the turn's outcome leaves the session resident, reaches
// the decode sidecar on its own command after the snapshot target, keeps the session from migrating after
// rejections until it expires, and is clamped to max_pin_ms; the low-priority hint reaches the
// sidecar and the prefill priority; a session end drops the pin.
func TestAgentPin(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 100_000, 0), routertest.Decode("d2", 100_000, 50_000))
	start := f.now
	// Turn 0: seed onto d1 (the emptier), pinned 30 s, low priority.
	d := f.decideHinted("a", 0, 4000, 100, 30_000, true)
	if d.Decode.GetWorkerId() != "d1" || d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("seed: %v", d)
	}
	if rec := f.session("a"); rec.PinnedUntilUnixMs != 0 || !rec.LowPriority {
		t.Fatalf("before the outcome: %v (the pin starts after the answer)", rec)
	}
	f.now = f.now.Add(2 * time.Second) // the answer takes 2 s
	f.report(d.DecisionId, true, okKind, 4050)
	wantUntil := start.Add(32 * time.Second).UnixMilli()
	if rec := f.session("a"); rec.PinnedUntilUnixMs != wantUntil || !rec.LowPriority {
		t.Fatalf("after the outcome: %v, want pinned until %d", rec, wantUntil)
	}
	if tg := lastTarget(t, f.c, "d1"); tg.GetPinnedUntilUnixMs() != 0 || tg.GetLowPriority() || tg.GetGeneration() != 1 {
		t.Fatalf("target %v: want generation 1 without hints", tg)
	}
	if h := lastHints(t, f.c, "d1"); h.GetSessionId() != "a" || h.GetPinnedUntilUnixMs() != wantUntil || !h.GetLowPriority() {
		t.Fatalf("hints %v", h)
	}
	// Three rejections by d1 (turns without hints: the pin set earlier holds; the priority
	// goes back to normal).
	for i := range 3 {
		d = f.decideHinted("a", int32(1+i), 4200, 100, 0, false)
		if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
			t.Fatalf("turn %d: %v", 1+i, d)
		}
		f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)
	}
	if rec := f.session("a"); rec.DRejects["d1"] != 3 || rec.LowPriority {
		t.Fatalf("after the rejections: %v", rec)
	}
	// Pinned: served in place, not migrated.
	d = f.decideHinted("a", 4, 4200, 100, 0, false)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != "d1" {
		t.Fatalf("pinned session moved: %v", d)
	}
	f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)
	// The pin expires: the next turn migrates.
	f.now = start.Add(33 * time.Second)
	d = f.decideHinted("a", 5, 4200, 100, 0, false)
	if d.Reason != kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS || d.Decode.GetWorkerId() != "d2" {
		t.Fatalf("after the pin: %v", d)
	}
	f.report(d.DecisionId, true, okKind, 4300)

	// A pin longer than max_pin_ms (10 min) is clamped to it; the extended turn sends the pin
	// and the priority, and no target (the sidecar's stays as it is).
	n := len(f.c.Commands("d2"))
	d = f.decideHinted("a", 6, 4400, 100, 3_600_000, true)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != "d2" {
		t.Fatalf("turn 6: %v", d)
	}
	f.report(d.DecisionId, true, okKind, 4500)
	want := f.now.Add(10 * time.Minute).UnixMilli()
	if rec := f.session("a"); rec.PinnedUntilUnixMs != want {
		t.Fatalf("clamped pin: until %d, want %d", rec.PinnedUntilUnixMs, want)
	}
	cmds := f.c.Commands("d2")
	if len(cmds) != n+1 {
		t.Fatalf("commands to d2 %v, want one more (the hints)", cmds)
	}
	if h := cmds[n].GetSetSessionHints(); h.GetPinnedUntilUnixMs() != want || !h.GetLowPriority() {
		t.Fatalf("hints %v", cmds[n])
	}
	// A turn that changes nothing sends nothing.
	d = f.decideHinted("a", 7, 4600, 100, 0, true)
	f.report(d.DecisionId, true, okKind, 4700)
	if c := f.c.Commands("d2"); len(c) != n+1 {
		t.Fatalf("a turn without new hints sent %v", c[n+1:])
	}
	if g, c := testutil.ToFloat64(f.s.m.pins.WithLabelValues("granted")), testutil.ToFloat64(f.s.m.pins.WithLabelValues("clamped")); g != 1 || c != 1 {
		t.Fatalf("pins granted %v clamped %v", g, c)
	}
	// The session ends: its pin leaves the table.
	if e := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{SessionId: "a", EndSession: true}}}); e.GetDecision() == nil {
		t.Fatal(e)
	}
	f.s.mu.Lock()
	_, still := f.s.pins["a"]
	f.s.mu.Unlock()
	if still {
		t.Fatal("pin kept after the session end")
	}
}

// TestAgentPinShare: pins past max_pinned_share of a decode worker's capacity are refused (the
// turn is served, unpinned); an expired pin no longer counts.
func TestAgentPinShare(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 100_000, 0))
	if err := f.c.SetPolicy(&kvcv1.Policy{MaxPinnedShare: proto.Float64(0.1)}); err != nil { // 10 000 tokens
		t.Fatal(err)
	}
	seed := func(id string, kv, pinMs int64) *kvcv1.SessionRecord {
		t.Helper()
		d := f.decideHinted(id, 0, kv, 10, pinMs, false)
		f.report(d.DecisionId, true, okKind, kv)
		return f.session(id)
	}
	if rec := seed("a", 6000, 60_000); rec.PinnedUntilUnixMs == 0 {
		t.Fatalf("a: %v", rec)
	}
	if rec := seed("b", 4000, 60_000); rec.PinnedUntilUnixMs == 0 {
		t.Fatalf("b (exactly at the share): %v", rec)
	}
	if rec := seed("c", 100, 60_000); rec.PinnedUntilUnixMs != 0 || rec.DecodeWorker != "d1" {
		t.Fatalf("c past the share: %v, want served unpinned", rec)
	}
	if n := testutil.ToFloat64(f.s.m.pins.WithLabelValues("refused_share")); n != 1 {
		t.Fatalf("refused_share %v", n)
	}
	f.now = f.now.Add(61 * time.Second) // a's and b's pins are over
	if rec := seed("e", 9000, 1000); rec.PinnedUntilUnixMs != f.now.Add(time.Second).UnixMilli() {
		t.Fatalf("e after the pins expired: %v", rec)
	}
	// Pins off.
	if err := f.c.SetPolicy(&kvcv1.Policy{MaxPinMs: proto.Int64(0)}); err != nil {
		t.Fatal(err)
	}
	if rec := seed("g", 10, 1000); rec.PinnedUntilUnixMs != 0 {
		t.Fatalf("pins off: %v", rec)
	}
	// Bad pins never reach the policy.
	for _, q := range []*kvcv1.RouteQuery{
		{SessionId: "x", InputTokens: 10, PinMs: -1},
		{SessionId: "x", InputTokens: 10, PinMs: 24*3600*1000 + 1},
		{SessionId: "x", EndSession: true, PinMs: 5},
	} {
		e := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: q}}).GetError()
		if e == nil || e.Code != int32(codes.InvalidArgument) || !strings.Contains(e.Message, "pin_ms") {
			t.Errorf("%v: %v", q, e)
		}
	}
}

// TestAgentHintsLeaveTheTarget: the hints of a session whose snapshot has not landed yet go
// out on their own command, which names no target: the sidecar keeps the target this leader
// named at its seed, not the store that is emptiest now (that would move the snapshot: a full
// push).
func TestAgentHintsLeaveTheTarget(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Prefill("p2"), routertest.Decode("d1", 100_000, 0))
	f.c.UpdateWorker("p2", func(w *kvcv1.Worker) { w.Load.SnapshotBytesUsed = 1 << 20 })
	d := f.decideHinted("a", 0, 4000, 100, 0, false)
	f.report(d.DecisionId, true, okKind, 4100)
	if tg := lastTarget(t, f.c, "d1"); tg.GetPrefillWorkerId() != "p1" {
		t.Fatalf("seed target %v", tg)
	}
	n := len(f.c.Commands("d1"))
	// p1 fills up: the emptiest store is p2 now.
	f.c.UpdateWorker("p1", func(w *kvcv1.Worker) { w.Load.SnapshotBytesUsed = 1 << 29 })
	d = f.decideHinted("a", 1, 4200, 100, 60_000, true)
	f.report(d.DecisionId, true, okKind, 4300)
	if f.session("a").GetSnapshot() != nil {
		t.Fatal("the test wants a session without a landed snapshot")
	}
	cmds := f.c.Commands("d1")
	if len(cmds) != n+1 || cmds[n].GetSetSessionHints().GetPinnedUntilUnixMs() == 0 || !cmds[n].GetSetSessionHints().GetLowPriority() {
		t.Fatalf("after the hinted turn %v: want one hints command with the pin", cmds[n:])
	}
}
