package state

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	"github.com/kvcentric/kvcentric/pkg/launch"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type fixture struct {
	st    *State
	store *kvstore.Store
	term  *Term
	sess  *concurrency.Session
}

func newFixture(t testing.TB, cfg Config) *fixture {
	t.Helper()
	c := etcdtest.Start(t)
	cli := c.Client(t)
	store, err := kvstore.New(cli)
	if err != nil {
		t.Fatal(err)
	}
	return leadOn(t, store, cfg)
}

func leadOn(t testing.TB, store *kvstore.Store, cfg Config) *fixture {
	t.Helper()
	sess, err := concurrency.NewSession(store.Client(), concurrency.WithTTL(5))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sess.Close() })
	el := concurrency.NewElection(sess, store.ElectionPrefix())
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := el.Campaign(ctx, "n"); err != nil {
		t.Fatal(err)
	}
	cfg.Store = store
	cfg.Log = zerolog.Nop()
	if cfg.NodeID == "" {
		cfg.NodeID = "cp-test"
	}
	st := New(cfg)
	term, err := st.Lead(ctx, kvstore.Fence{Key: el.Key(), Rev: el.Rev()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.EndTerm(term) })
	return &fixture{st: st, store: store, term: term, sess: sess}
}

func hello(id string, role kvcv1.WorkerRole) *kvcv1.Hello {
	return &kvcv1.Hello{WorkerId: id, Role: role, Node: "n1", KvCapacityTokens: 1000, WorkerUrl: "http://" + id}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	launch.WaitForT(t, what, 10*time.Second, 5*time.Millisecond, cond)
}

func TestSessionsPersistAndClone(t *testing.T) {
	f := newFixture(t, Config{})
	st := f.st
	if st.Epoch() == 0 || !st.Leading() {
		t.Fatal("not leading after Lead")
	}
	var seenAtCreate int64 = -1
	st.UpdateSession("s1", func(r *kvcv1.SessionRecord) {
		seenAtCreate = r.LastSeenUnixMs
		r.DecodeWorker = "d0"
		r.Turn = 3
	})
	if seenAtCreate != 0 {
		t.Fatalf("a new record has last_seen %d; the router would read it as already seen (turn 1)", seenAtCreate)
	}
	got, ok := st.Session("s1")
	if !ok || got.GetDecodeWorker() != "d0" || got.GetEpoch() != st.Epoch() || got.GetCreatedUnixMs() == 0 {
		t.Fatalf("session %v", got)
	}
	got.DecodeWorker = "mutated"
	again, _ := st.Session("s1")
	if again.GetDecodeWorker() != "d0" {
		t.Fatal("Session did not return a copy")
	}
	if err := st.Flush(t.Context()); err != nil {
		t.Fatal(err)
	}
	rec, ok, err := f.store.GetSession(t.Context(), "s1")
	if err != nil || !ok || rec.GetTurn() != 3 {
		t.Fatalf("etcd: %v %v %v", rec, ok, err)
	}
	recs, next := st.ListSessions("", 10, "d0")
	if len(recs) != 1 || next != "" {
		t.Fatalf("list by worker: %v %q", recs, next)
	}
	// A second leader (after this one ends) loads everything.
	st.EndTerm(f.term)
	if st.Leading() || st.SessionCount() != 0 {
		t.Fatal("tables kept after EndTerm")
	}
	st.UpdateSession("ignored", func(r *kvcv1.SessionRecord) {})
	if err := f.sess.Close(); err != nil {
		t.Fatal(err)
	}
	f2 := leadOn(t, f.store, Config{NodeID: "cp-2"})
	if r, ok := f2.st.Session("s1"); !ok || r.GetDecodeWorker() != "d0" {
		t.Fatalf("new leader lost s1: %v", r)
	}
	if _, ok := f2.st.Session("ignored"); ok {
		t.Fatal("a write after EndTerm was kept")
	}
}

