package decode

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// newTestSidecar registers a 64-page pool (page size 4) on a real tcp engine; Run is not started,
// so queued pushes stay queued and the enqueue decisions are observable.
func newTestSidecar(t *testing.T) *Sidecar {
	t.Helper()
	return newTestSidecarWith(t, nil)
}

// newTestSidecarWith is newTestSidecar whose tcp engine is wrapped by wrap (nil: none).
func newTestSidecarWith(t *testing.T, wrap func(rdma.Engine) rdma.Engine) *Sidecar {
	t.Helper()
	eng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	if wrap != nil {
		eng = wrap(eng)
	}
	s := New(Config{WorkerID: "d", DeltaTokens: 8}, eng, nil, zerolog.Nop())
	t.Cleanup(s.Close)
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 4 * 8, NumLayers: 1, PageCount: 64})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	req := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 32, PageCount: 64, NumLayers: 1}
	for i, k := range []kvcv1.KVKind{kvcv1.KVKind_KV_KIND_K, kvcv1.KVKind_KV_KIND_V} {
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: 0, Kind: k, Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	if _, err := s.RegisterKVPool(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	return s
}

func pages(n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(i)
	}
	return out
}

// TestDefaultDeltaPushesEveryTurn: without a policy's snapshot_delta_tokens, every turn's
// commit is pushed at once (one page's worth of new tokens or more), so the snapshot is current
// while the session thinks and a decode worker's death leaves its reseed no committed tail to
// re-prefill (issue 20's recovery, p42; at the old default, 1024, these turns queued nothing
// until the idle flush).
func TestDefaultDeltaPushesEveryTurn(t *testing.T) {
	eng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	s := New(Config{WorkerID: "d"}, eng, nil, zerolog.Nop()) // no DeltaTokens: the default
	t.Cleanup(s.Close)
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 4 * 8, NumLayers: 1, PageCount: 256})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	req := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 32, PageCount: 256, NumLayers: 1}
	for i, k := range []kvcv1.KVKind{kvcv1.KVKind_KV_KIND_K, kvcv1.KVKind_KV_KIND_V} {
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: 0, Kind: k, Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	ctx := context.Background()
	if _, err := s.RegisterKVPool(ctx, req); err != nil {
		t.Fatal(err)
	}
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "a", PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		committed int64
		want      bool
	}{
		{300, true},  // a first turn
		{420, true},  // a turn of 120 new tokens
		{440, false}, // 20 new tokens: below one page of the demo's pool, left to the idle flush
		{600, true},
	} {
		s.mu.Lock()
		s.queue = nil // as if the queued push had gone out and landed: each commit is judged on its own
		if ss := s.sessions["a"]; ss != nil {
			ss.queued, ss.lastPushed = false, ss.committed
		}
		s.mu.Unlock()
		res, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: tc.committed, Pages: pages(int((tc.committed + 3) / 4))})
		if err != nil {
			t.Fatal(err)
		}
		if res.GetPushEnqueued() != tc.want {
			t.Fatalf("commit to %d: push enqueued %v, want %v", tc.committed, res.GetPushEnqueued(), tc.want)
		}
	}
}

