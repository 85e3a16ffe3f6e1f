package state

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// seen is a commit the control plane sees: by worker, of kvLen tokens in generation gen.
type seen struct {
	worker string
	kvLen  int64
	gen    uint64
}

// TestCommitBeforeTheOutcome: kv_committed_len is its decode worker's commit. A commit by a
// worker the record does not name yet (a seed's or reseed's, ahead of the decision's outcome)
// leaves the record alone and becomes its length when an update (the outcome) makes that
// worker the session's decode worker; a residency made without such a commit starts at 0; a
// commit of another worker or generation, or one superseded by the named worker's own, is not
// taken; an update that sets the length itself keeps it.
func TestCommitBeforeTheOutcome(t *testing.T) {
	tests := []struct {
		name    string
		commits []seen
		moveTo  string // the outcome's new decode worker
		setLen  int64  // the update sets kv_committed_len itself (0: not)
		want    int64
	}{
		{name: "the new worker's commit came first", commits: []seen{{"d1", 4100, 0}}, moveTo: "d1", want: 4100},
		{name: "no commit yet", moveTo: "d1", want: 0},
		{name: "another worker's commit", commits: []seen{{"d2", 4100, 0}}, moveTo: "d1", want: 0},
		{name: "a commit of another generation", commits: []seen{{"d1", 4100, 9}}, moveTo: "d1", want: 0},
		{name: "the latest commit wins", commits: []seen{{"d1", 4100, 0}, {"d1", 4200, 0}}, moveTo: "d1", want: 4200},
		{name: "the named worker's commit clears it", commits: []seen{{"d1", 4100, 0}, {"d0", 700, 0}}, moveTo: "d1", want: 0},
		{name: "an update that sets the length", moveTo: "d1", setLen: 55, want: 55},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, Config{})
			st := f.st
			streams := map[string]*Stream{}
			for _, id := range []string{"d0", "d1", "d2"} {
				s, err := st.Attach(hello(id, kvcv1.WorkerRole_WORKER_ROLE_DECODE))
				must(t, err)
				must(t, st.Reconcile(s, &kvcv1.ResidentSessions{FullSync: true}))
				streams[id] = s
			}
			must(t, st.ApplyEvent(streams["d0"], &kvcv1.SessionEvent{SessionId: "s", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: 600}))
			var gen uint64
			st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.Generation = 2; gen = r.Generation })
			for _, c := range tt.commits {
				must(t, st.ApplyEvent(streams[c.worker], &kvcv1.SessionEvent{SessionId: "s", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED,
					KvLen: c.kvLen, Generation: c.gen}))
			}
			if r, _ := st.Session("s"); r.GetDecodeWorker() != "d0" || (r.GetKvCommittedLen() != 600 && r.GetKvCommittedLen() != 700) {
				t.Fatalf("before the outcome: %v (another worker's commit changed it)", r)
			}
			st.UpdateSession("s", func(r *kvcv1.SessionRecord) {
				r.DecodeWorker, r.Generation = tt.moveTo, gen+1
				if tt.setLen > 0 {
					r.KvCommittedLen = tt.setLen
				}
			})
			if r, _ := st.Session("s"); r.GetDecodeWorker() != tt.moveTo || r.GetKvCommittedLen() != tt.want {
				t.Fatalf("after the outcome: %s committed %d, want %s %d", r.GetDecodeWorker(), r.GetKvCommittedLen(), tt.moveTo, tt.want)
			}
			if taken := testutil.ToFloat64(st.m.commitsAway.WithLabelValues("taken")); (taken == 1) != (tt.want > 0 && tt.setLen == 0) {
				t.Fatalf("kvc_cp_commits_before_residency_total{fate=taken} %v", taken)
			}
			st.mu.Lock()
			left := len(st.commitsAway)
			st.mu.Unlock()
			if left != 0 {
				t.Fatalf("%d commits kept after the residency took its own", left)
			}
		})
	}
}