func TestAttachDetachGrace(t *testing.T) {
	f := newFixture(t, Config{UnreachableGrace: 50 * time.Millisecond})
	st := f.st
	snapBefore := st.Workers()
	s1, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if err != nil {
		t.Fatal(err)
	}
	if len(snapBefore) != 0 {
		t.Fatal("old snapshot changed")
	}
	ws := st.Workers()
	if len(ws) != 1 || ws[0].GetState() != kvcv1.WorkerState_WORKER_STATE_READY || ws[0].GetConnectedTo() != "cp-test" {
		t.Fatalf("workers %v", ws)
	}
	if _, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE)); !errors.Is(err, ErrDuplicate) {
		t.Fatalf("duplicate: %v", err)
	}
	stale := hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE)
	stale.LastEpochSeen = st.Epoch() + 1
	if _, err := st.Attach(stale); !errors.Is(err, ErrStaleLeader) {
		t.Fatalf("stale: %v", err)
	}
	if err := st.Reconcile(s1, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
		{SessionId: "a", KvCommittedLen: 10}, {SessionId: "b", KvCommittedLen: 20},
	}}); err != nil {
		t.Fatal(err)
	}
	// Reconnect within the grace keeps residency.
	st.Detach(s1)
	if w, _ := st.Worker("d0"); w.GetState() != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE || w.GetUnreachableSinceUnixMs() == 0 {
		t.Fatalf("after detach: %v", w)
	}
	s2, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if err != nil {
		t.Fatal(err)
	}
	if err := st.ApplyLoad(s1, &kvcv1.WorkerLoad{UsedTokens: 5}); !errors.Is(err, ErrNoStream) {
		t.Fatalf("load on a replaced stream: %v", err)
	}
	if err := st.ApplyLoad(s2, &kvcv1.WorkerLoad{UsedTokens: 5}); err != nil {
		t.Fatal(err)
	}
	if w, _ := st.Worker("d0"); w.GetLoad().GetUsedTokens() != 5 {
		t.Fatal("load not applied")
	}
	// Stay away past the grace: residency dropped.
	st.Detach(s2)
	waitFor(t, "residency drop", func() bool {
		r, _ := st.Session("a")
		return r.GetDecodeWorker() == ""
	})
	r, _ := st.Session("b")
	if r.GetDecodeWorker() != "" || r.GetPreviousDecodeWorker() != "d0" {
		t.Fatalf("b after grace: %v", r)
	}
}

