package router

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	"github.com/kvcentric/kvcentric/pkg/pagehash"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// replica is one control plane replica on a shared etcd: state and router, leading once
// lead returns.
type replica struct {
	st   *state.State
	term *state.Term
	sess *concurrency.Session
	rt   *Service
	// streams: the workers' sidecar streams (their commits, reportTruncated)
	streams map[string]*state.Stream
}

func lead(t *testing.T, store *kvstore.Store, node string, volatileFlush time.Duration) *replica {
	t.Helper()
	sess, err := concurrency.NewSession(store.Client(), concurrency.WithTTL(5))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sess.Close() })
	el := concurrency.NewElection(sess, store.ElectionPrefix())
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := el.Campaign(ctx, node); err != nil {
		t.Fatal(err)
	}
	st := state.New(state.Config{NodeID: node, Store: store, Log: zerolog.Nop(), VolatileFlush: volatileFlush})
	term, err := st.Lead(ctx, kvstore.Fence{Key: el.Key(), Rev: el.Rev()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.EndTerm(term) })
	return &replica{st: st, term: term, sess: sess, rt: New(st, zerolog.Nop(), nil), streams: map[string]*state.Stream{}}
}

// attach connects the workers' sidecars to r; each decode worker reports what it holds
// (resident, by worker: the resync a new leader waits for).
func (r *replica) attach(t *testing.T, resident map[string][]*kvcv1.ResidentSession) {
	t.Helper()
	for _, w := range []struct {
		id   string
		role kvcv1.WorkerRole
	}{{"p1", kvcv1.WorkerRole_WORKER_ROLE_PREFILL}, {"d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE}, {"d2", kvcv1.WorkerRole_WORKER_ROLE_DECODE}} {
		st, err := r.st.Attach(&kvcv1.Hello{WorkerId: w.id, Role: w.role, Node: "n1", KvCapacityTokens: 200_000,
			WorkerUrl: "http://" + w.id, PeerAddr: w.id + ":7000", TransferEndpoint: w.id + ":7001"})
		if err != nil {
			t.Fatal(err)
		}
		load := &kvcv1.WorkerLoad{}
		if w.role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
			load.SnapshotBytesCapacity = 1 << 30
		}
		if err := r.st.ApplyLoad(st, load); err != nil {
			t.Fatal(err)
		}
		if err := r.st.Reconcile(st, &kvcv1.ResidentSessions{FullSync: true, Sessions: resident[w.id]}); err != nil {
			t.Fatal(err)
		}
		r.streams[w.id] = st
	}
}

func (r *replica) decide(t *testing.T, session string, ids []uint32, out int64) *kvcv1.RouteDecision {
	t.Helper()
	h, _ := pagehash.New(tps, 0)
	req := query(session, 0, int64(len(ids)), out)
	req.GetQuery().PageSize = tps
	req.GetQuery().PromptPages = h.Chain(ids)
	d := r.rt.Handle(req).GetDecision()
	if d == nil {
		t.Fatalf("no decision for %s", session)
	}
	return d
}

func (r *replica) report(t *testing.T, d *kvcv1.RouteDecision, prompt, gen []uint32) {
	t.Helper()
	r.reportTruncated(t, d, prompt, gen, 0)
}

// reportTruncated reports success; truncatedTo > 0: D rewrote the session from that token on
// (a new KV generation on the same decode worker).
func (r *replica) reportTruncated(t *testing.T, d *kvcv1.RouteDecision, prompt, gen []uint32, truncatedTo int64) {
	t.Helper()
	h, _ := pagehash.New(tps, 0)
	all := append(append([]uint32(nil), prompt...), gen...)
	chain := h.Chain(all)
	req := outcome(d.DecisionId, true, okKind, int64(len(all)))
	req.GetOutcome().KvPages = chain[len(prompt)/tps:]
	req.GetOutcome().TruncatedTo = truncatedTo
	// The decode worker commits through its sidecar before it answers: kv_committed_len's writer.
	if dw, session := keeper(r.rt, d.DecisionId); r.streams[dw] != nil {
		if err := r.st.ApplyEvent(r.streams[dw], &kvcv1.SessionEvent{SessionId: session,
			Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: int64(len(all))}); err != nil {
			t.Fatal(err)
		}
	}
	if ack := r.rt.Handle(req).GetOutcomeAck(); ack == nil {
		t.Fatalf("outcome of %s not acknowledged", d.DecisionId)
	}
}