func TestEnqueueDecisions(t *testing.T) {
	s := newTestSidecar(t)
	ctx := context.Background()
	target := func(sess string, gen uint64) {
		if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: sess, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: gen}}}); err != nil {
			t.Fatal(err)
		}
	}
	off := false
	steps := []struct {
		name      string
		do        func()
		sess      string
		n         int64
		wantEnq   bool
		wantQueue int
	}{
		{"no target yet", nil, "a", 4, false, 0},
		{"target set before the delta is reached", func() { target("a", 1) }, "a", 6, false, 0},
		{"delta reached", nil, "a", 8, true, 1},
		{"newer commit replaces the queued push", nil, "a", 12, true, 1},
		{"target named before the first commit", func() { target("b", 3) }, "b", 9, true, 2},
		{"snapshots disabled by policy", func() { s.Policy(&kvcv1.Policy{SnapshotsEnabled: &off}) }, "c", 40, false, 2},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			if st.do != nil {
				st.do()
			}
			if st.sess == "c" {
				target("c", 1)
			}
			res, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: st.sess, CommittedLen: st.n, Pages: pages(int((st.n + 3) / 4))})
			if err != nil {
				t.Fatal(err)
			}
			s.mu.Lock()
			q := len(s.queue)
			s.mu.Unlock()
			if res.GetPushEnqueued() != st.wantEnq || q != st.wantQueue {
				t.Fatalf("enqueued %v, queue %d; want %v, %d", res.GetPushEnqueued(), q, st.wantEnq, st.wantQueue)
			}
		})
	}
	if rs := s.Resync(); len(rs.GetSessions()) != 3 || rs.GetSessions()[1].GetGeneration() != 3 {
		t.Fatalf("resync %v", rs)
	}
	if l := s.Load(); l.GetUsedTokens() != 12+9+40 || l.GetResidentSessions() != 3 {
		t.Fatalf("load %v", l)
	}
}

func TestCommitValidation(t *testing.T) {
	s := newTestSidecar(t)
	ctx := context.Background()
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 8, Pages: pages(2)}); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		req  *kvcv1.CommitSessionRequest
		want codes.Code
	}{
		{"shrinks", &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 4, Pages: pages(1)}, codes.FailedPrecondition},
		{"page outside the pool", &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 12, Pages: []int64{0, 1, 64}}, codes.OutOfRange},
		{"negative page", &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 12, Pages: []int64{0, -1, 2}}, codes.OutOfRange},
		{"too few pages", &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 12, Pages: pages(2)}, codes.InvalidArgument},
		{"zero length", &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 0}, codes.InvalidArgument},
		{"empty id", &kvcv1.CommitSessionRequest{CommittedLen: 4, Pages: pages(1)}, codes.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := s.CommitSession(ctx, tt.req); status.Code(err) != tt.want {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
	if si := s.Sessions(); len(si) != 1 || si[0].CommittedLen != 8 {
		t.Fatalf("session changed by refused commits: %+v", si)
	}
	if _, err := s.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "zz"}); status.Code(err) != codes.NotFound {
		t.Fatalf("release unknown: %v", err)
	}
}

func TestReRegisterDropsSessions(t *testing.T) {
	s := newTestSidecar(t)
	ctx := context.Background()
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 8, Pages: pages(2)}); err != nil {
		t.Fatal(err)
	}
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 32, NumLayers: 1, PageCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	req := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 32, PageCount: 16, NumLayers: 1}
	for i, k := range []kvcv1.KVKind{kvcv1.KVKind_KV_KIND_K, kvcv1.KVKind_KV_KIND_V} {
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: 0, Kind: k, Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	if _, err := s.RegisterKVPool(ctx, req); err != nil {
		t.Fatal(err)
	}
	if si := s.Sessions(); len(si) != 0 {
		t.Fatalf("sessions survived the worker restart: %+v", si)
	}
	// the new pool's bounds apply
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "b", CommittedLen: 8, Pages: []int64{0, 16}}); status.Code(err) != codes.OutOfRange {
		t.Fatalf("page 16 of a 16-page pool: %v", err)
	}
}

func TestReleaseCommandThenWorkerRelease(t *testing.T) {
	s := newTestSidecar(t)
	ctx := context.Background()
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "m", CommittedLen: 4, Pages: pages(1)}); err != nil {
		t.Fatal(err)
	}
	// the control plane moved the session elsewhere; the command drops it without blocking
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{SessionId: "m"}}}); err != nil {
		t.Fatal(err)
	}
	// the worker frees it later: that is not an error
	deadline := time.Now().Add(5 * time.Second)
	for len(s.Sessions()) != 0 {
		if time.Now().After(deadline) {
			t.Fatal("session not dropped")
		}
		runtime.Gosched()
	}
	if _, err := s.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "m"}); err != nil {
		t.Fatalf("worker release after the command: %v", err)
	}
	if _, err := s.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "m"}); status.Code(err) != codes.NotFound {
		t.Fatalf("second release: %v", err)
	}
}