func TestReconcileAndEvents(t *testing.T) {
	f := newFixture(t, Config{})
	st := f.st
	d0, _ := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	d1, _ := st.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	p0, _ := st.Attach(hello("p0", kvcv1.WorkerRole_WORKER_ROLE_PREFILL))
	st.UpdateSession("x", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0" })
	st.UpdateSession("y", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0" })
	// d0 says it holds only y; d1 says it holds x (moved: of a newer generation than the
	// record's; a copy of unknown generation would predate d0's residency, TestResyncStaleCopy).
	must(t, st.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{{SessionId: "y", KvCommittedLen: 7, Generation: 2}}}))
	must(t, st.Reconcile(d1, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{{SessionId: "x", KvCommittedLen: 9, Generation: 1}}}))
	x, _ := st.Session("x")
	y, _ := st.Session("y")
	if x.GetDecodeWorker() != "d1" || x.GetKvCommittedLen() != 9 || y.GetDecodeWorker() != "d0" || y.GetGeneration() != 2 {
		t.Fatalf("x %v y %v", x, y)
	}
	if recs, _ := st.ListSessions("", 10, "d0"); len(recs) != 1 || recs[0].GetSessionId() != "y" {
		t.Fatalf("index d0: %v", recs)
	}
	must(t, st.Reconcile(p0, &kvcv1.ResidentSessions{FullSync: true, Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "x", Seqlen: 4096, Generation: 1}}}))
	x, _ = st.Session("x")
	if x.GetSnapshot().GetPrefillWorker() != "p0" || x.GetSnapshot().GetSeqlen() != 4096 {
		t.Fatalf("snapshot %v", x.GetSnapshot())
	}
	must(t, st.Reconcile(p0, &kvcv1.ResidentSessions{FullSync: true}))
	if x, _ = st.Session("x"); x.GetSnapshot() != nil {
		t.Fatal("snapshot kept after full sync without it")
	}
	for _, tc := range []struct {
		name  string
		from  *Stream
		ev    *kvcv1.SessionEvent
		check func(r *kvcv1.SessionRecord) bool
	}{
		{"commit new session makes it resident", d0, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: 100},
			func(r *kvcv1.SessionRecord) bool { return r.GetDecodeWorker() == "d0" && r.GetKvCommittedLen() == 100 }},
		{"commit from another D does not move it", d1, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: 999},
			func(r *kvcv1.SessionRecord) bool { return r.GetDecodeWorker() == "d0" && r.GetKvCommittedLen() == 100 }},
		{"release from another D is ignored", d1, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_RELEASED},
			func(r *kvcv1.SessionRecord) bool { return r.GetDecodeWorker() == "d0" }},
		{"evict clears residency", d0, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED},
			func(r *kvcv1.SessionRecord) bool {
				return r.GetDecodeWorker() == "" && r.GetPreviousDecodeWorker() == "d0"
			}},
		{"snapshot ingested", p0, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED, KvLen: 64, Generation: 3, Bytes: 1 << 20},
			func(r *kvcv1.SessionRecord) bool {
				return r.GetSnapshot().GetSeqlen() == 64 && r.GetSnapshot().GetGeneration() == 3
			}},
		{"evict of an older generation keeps the snapshot", p0, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED, Generation: 2},
			func(r *kvcv1.SessionRecord) bool { return r.GetSnapshot() != nil }},
		{"snapshot evicted", p0, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED, Generation: 3},
			func(r *kvcv1.SessionRecord) bool { return r.GetSnapshot() == nil }},
		{"transfer failed changes nothing", d0, &kvcv1.SessionEvent{SessionId: "n", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_FAILED},
			func(r *kvcv1.SessionRecord) bool { return r.GetDecodeWorker() == "" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			must(t, st.ApplyEvent(tc.from, tc.ev))
			r, ok := st.Session("n")
			if !ok || !tc.check(r) {
				t.Fatalf("record %v", r)
			}
		})
	}
}

func TestCommands(t *testing.T) {
	f := newFixture(t, Config{CommandQueue: 2})
	st := f.st
	s0, _ := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if err := st.SendCommand("nobody", &kvcv1.Command{}); !errors.Is(err, ErrNoStream) {
		t.Fatalf("no stream: %v", err)
	}
	c1 := &kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}
	c2 := &kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}
	must(t, st.SendCommand("d0", c1))
	must(t, st.SendCommand("d0", c2))
	if err := st.SendCommand("d0", &kvcv1.Command{}); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("full queue: %v", err)
	}
	if c1.GetEpoch() != st.Epoch() || c2.GetCommandId() <= c1.GetCommandId() {
		t.Fatalf("ids/epoch: %v %v", c1, c2)
	}
	got := <-s0.Queue()
	if got.GetCommand().GetCommandId() != c1.GetCommandId() {
		t.Fatal("queue order")
	}
	if !st.Ack(s0, &kvcv1.CommandAck{CommandId: c1.GetCommandId(), Ok: true}) {
		t.Fatal("ack of a sent command refused")
	}
	if st.Ack(s0, &kvcv1.CommandAck{CommandId: c1.GetCommandId(), Ok: true}) {
		t.Fatal("double ack accepted")
	}
	if st.Ack(s0, &kvcv1.CommandAck{CommandId: 999999}) {
		t.Fatal("ack of an unknown command accepted")
	}
	// Drain: persisted flag, DRAINING state, command queued.
	<-s0.Queue()
	w, err := st.Drain("d0", true)
	if err != nil || !w.GetDraining() || w.GetState() != kvcv1.WorkerState_WORKER_STATE_DRAINING {
		t.Fatalf("drain: %v %v", w, err)
	}
	if !(<-s0.Queue()).GetCommand().GetDrain().GetDraining() {
		t.Fatal("no drain command")
	}
	if _, err := st.Drain("nobody", true); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("drain unknown: %v", err)
	}
	must(t, st.Flush(t.Context()))
	pw, ok, _ := f.store.GetWorker(t.Context(), "d0")
	if !ok || !pw.GetDraining() {
		t.Fatalf("persisted worker %v", pw)
	}
}

