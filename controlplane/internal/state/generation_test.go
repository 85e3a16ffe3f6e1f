package state

import (
	"bytes"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestGenerationTermPerLeader: every leader serves under a generation term above every earlier
// leader's (the durable counter in etcd), and above the newest term among the generations it
// loads even when the counter is gone; a state whose term ended answers 0.
func TestGenerationTermPerLeader(t *testing.T) {
	c := etcdtest.Start(t)
	store, err := kvstore.New(c.Client(t))
	if err != nil {
		t.Fatal(err)
	}
	const b = policy.GenerationTermBits
	for _, step := range []struct {
		name   string
		before func(t *testing.T) // what happens to etcd before the leader is elected
		want   uint64
		write  func(r *kvcv1.SessionRecord) // what the leader writes
	}{
		{"first leader", nil, 1, func(r *kvcv1.SessionRecord) { r.Generation = policy.NextGeneration(0, 1) }},
		{"next leader", nil, 2, func(r *kvcv1.SessionRecord) {
			// a snapshot of a generation made under a term the counter will not know
			r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p", Seqlen: 1, Generation: 7<<b | 3}
		}},
		{"counter lost: on from the loaded generations", func(t *testing.T) {
			if _, err := store.Client().Delete(t.Context(), store.GenerationTermKey()); err != nil {
				t.Fatal(err)
			}
		}, 8, nil},
	} {
		t.Run(step.name, func(t *testing.T) {
			if step.before != nil {
				step.before(t)
			}
			f := leadOn(t, store, Config{NodeID: "cp"})
			if g := f.st.GenerationTerm(); g != step.want {
				t.Fatalf("generation term %d, want %d", g, step.want)
			}
			if step.write != nil {
				f.st.UpdateSession("s", step.write)
				must(t, f.st.Flush(t.Context()))
			}
			f.st.EndTerm(f.term)
			if g := f.st.GenerationTerm(); g != 0 {
				t.Fatalf("generation term %d after the term ended", g)
			}
			must(t, f.sess.Close()) // the next leader is elected at once
		})
	}
}

// TestBrokenGenerationTermNotLed (issue 23 item 2): a replica refuses to lead — an error from
// LeadTerm, an error log naming the key, kvc_cp_generation_term_refused_total — rather than serve
// on a generation term that would wrap (a stored 2^64-1 made the next term 0, so a new leader's
// generations restarted at 1), pass 2^53 (the last term, or a loaded record's generation of
// 2^60), or that is not a number; a term below the last one is led.
func TestBrokenGenerationTermNotLed(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	for i, tc := range []struct {
		name   string
		term   string // the stored generation term ("": none)
		recGen uint64 // a stored session record's generation (0: none)
		reason string // the refusal's label ("": led)
	}{
		{"2^64-1 stored", strconv.FormatUint(math.MaxUint64, 10), 0, "exhausted"},
		{"the last term stored", strconv.FormatUint(policy.MaxGenerationTerm, 10), 0, "exhausted"},
		{"a record of generation 2^60", "", 1 << 60, "exhausted"},
		{"a record of generation 2^64-1", "3", math.MaxUint64, "exhausted"},
		{"not a number", "x17", 0, "unreadable"},
		{"one below the last term", strconv.FormatUint(policy.MaxGenerationTerm-1, 10), 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store, err := kvstore.New(cli, kvstore.WithPrefix(fmt.Sprintf("/broken-%d/", i)))
			must(t, err)
			if tc.term != "" {
				_, err := cli.Put(t.Context(), store.GenerationTermKey(), tc.term)
				must(t, err)
			}
			if tc.recGen != 0 {
				b, err := proto.Marshal(&kvcv1.SessionRecord{SessionId: "s", Generation: tc.recGen})
				must(t, err)
				_, err = cli.Put(t.Context(), store.SessionKey("s"), string(b))
				must(t, err)
			}
			sess, err := concurrency.NewSession(cli, concurrency.WithTTL(5))
			must(t, err)
			defer sess.Close()
			el := concurrency.NewElection(sess, store.ElectionPrefix())
			must(t, el.Campaign(t.Context(), "n"))
			reg := prometheus.NewRegistry()
			var logs bytes.Buffer
			st := New(Config{NodeID: "cp", Store: store, Reg: reg, Log: zerolog.New(&logs)})
			term, err := st.Lead(t.Context(), kvstore.Fence{Key: el.Key(), Rev: el.Rev()})
			if tc.reason == "" {
				must(t, err)
				if got := st.GenerationTerm(); got != policy.MaxGenerationTerm {
					t.Fatalf("generation term %d, want %d", got, uint64(policy.MaxGenerationTerm))
				}
				st.EndTerm(term)
				return
			}
			if err == nil {
				st.EndTerm(term)
				t.Fatalf("led on generation term %d", st.genTerm.Load())
			}
			if st.Leading() || st.GenerationTerm() != 0 {
				t.Fatalf("leading after the refusal")
			}
			if got := testutil.ToFloat64(st.m.termRefused.WithLabelValues(tc.reason)); got != 1 {
				t.Fatalf("kvc_cp_generation_term_refused_total{reason=%q} = %v, want 1", tc.reason, got)
			}
			if !strings.Contains(logs.String(), `"level":"error"`) || !strings.Contains(logs.String(), store.GenerationTermKey()) {
				t.Fatalf("no error log naming %s: %s", store.GenerationTermKey(), logs.String())
			}
		})
	}
}

