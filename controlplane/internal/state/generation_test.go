package state

import (
	"testing"

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