func TestUpdatePolicy(t *testing.T) {
	f := newFixture(t, Config{SessionTTL: time.Hour})
	st := f.st
	s0, _ := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
	if st.Policy().GetSessionTtlMs() != time.Hour.Milliseconds() || st.Policy().GetDirectMaxUncachedTokens() != 8192 {
		t.Fatalf("defaults %v", st.Policy())
	}
	p, err := st.UpdatePolicy(t.Context(), &kvcv1.Policy{SeedMinTurn: proto.Int32(2), Version: 77})
	if err != nil {
		t.Fatal(err)
	}
	if p.GetSeedMinTurn() != 2 || p.GetVersion() != 1 || p.GetMigrationRejectThreshold() != 3 {
		t.Fatalf("merged %v", p)
	}
	p, err = st.UpdatePolicy(t.Context(), &kvcv1.Policy{DCapacityHeadroom: proto.Float64(0.1)})
	if err != nil || p.GetSeedMinTurn() != 2 || p.GetVersion() != 2 {
		t.Fatalf("second update %v %v", p, err)
	}
	_, err = st.UpdatePolicy(t.Context(), &kvcv1.Policy{MigrationRejectThreshold: proto.Int32(0)})
	if !errors.Is(err, ErrInvalidPolicy) || !strings.Contains(err.Error(), "migration_reject_threshold") {
		t.Fatalf("invalid update: %v", err)
	}
	if st.Policy().GetVersion() != 2 {
		t.Fatal("rejected update changed the policy")
	}
	stored, ok, _ := f.store.GetPolicy(t.Context())
	if !ok || stored.GetVersion() != 2 || stored.DirectMaxUncachedTokens != nil {
		t.Fatalf("stored overrides %v", stored)
	}
	n := 0
	for len(s0.Queue()) > 0 {
		if (<-s0.Queue()).GetCommand().GetUpdatePolicy() != nil {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("%d policy pushes, want 2", n)
	}
}

func TestValidatePolicy(t *testing.T) {
	full := DefaultPolicy(0, 0)
	if err := ValidatePolicy(full); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
	for _, tc := range []struct {
		name string
		p    *kvcv1.Policy
		want string
	}{
		{"nil", nil, "required"},
		{"negative direct", &kvcv1.Policy{DirectMaxUncachedTokens: proto.Int64(-1)}, "direct_max_uncached_tokens"},
		{"threshold 0", &kvcv1.Policy{MigrationRejectThreshold: proto.Int32(0)}, "migration_reject_threshold"},
		{"headroom 1", &kvcv1.Policy{DCapacityHeadroom: proto.Float64(1)}, "d_capacity_headroom"},
		{"headroom negative", &kvcv1.Policy{DCapacityHeadroom: proto.Float64(-0.1)}, "d_capacity_headroom"},
		{"delta 0", &kvcv1.Policy{SnapshotDeltaTokens: proto.Int64(0)}, "snapshot_delta_tokens"},
		{"ttl tiny", &kvcv1.Policy{SessionTtlMs: proto.Int64(5)}, "session_ttl_ms"},
		{"bad worker key", &kvcv1.Policy{MaxConcurrentTransfersPerWorker: map[string]int32{"a/b": 1}}, "forbidden"},
		{"negative grace", &kvcv1.Policy{UnreachableGraceMs: proto.Int64(-1)}, "unreachable_grace_ms"},
		{"ok partial", &kvcv1.Policy{SeedMinTurn: proto.Int32(1)}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidatePolicy(tc.p)
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want mention of %q", err, tc.want)
			}
		})
	}
	m := MergePolicyUpdate(&kvcv1.Policy{MaxConcurrentTransfersPerWorker: map[string]int32{"a": 1, "b": 2}},
		&kvcv1.Policy{MaxConcurrentTransfersPerWorker: map[string]int32{"a": -1, "c": 3}})
	if len(m.MaxConcurrentTransfersPerWorker) != 2 || m.MaxConcurrentTransfersPerWorker["c"] != 3 {
		t.Fatalf("per-worker merge %v", m.MaxConcurrentTransfersPerWorker)
	}
}

