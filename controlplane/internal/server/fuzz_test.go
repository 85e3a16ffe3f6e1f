package server

import (
	"context"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// FuzzConnectRequest feeds arbitrary bytes, decoded as a sidecar message, to the validators
// and to a leading state: nothing may panic, only a hello may end the stream, and whatever is
// accepted must leave the session table readable.
func FuzzConnectRequest(f *testing.F) {
	seeds := []*kvcv1.ConnectRequest{
		{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{WorkerId: "d0", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE}}},
		{Msg: &kvcv1.ConnectRequest_Load{Load: &kvcv1.LoadReport{Load: &kvcv1.WorkerLoad{UsedTokens: 5}}}},
		{Msg: &kvcv1.ConnectRequest_Load{Load: &kvcv1.LoadReport{Load: &kvcv1.WorkerLoad{UsedTokens: -5}}}},
		{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: &kvcv1.ResidentSessions{FullSync: true,
			Sessions: []*kvcv1.ResidentSession{{SessionId: "a", KvCommittedLen: 3}, {SessionId: "b"}}}}},
		{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: &kvcv1.ResidentSessions{
			Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "a", Seqlen: -1}}}}},
		{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{SessionId: "a", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: 9}}},
		{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{SessionId: "a", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED}}},
		{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: &kvcv1.SessionEvent{SessionId: "a/\x00", Kind: 77}}},
		{Msg: &kvcv1.ConnectRequest_Ack{Ack: &kvcv1.CommandAck{CommandId: 1}}},
		{},
	}
	for _, s := range seeds {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0xff, 0x01, 0x02})

	c := etcdtest.Start(f)
	store, err := kvstore.New(c.Client(f))
	if err != nil {
		f.Fatal(err)
	}
	sess, err := concurrency.NewSession(store.Client(), concurrency.WithTTL(5))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { _ = sess.Close() })
	el := concurrency.NewElection(sess, store.ElectionPrefix())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := el.Campaign(ctx, "fuzz"); err != nil {
		f.Fatal(err)
	}
	st := state.New(state.Config{NodeID: "fuzz", Store: store, Log: zerolog.Nop()})
	term, err := st.Lead(ctx, kvstore.Fence{Key: el.Key(), Rev: el.Rev()})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { st.EndTerm(term) })
	svc := NewSidecar(Sidecar{NodeID: "fuzz", State: st, Log: zerolog.Nop()}, nil)
	streams := map[kvcv1.WorkerRole]*state.Stream{}
	for role, id := range map[kvcv1.WorkerRole]string{kvcv1.WorkerRole_WORKER_ROLE_DECODE: "d0", kvcv1.WorkerRole_WORKER_ROLE_PREFILL: "p0"} {
		s, err := st.Attach(&kvcv1.Hello{WorkerId: id, Role: role})
		if err != nil {
			f.Fatal(err)
		}
		streams[role] = s
	}

	f.Fuzz(func(t *testing.T, b []byte) {
		m := &kvcv1.ConnectRequest{}
		if proto.Unmarshal(b, m) != nil {
			return
		}
		if h := m.GetHello(); h != nil {
			_ = validateHello(h)
		}
		for _, s := range streams {
			err := svc.handle(s, m, zerolog.Nop())
			if err != nil && m.GetHello() == nil {
				t.Fatalf("stream ended by a non-hello message %v: %v", m, err)
			}
		}
		for _, id := range []string{"a", "b"} {
			if r, ok := st.Session(id); ok && r.GetSessionId() != id {
				t.Fatalf("record %q has id %q", id, r.GetSessionId())
			}
		}
	})
}