// TestContentSurvivesFailover (issue 16 finding 7): the compact page chain persisted with the
// session record (through the volatile journal, or in the full record with the journal off)
// lets a new leader keep a session whose prompt extends its resident content DIRECT_TO_D
// after a handover without a graceful stepdown, on a real etcd. A record whose chain no longer
// describes the residency the decode worker reports (another length) is not used: that
// session reseeds (PREFIX_MISMATCH) as before.
func TestContentSurvivesFailover(t *testing.T) {
	for _, tc := range []struct {
		name          string
		volatileFlush time.Duration
	}{
		{"journal", 0}, // the default interval: the extended turn's chain rides in the journal
		{"full records", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := etcdtest.Start(t)
			store, err := kvstore.New(c.Client(t))
			if err != nil {
				t.Fatal(err)
			}
			a := lead(t, store, "cp-a", tc.volatileFlush)
			a.attach(t, nil)

			convs := map[string][]uint32{}
			for i, id := range []string{"kept", "moved-on"} {
				prompt := idsN(1_000, uint32(1+i*1_000_000))
				d := a.decide(t, id, prompt, 50)
				if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
					t.Fatalf("%s first turn: %s/%s", id, d.Mode, d.Reason)
				}
				gen := idsN(50, uint32(70_000+i*1_000_000))
				a.report(t, d, prompt, gen)
				conv := append(append([]uint32(nil), prompt...), gen...)
				// A second turn, direct: its chain changes with kv_committed_len only (volatile).
				next := append(append([]uint32(nil), conv...), idsN(200, uint32(80_000+i*1_000_000))...)
				d = a.decide(t, id, next, 40)
				if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
					t.Fatalf("%s second turn: %s/%s", id, d.Mode, d.Reason)
				}
				gen2 := idsN(40, uint32(90_000+i*1_000_000))
				a.report(t, d, next, gen2)
				convs[id] = append(next, gen2...)
			}
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			if err := a.st.Flush(ctx); err != nil { // what the periodic flusher writes
				t.Fatal(err)
			}
			// The leader goes away without a stepdown (its lease ends); another replica leads.
			_ = a.sess.Close()
			b := lead(t, store, "cp-b", tc.volatileFlush)
			resident := map[string][]*kvcv1.ResidentSession{}
			for id := range convs {
				rec, ok := b.st.Session(id)
				if !ok || len(rec.ContentChain) == 0 || rec.DecodeWorker == "" {
					t.Fatalf("%s: new leader loaded %v", id, rec)
				}
				if rec.KvCommittedLen != int64(len(convs[id])) {
					t.Fatalf("%s: loaded kv_committed_len %d, want %d (the journal's)", id, rec.KvCommittedLen, len(convs[id]))
				}
				delta := int64(0)
				if id == "moved-on" {
					delta = tps // D committed more since (an outcome the old leader never saw)
				}
				resident[rec.DecodeWorker] = append(resident[rec.DecodeWorker], &kvcv1.ResidentSession{
					SessionId: id, KvCommittedLen: rec.KvCommittedLen + delta, Generation: rec.Generation})
			}
			b.attach(t, resident)
			if b.st.Resyncing() {
				t.Fatal("still resyncing after every decode worker reported")
			}

			conv := convs["kept"]
			next := append(append([]uint32(nil), conv...), idsN(300, 7_000_000)...)
			d := b.decide(t, "kept", next, 40)
			if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT ||
				d.CachedTokens != int64(len(conv)) {
				t.Fatalf("after failover: %s/%s cached %d, want DIRECT_TO_D/SESSION_RESIDENT cached %d", d.Mode, d.Reason, d.CachedTokens, len(conv))
			}
			if got := testutil.ToFloat64(b.rt.m.contentLoaded); got != 1 {
				t.Fatalf("chains loaded %v, want 1", got)
			}
			// The new leader learnt the chain: the next turn extends it too.
			gen := idsN(40, 7_500_000)
			b.report(t, d, next, gen)
			next2 := append(append(append([]uint32(nil), next...), gen...), idsN(64, 7_600_000)...)
			if d := b.decide(t, "kept", next2, 40); d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
				t.Fatalf("turn after: %s/%s", d.Mode, d.Reason)
			}

			conv = convs["moved-on"]
			next = append(append([]uint32(nil), conv...), idsN(300, 8_000_000)...)
			d = b.decide(t, "moved-on", next, 40)
			if d.Reason != kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH {
				t.Fatalf("chain of another length used: %s/%s", d.Mode, d.Reason)
			}
		})
	}
}