func TestExpireIdle(t *testing.T) {
	f := newFixture(t, Config{SessionTTL: time.Minute})
	st := f.st
	now := time.Now()
	st.UpdateSession("old", func(r *kvcv1.SessionRecord) {
		r.LastSeenUnixMs = now.Add(-2 * time.Minute).UnixMilli()
		r.DecodeWorker = "d0"
	})
	st.UpdateSession("new", func(r *kvcv1.SessionRecord) { r.LastSeenUnixMs = now.UnixMilli() })
	if n := st.ExpireIdle(now); n != 1 {
		t.Fatalf("expired %d", n)
	}
	if _, ok := st.Session("old"); ok {
		t.Fatal("old kept")
	}
	if recs, _ := st.ListSessions("", 10, "d0"); len(recs) != 0 {
		t.Fatal("index kept an expired session")
	}
	must(t, st.Flush(t.Context()))
	if _, ok, _ := f.store.GetSession(t.Context(), "old"); ok {
		t.Fatal("expired session still in etcd")
	}
}

func TestListSessionsPaging(t *testing.T) {
	f := newFixture(t, Config{})
	for i := range 25 {
		f.st.UpdateSession(fmt.Sprintf("s%02d", i), func(r *kvcv1.SessionRecord) {})
	}
	var all []string
	tok := ""
	for {
		recs, next := f.st.ListSessions(tok, 10, "")
		for _, r := range recs {
			all = append(all, r.GetSessionId())
		}
		if next == "" {
			break
		}
		tok = next
	}
	if len(all) != 25 || all[0] != "s00" || all[24] != "s24" {
		t.Fatalf("paged %v", all)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestDeposedLeaderWritesAreFenced(t *testing.T) {
	c := etcdtest.Start(t)
	store, err := kvstore.New(c.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	f1 := leadOn(t, store, Config{NodeID: "cp-1"})
	f1.st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Turn = 1 })
	must(t, f1.st.Flush(t.Context()))
	// cp-1 loses its lease without noticing (as after a long pause); cp-2 is elected.
	if _, err := store.Client().Revoke(t.Context(), f1.sess.Lease()); err != nil {
		t.Fatal(err)
	}
	f2 := leadOn(t, store, Config{NodeID: "cp-2"})
	f1.st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Turn = 99; r.DecodeWorker = "zombie" })
	select {
	case <-f1.term.Deposed():
	case <-time.After(10 * time.Second):
		t.Fatal("deposed leader's term not ended by the fence")
	}
	if err := f1.st.Flush(t.Context()); !errors.Is(err, kvstore.ErrFenced) {
		t.Fatalf("flush of the deposed leader: %v", err)
	}
	rec, ok, err := store.GetSession(t.Context(), "s")
	if err != nil || !ok || rec.GetTurn() != 1 || rec.GetDecodeWorker() != "" {
		t.Fatalf("etcd after the zombie write: %v %v %v", rec, ok, err)
	}
	// A volatile-only change of the deposed leader: its journal flush writes nothing.
	f1.st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Turn = 98 })
	if err := f1.st.Flush(t.Context()); !errors.Is(err, kvstore.ErrFenced) {
		t.Fatalf("journal flush of the deposed leader: %v", err)
	}
	if n := journalKeys(t, store); n != 0 {
		t.Fatalf("%d journal keys after the deposed leader's flush", n)
	}
	f2.st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Turn = 2 })
	must(t, f2.st.Flush(t.Context()))
	if rec := loadedView(t, store)["s"]; rec.GetTurn() != 2 || rec.GetEpoch() != f2.st.Epoch() {
		t.Fatalf("new leader's write: %v", rec)
	}
}

