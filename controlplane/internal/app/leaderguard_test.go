package app

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type fakeLease struct{ ok atomic.Bool }

func (f *fakeLease) IsLeader() bool { return f.ok.Load() }

// TestLeaderGuard: over a leading state with a connected sidecar, the guard passes calls
// through only while the election says this replica may act as leader.
func TestLeaderGuard(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	store, err := kvstore.New(cli, kvstore.WithPrefix("/guard/"))
	if err != nil {
		t.Fatal(err)
	}
	put, err := cli.Put(t.Context(), store.ElectionPrefix()+"x", "v")
	if err != nil {
		t.Fatal(err)
	}
	fence := kvstore.Fence{Key: store.ElectionPrefix() + "x", Rev: put.Header.Revision}
	st := state.New(state.Config{NodeID: "cp", Store: store, Log: zerolog.Nop()})
	term, err := st.Lead(t.Context(), fence)
	if err != nil {
		t.Fatal(err)
	}
	defer st.EndTerm(term)
	stream, err := st.Attach(&kvcv1.Hello{WorkerId: "d0", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, KvCapacityTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	lease := &fakeLease{}
	g := leaderGuard{State: st, lead: lease}
	for _, tc := range []struct {
		name    string
		leading bool
	}{{"leading", true}, {"past the renew deadline", false}, {"leading again", true}} {
		t.Run(tc.name, func(t *testing.T) {
			lease.ok.Store(tc.leading)
			wantEpoch := int64(0)
			if tc.leading {
				wantEpoch = fence.Rev
			}
			if e := g.Epoch(); e != wantEpoch {
				t.Fatalf("epoch %d, want %d", e, wantEpoch)
			}
			called := false
			g.UpdateSession("s-"+tc.name[:3], func(*kvcv1.SessionRecord) { called = true })
			if called != tc.leading {
				t.Fatalf("UpdateSession applied: %v", called)
			}
			err := g.SendCommand("d0", &kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}})
			var queued bool
			select {
			case m := <-stream.Queue():
				queued = m.GetCommand().GetEpoch() == fence.Rev
			default:
			}
			if tc.leading && (err != nil || !queued) {
				t.Fatalf("leading: err %v, queued %v", err, queued)
			}
			if !tc.leading && (!errors.Is(err, state.ErrNotLeader) || queued) {
				t.Fatalf("not leading: err %v, queued %v", err, queued)
			}
		})
	}
}

func TestLeaseCheck(t *testing.T) {
	errNL := errors.New("not leader")
	lease := &fakeLease{}
	c := leaseCheck{lead: lease, notLeader: func() error { return errNL }}
	for _, tc := range []struct {
		method  string
		leading bool
		refused bool
	}{
		{"/kvc.v1.SidecarService/Connect", false, true},
		{"/kvc.v1.RouterService/Route", false, true},
		{"/kvc.v1.SidecarService/Connect", true, false},
		{"/kvc.v1.RouterService/Route", true, false},
		{"/kvc.v1.AdminService/GetLeader", false, false},
		{"/grpc.health.v1.Health/Check", false, false},
	} {
		lease.ok.Store(tc.leading)
		called := false
		_, uerr := c.Unary(t.Context(), nil, &grpc.UnaryServerInfo{FullMethod: tc.method}, func(context.Context, any) (any, error) {
			called = true
			return nil, nil
		})
		serr := c.Stream(nil, nil, &grpc.StreamServerInfo{FullMethod: tc.method}, func(any, grpc.ServerStream) error {
			called = true
			return nil
		})
		if refused := errors.Is(uerr, errNL) && errors.Is(serr, errNL) && !called; refused != tc.refused {
			t.Errorf("%s leading=%v: unary %v stream %v called %v", tc.method, tc.leading, uerr, serr, called)
		}
	}
}
