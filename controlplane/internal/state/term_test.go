package state

import (
	"context"
	"errors"
	"testing"

	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLeadershipContext: over a leading state with a connected sidecar, once the term's
// leadership context ends (the election's renew deadline), the state refuses to act before
// EndTerm runs: epoch 0, no session update, no command, no attach, no drain, no forget.
func TestLeadershipContext(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	store, err := kvstore.New(cli, kvstore.WithPrefix("/lead/"))
	if err != nil {
		t.Fatal(err)
	}
	put, err := cli.Put(t.Context(), store.ElectionPrefix()+"x", "v")
	if err != nil {
		t.Fatal(err)
	}
	fence := kvstore.Fence{Key: store.ElectionPrefix() + "x", Rev: put.Header.Revision}
	st := New(Config{NodeID: "cp", Store: store, Log: zerolog.Nop()})
	lead, endLead := context.WithCancel(context.Background())
	defer endLead()
	term, err := st.LeadTerm(t.Context(), lead, fence)
	if err != nil {
		t.Fatal(err)
	}
	defer st.EndTerm(term)
	stream, err := st.Attach(&kvcv1.Hello{WorkerId: "d0", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, KvCapacityTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	drainCmd := &kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}
	for _, tc := range []struct {
		name    string
		leading bool
	}{{"leading", true}, {"leadership ended", false}} {
		t.Run(tc.name, func(t *testing.T) {
			if !tc.leading {
				endLead()
				<-term.ctx.Done() // derived: the term's goroutines stop with it
			}
			wantEpoch := int64(0)
			if tc.leading {
				wantEpoch = fence.Rev
			}
			if e := st.Epoch(); e != wantEpoch || st.Leading() != tc.leading {
				t.Fatalf("epoch %d leading %v, want %d", e, st.Leading(), wantEpoch)
			}
			called := false
			st.UpdateSession("s-"+tc.name[:3], func(*kvcv1.SessionRecord) { called = true })
			if called != tc.leading {
				t.Fatalf("UpdateSession applied: %v", called)
			}
			err := st.SendCommand("d0", drainCmd)
			var queued bool
			select {
			case m := <-stream.Queue():
				queued = m.GetCommand().GetEpoch() == fence.Rev
			default:
			}
			if tc.leading != (err == nil && queued) {
				t.Fatalf("command: err %v, queued %v", err, queued)
			}
			if tc.leading {
				return
			}
			if !errors.Is(err, ErrNotLeader) {
				t.Fatalf("command after the end: %v", err)
			}
			if _, err := st.Attach(&kvcv1.Hello{WorkerId: "d1", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE}); !errors.Is(err, ErrNotLeader) {
				t.Fatalf("attach: %v", err)
			}
			if _, err := st.Drain("d0", true); !errors.Is(err, ErrNotLeader) {
				t.Fatalf("drain: %v", err)
			}
			if _, _, err := st.ForgetWorker("d0", true); !errors.Is(err, ErrNotLeader) {
				t.Fatalf("forget: %v", err)
			}
			if _, err := st.UpdatePolicy(t.Context(), &kvcv1.Policy{}); !errors.Is(err, ErrNotLeader) {
				t.Fatalf("policy: %v", err)
			}
		})
	}
}