// TestReseedWinsOverOlderLeadersCopy (issue 16 finding 8): a leader loads from etcd a session
// generation older than the last one its predecessor acknowledged (write-behind: the later
// writes never reached etcd), while the decode worker holding that newer copy is unreachable.
// The new leader reseeds the session elsewhere (acknowledged); when the old worker comes back,
// its full resync reports the predecessor's newer generation. The new leader's residency must
// win — its generation is in its own, higher term — and the old copy is released there.
func TestReseedWinsOverOlderLeadersCopy(t *testing.T) {
	c := etcdtest.Start(t)
	store, err := kvstore.New(c.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	a := lead(t, store, "cp-a", 0)
	a.attach(t, nil)

	// Leader A seeds the session, and etcd gets that record.
	prompt := idsN(1_000, 1)
	d := a.decide(t, "s", prompt, 50)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED {
		t.Fatalf("first turn: %s/%s", d.Mode, d.Reason)
	}
	home := d.Decode.WorkerId
	other := map[string]string{"d1": "d2", "d2": "d1"}[home]
	conv := append(append([]uint32(nil), prompt...), idsN(50, 70_000)...)
	a.report(t, d, prompt, conv[len(prompt):])
	if err := a.st.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	seeded, err := store.Client().Get(ctx, store.SessionKey("s"))
	if err != nil || len(seeded.Kvs) != 1 {
		t.Fatalf("seeded record in etcd: %v %v", seeded, err)
	}
	loaded, _ := a.st.Session("s")
	// Two more turns on the same decode worker rewrite the session there (truncations): two
	// newer generations, acknowledged by A, that etcd will not have.
	for i := range 2 {
		next := append(append([]uint32(nil), conv...), idsN(200, uint32(80_000+i*10_000))...)
		d = a.decide(t, "s", next, 40)
		if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.WorkerId != home {
			t.Fatalf("turn %d: %s/%s on %s", i+2, d.Mode, d.Reason, d.Decode.GetWorkerId())
		}
		out := idsN(40, uint32(90_000+i*10_000))
		a.reportTruncated(t, d, next, out, int64(len(conv)-tps))
		conv = append(next, out...)
	}
	held, _ := a.st.Session("s")
	if held.DecodeWorker != home || held.Generation <= loaded.Generation+1 {
		t.Fatalf("A's record after the truncations: on %s, generation %d (seeded at generation %d)", held.DecodeWorker, held.Generation, loaded.Generation)
	}
	// A goes away; etcd holds the seed's record (the truncations' writes were behind when etcd
	// went down: emulated by putting the seed's record back).
	_ = a.sess.Close()
	a.st.EndTerm(a.term)
	if _, err := store.Client().Put(ctx, store.SessionKey("s"), string(seeded.Kvs[0].Value)); err != nil {
		t.Fatal(err)
	}

	b := lead(t, store, "cp-b", 0)
	rec, ok := b.st.Session("s")
	if !ok || rec.DecodeWorker != home || rec.Generation != loaded.Generation {
		t.Fatalf("B loaded the session on %q, generation %d; want the seed's record (generation %d on %s)",
			rec.GetDecodeWorker(), rec.GetGeneration(), loaded.Generation, home)
	}
	if policy.NextGeneration(rec.Generation, 0) > held.Generation {
		t.Fatalf("numbered per leader, B's reseed (%d) would win anyway over %d: the test does not reproduce the finding",
			policy.NextGeneration(rec.Generation, 0), held.Generation)
	}
	// The prefill worker and the other decode worker come back to B; home stays UNREACHABLE.
	for _, w := range []struct {
		id   string
		role kvcv1.WorkerRole
	}{{"p1", kvcv1.WorkerRole_WORKER_ROLE_PREFILL}, {other, kvcv1.WorkerRole_WORKER_ROLE_DECODE}} {
		st := attachWorker(t, b.st, w.id, w.role)
		b.streams[w.id] = st
		if err := b.st.Reconcile(st, &kvcv1.ResidentSessions{FullSync: true}); err != nil {
			t.Fatal(err)
		}
	}
	next := append(append([]uint32(nil), conv...), idsN(300, 7_000_000)...)
	d = b.decide(t, "s", next, 40)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL || d.Decode.GetWorkerId() != other {
		t.Fatalf("B, home unreachable: %s/%s on %s, want a reseed on %s", d.Mode, d.Reason, d.Decode.GetWorkerId(), other)
	}
	b.report(t, d, next, idsN(40, 7_500_000)) // acknowledged
	reseeded, _ := b.st.Session("s")
	if reseeded.DecodeWorker != other {
		t.Fatalf("B's reseed is on %q, want %s", reseeded.DecodeWorker, other)
	}
	if reseeded.Generation <= held.Generation {
		t.Errorf("B's reseed has generation %d, not above A's last (%d)", reseeded.Generation, held.Generation)
	}

	// home's sidecar re-homes to B and reports A's last generation in its full resync.
	hs := attachWorker(t, b.st, home, kvcv1.WorkerRole_WORKER_ROLE_DECODE)
	b.streams[home] = hs
	if err := b.st.Reconcile(hs, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
		{SessionId: "s", KvCommittedLen: held.KvCommittedLen, Generation: held.Generation}}}); err != nil {
		t.Fatal(err)
	}
	if got, _ := b.st.Session("s"); got.DecodeWorker != other || got.Generation != reseeded.Generation {
		t.Fatalf("after %s's resync the session is on %s, generation %d: B's acknowledged reseed (generation %d on %s) was lost",
			home, got.DecodeWorker, got.Generation, reseeded.Generation, other)
	}
	var released []string
	for len(hs.Queue()) > 0 {
		if r := (<-hs.Queue()).GetCommand().GetReleaseSession(); r != nil {
			released = append(released, r.GetSessionId())
		}
	}
	if len(released) != 1 || released[0] != "s" {
		t.Fatalf("%s told to release %v, want its stale copy of s", home, released)
	}
}

// attachWorker connects a worker's sidecar to st (a load report makes it routable).
func attachWorker(t *testing.T, st *state.State, id string, role kvcv1.WorkerRole) *state.Stream {
	t.Helper()
	s, err := st.Attach(&kvcv1.Hello{WorkerId: id, Role: role, Node: "n1", KvCapacityTokens: 200_000,
		WorkerUrl: "http://" + id, PeerAddr: id + ":7000", TransferEndpoint: id + ":7001"})
	if err != nil {
		t.Fatal(err)
	}
	load := &kvcv1.WorkerLoad{}
	if role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
		load.SnapshotBytesCapacity = 1 << 30
	}
	if err := st.ApplyLoad(s, load); err != nil {
		t.Fatal(err)
	}
	return s
}