// TestVolatileUpdatesDeferred: an update of an existing session that changes only volatile
// fields is not handed to the batcher; it waits in the dirty set (coalesced: one etcd write
// for many updates) until Flush, the periodic flusher or EndTerm. Creations and residency,
// snapshot, generation or migration changes reach etcd through the batcher at once.
func TestVolatileUpdatesDeferred(t *testing.T) {
	f := newFixture(t, Config{FlushDelay: 5 * time.Millisecond, VolatileFlush: time.Hour})
	st, ctx := f.st, t.Context()
	key := f.store.SessionKey("s")
	version := func() int64 { // etcd's per-key count of writes
		t.Helper()
		r, err := f.store.Client().Get(ctx, key)
		if err != nil || len(r.Kvs) != 1 {
			t.Fatalf("get %s: %v %v", key, r, err)
		}
		return r.Kvs[0].Version
	}
	stored := func() *kvcv1.SessionRecord {
		t.Helper()
		rec, ok, err := f.store.GetSession(ctx, "s")
		if err != nil || !ok {
			t.Fatalf("etcd: %v %v", ok, err)
		}
		return rec
	}
	st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Turn = 1 }) // a creation: at once
	must(t, f.term.batcher.Flush(ctx))
	if stored().GetTurn() != 1 {
		t.Fatal("a new session was deferred")
	}
	cases := []struct {
		name      string
		fn        func(r *kvcv1.SessionRecord)
		immediate bool
	}{
		{"turn and last_seen", func(r *kvcv1.SessionRecord) { r.Turn++; r.LastSeenUnixMs = time.Now().UnixMilli() }, false},
		{"kv_committed_len", func(r *kvcv1.SessionRecord) { r.KvCommittedLen += 100 }, false},
		{"d_rejects", func(r *kvcv1.SessionRecord) { r.DRejects = map[string]int32{"d9": r.DRejects["d9"] + 1} }, false},
		{"epoch only", func(r *kvcv1.SessionRecord) { r.Epoch = 1 }, false},
		{"decode_worker", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d" + fmt.Sprint(r.Turn); r.Turn++ }, true},
		{"previous_decode_worker", func(r *kvcv1.SessionRecord) { r.PreviousDecodeWorker = "p" + fmt.Sprint(r.Turn); r.Turn++ }, true},
		{"generation", func(r *kvcv1.SessionRecord) { r.Generation++; r.Turn++ }, true},
		{"migrations", func(r *kvcv1.SessionRecord) { r.Migrations++; r.Turn++ }, true},
		{"snapshot set", func(r *kvcv1.SessionRecord) {
			r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p0", Seqlen: 10, Generation: uint64(r.Turn)}
			r.Turn++
		}, true},
		{"snapshot replaced", func(r *kvcv1.SessionRecord) {
			sn := proto.Clone(r.Snapshot).(*kvcv1.SnapshotInfo)
			sn.Seqlen++
			r.Snapshot = sn
			r.Turn++
		}, true},
		{"snapshot cleared and set", func(r *kvcv1.SessionRecord) {
			if r.Snapshot != nil {
				r.Snapshot = nil
			} else {
				r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p1"}
			}
			r.Turn++
		}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			must(t, st.Flush(ctx))
			v0 := version()
			const updates = 20
			for range updates {
				st.UpdateSession("s", tc.fn)
				must(t, f.term.batcher.Flush(ctx)) // whatever was handed to the batcher is in etcd
			}
			mem, _ := st.Session("s")
			if tc.immediate {
				if got := version() - v0; got != updates {
					t.Fatalf("%d etcd writes for %d durable updates", got, updates)
				}
				if !proto.Equal(stored(), mem) {
					t.Fatalf("etcd %v, memory %v", stored(), mem)
				}
				return
			}
			if got := version(); got != v0 {
				t.Fatalf("volatile updates written before a flush (%d writes)", got-v0)
			}
			k0 := journalWrites(t, st)
			must(t, st.Flush(ctx))
			if got := version() - v0; got != 0 {
				t.Fatalf("%d writes of the full record for %d volatile updates, want 0 (journal)", got, updates)
			}
			if got := journalWrites(t, st) - k0; got != 1 {
				t.Fatalf("%d journal keys written for %d coalesced volatile updates, want 1", got, updates)
			}
			if view := loadedView(t, f.store)["s"]; !proto.Equal(view, mem) {
				t.Fatalf("after Flush a new leader would load %v, memory %v", view, mem)
			}
		})
	}

	// A durable change carries the pending volatile ones with it (and clears them).
	st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.KvCommittedLen = 777 })
	st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.PreviousDecodeWorker = "dx" })
	must(t, f.term.batcher.Flush(ctx))
	if r := stored(); r.GetKvCommittedLen() != 777 || r.GetPreviousDecodeWorker() != "dx" {
		t.Fatalf("durable write lost the volatile change: %v", r)
	}
	if n := journalKeys(t, f.store); n != 0 {
		t.Fatalf("%d journal keys left after the full record superseded them", n)
	}

	// EndTerm hands over what is still deferred: the next leader loads it.
	st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Turn = 99 })
	st.EndTerm(f.term)
	must(t, f.sess.Close())
	f2 := leadOn(t, f.store, Config{NodeID: "cp-2"})
	if r, ok := f2.st.Session("s"); !ok || r.GetTurn() != 99 || r.GetPreviousDecodeWorker() != "dx" {
		t.Fatalf("new leader after a graceful end: %v", r)
	}
}