// TestCorruptPolicyRecord (issue 23 item 6): a stored policy record that does not decode is
// never read as "no policy" (every knob silently back at its default). A replica that knows a
// good version (a standby watching the record, or a leader before) leads and keeps it, saying
// so; one that knows none refuses to lead. Both log an error naming the key and count it.
func TestCorruptPolicyRecord(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	for i, tc := range []struct {
		name   string
		known  *kvcv1.Policy // what the replica saw before (nil: nothing)
		action string
	}{
		{"last good version known", &kvcv1.Policy{Version: 3, SeedMinTurn: proto.Int32(4)}, "kept_last_good"},
		{"none known", nil, "refused_to_lead"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store, err := kvstore.New(cli, kvstore.WithPrefix(fmt.Sprintf("/corrupt-policy-%d/", i)))
			must(t, err)
			_, err = cli.Put(t.Context(), store.PolicyKey(), "\xff\xff\xff not a policy")
			must(t, err)
			sess, err := concurrency.NewSession(cli, concurrency.WithTTL(5))
			must(t, err)
			defer sess.Close()
			el := concurrency.NewElection(sess, store.ElectionPrefix())
			must(t, el.Campaign(t.Context(), "n"))
			var logs bytes.Buffer
			st := New(Config{NodeID: "cp", Store: store, Reg: prometheus.NewRegistry(), Log: zerolog.New(&logs)})
			if tc.known != nil {
				st.SetStoredPolicy(tc.known)
			}
			term, err := st.Lead(t.Context(), kvstore.Fence{Key: el.Key(), Rev: el.Rev()})
			if tc.known == nil {
				if err == nil {
					st.EndTerm(term)
					t.Fatalf("led on the defaults (seed_min_turn %d) over a corrupt policy record", st.Policy().GetSeedMinTurn())
				}
			} else {
				must(t, err)
				defer st.EndTerm(term)
				if p := st.Policy(); p.GetVersion() != 3 || p.GetSeedMinTurn() != 4 {
					t.Fatalf("policy after loading a corrupt record: version %d seed_min_turn %d, want the last good (3, 4)", p.GetVersion(), p.GetSeedMinTurn())
				}
			}
			if got := testutil.ToFloat64(st.m.policyCorrupt.WithLabelValues(tc.action)); got != 1 {
				t.Fatalf("kvc_cp_policy_corrupt_total{action=%q} = %v, want 1", tc.action, got)
			}
			if !strings.Contains(logs.String(), `"level":"error"`) || !strings.Contains(logs.String(), store.PolicyKey()) {
				t.Fatalf("no error log naming %s: %s", store.PolicyKey(), logs.String())
			}
		})
	}
}
