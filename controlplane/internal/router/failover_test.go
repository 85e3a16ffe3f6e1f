package router

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"go.etcd.io/etcd/client/v3/concurrency"

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
	return &replica{st: st, term: term, sess: sess, rt: New(st, zerolog.Nop(), nil)}
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
	h, _ := pagehash.New(tps, 0)
	all := append(append([]uint32(nil), prompt...), gen...)
	chain := h.Chain(all)
	req := outcome(d.DecisionId, true, okKind, int64(len(all)))
	req.GetOutcome().KvPages = chain[len(prompt)/tps:]
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