// TestVolatileFlusher: without any Flush call, the periodic flusher persists deferred
// volatile changes (within the interval; the wait is bounded only by the test deadline).
func TestVolatileFlusher(t *testing.T) {
	f := newFixture(t, Config{FlushDelay: 5 * time.Millisecond, VolatileFlush: 50 * time.Millisecond})
	st, ctx := f.st, t.Context()
	st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0" })
	st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.KvCommittedLen = 4242 })
	_ = ctx
	waitFor(t, "the flusher persisted the volatile change", func() bool {
		return loadedView(t, f.store)["s"].GetKvCommittedLen() == 4242
	})
}

// loadedView is what a new leader would load from store: the records with the volatile
// journal applied (the same code as Lead, on a State that does not lead).
func loadedView(t *testing.T, store *kvstore.Store) map[string]*kvcv1.SessionRecord {
	t.Helper()
	snap, err := store.LoadAll(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	st := New(Config{Log: zerolog.Nop()})
	st.mu.Lock()
	defer st.mu.Unlock()
	st.loadSessionsLocked(snap)
	out := make(map[string]*kvcv1.SessionRecord, len(st.sessions))
	for id, e := range st.sessions {
		out[id] = e.rec
	}
	return out
}

// journalKeys counts the volatile journal keys in etcd.
func journalKeys(t *testing.T, store *kvstore.Store) int {
	t.Helper()
	r, err := store.Client().Get(t.Context(), store.VolatilePrefix(), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	return int(r.Count)
}

// journalWrites is the state's count of journal keys written.
func journalWrites(t *testing.T, st *State) int {
	t.Helper()
	return int(testutil.ToFloat64(st.m.journalWritten))
}
