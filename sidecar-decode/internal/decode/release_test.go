package decode

import (
	"context"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// serveBridge serves the sidecar's WorkerBridge on a real Unix socket and returns a client.
func serveBridge(t *testing.T, s *Sidecar) kvcv1.WorkerBridgeServiceClient {
	t.Helper()
	path := filepath.Join(t.TempDir(), "b.sock")
	lis, err := sidecar.ListenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpcx.NewServer(zerolog.Nop())
	kvcv1.RegisterWorkerBridgeServiceServer(srv, s)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, lis, time.Second); close(done) }()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		cancel()
		<-done
	})
	return kvcv1.NewWorkerBridgeServiceClient(conn)
}

// releasingWorker watches commands like a worker that never evicts by itself: it carries out
// each release (ReleaseSession, then acks) and records, per release, whether the sidecar's
// snapshot of the session was current at that moment.
type releasingWorker struct {
	mu       sync.Mutex
	released []string
	current  []bool
	// refuse: sessions whose release the worker refuses (a turn of theirs waits for pages)
	refuse  map[string]bool
	refused []string
}

func (rw *releasingWorker) run(t *testing.T, ctx context.Context, s *Sidecar, c kvcv1.WorkerBridgeServiceClient) {
	st, err := c.WatchCommands(ctx, &kvcv1.WatchCommandsRequest{WorkerInstance: "test-worker"})
	if err != nil {
		t.Error(err)
		return
	}
	first, err := st.Recv()
	if err != nil || first.GetAttach() == nil {
		t.Errorf("attach %v %v", first, err)
		return
	}
	if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: first.GetCommandId(), Ok: true}); err != nil {
		t.Error(err)
		return
	}
	for {
		m, err := st.Recv()
		if err != nil {
			return
		}
		id := m.GetRelease().GetSessionId()
		if m.GetReason() != kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY || id == "" {
			t.Errorf("command %v", m)
		}
		rw.mu.Lock()
		no := rw.refuse[id]
		if no {
			rw.refused = append(rw.refused, id)
		}
		rw.mu.Unlock()
		if no {
			if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: m.GetCommandId(), Error: "session " + id + " is in use by 1 turn(s) waiting for pages"}); err != nil && ctx.Err() == nil {
				t.Error(err)
			}
			continue
		}
		s.mu.Lock()
		ss := s.sessions[id]
		cur := ss != nil && ss.lastPushed == ss.committed && ss.push == nil && !ss.queued
		kv := int64(0)
		if ss != nil {
			kv = ss.committed
		}
		s.mu.Unlock()
		rw.mu.Lock()
		rw.released = append(rw.released, id)
		rw.current = append(rw.current, cur)
		rw.mu.Unlock()
		// The sidecar may finish (and the test cancel ctx) while these calls' answers are on their
		// way: the EVICTED event the test waits for is reported inside ReleaseSession.
		if _, err := c.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: id, Reason: kvcv1.ReleaseReason_RELEASE_REASON_EVICTED}); err != nil && ctx.Err() == nil {
			t.Error(err)
		}
		if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: m.GetCommandId(), Ok: true, FreedTokens: kv}); err != nil && ctx.Err() == nil {
			t.Error(err)
		}
	}
}

func TestCapacityReleaseOrder(t *testing.T) {
	s := newTestSidecar(t) // 64 pages of 4 tokens: 256 tokens
	s.rel = newReleaser(ReleaseConfig{High: 0.5, Low: 0.25, MinIdle: 5 * time.Second})
	rep := &recordingReporter{}
	s.SetReporter(rep)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveBridge(t, s)
	rw := &releasingWorker{}
	done := make(chan struct{})
	go func() { defer close(done); rw.run(t, ctx, s, c) }()
	defer func() { cancel(); <-done }()
	for !s.att.Watcher().AttachAcked {
		select {
		case <-ctx.Done():
			t.Fatal("worker never attached")
		case <-time.After(5 * time.Millisecond):
		}
	}

	now := time.Now()
	next := int64(0)
	add := func(id string, kv int64, idle time.Duration, pushed int64, target bool) {
		t.Helper()
		n := (kv + 3) / 4
		pg := make([]int64, n)
		for i := range pg {
			pg[i] = next
			next++
		}
		if target {
			if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
				SessionId: id, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: id, CommittedLen: kv, Pages: pg}); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		ss := s.sessions[id]
		ss.lastCommit = now.Add(-idle)
		ss.lastPushed = pushed // what earlier pushes (not run here) landed
		ss.queued = false
		s.queue = s.queue[:0]
		s.mu.Unlock()
	}
	// 244 of 256 tokens: above the high watermark (128); the low one is 64.
	add("a", 40, 30*time.Second, 32, true)                      // idle 30 s, snapshot behind: pushed first
	add("b", 64, 30*time.Second+time.Millisecond*300, 64, true) // idle 30 s, larger: first
	add("c", 40, 10*time.Second, 40, true)                      // idle 10 s, current
	add("d", 80, time.Second, 80, true)                         // in use (idle < 5 s): never
	add("e", 20, time.Minute, 0, false)                         // no snapshot target: never current, never
	if l := s.Load(); l.GetEvictableTokens() != 40+64+40 {
		t.Fatalf("evictable %d, want the releasable sessions' 144 (d, idle < 5 s, is not: the release will not take it)", l.GetEvictableTokens())
	}

	// b (current) goes; a needs a push first, and c, ranked after a, waits for it.
	p := s.releaseTick(ctx)
	if p.Used != 244 || !reflect.DeepEqual(p.Release, []string{"b"}) || !reflect.DeepEqual(p.Waiting, []string{"a", "c"}) {
		t.Fatalf("first pass %+v", p)
	}
	s.mu.Lock()
	aQueued, aForced := s.sessions["a"].queued, s.sessions["a"].forcePush
	s.mu.Unlock()
	if !aQueued || !aForced {
		t.Fatalf("a's push not forced into the queue (queued %v, forced %v)", aQueued, aForced)
	}
	// Still above the watermark (180): a's push has not landed, so neither a nor c goes.
	if p := s.releaseTick(ctx); len(p.Release) != 0 || !reflect.DeepEqual(p.Waiting, []string{"a", "c"}) || p.Used != 180 {
		t.Fatalf("second pass %+v", p)
	}
	// a's push lands (what pushSession does on success).
	s.mu.Lock()
	a := s.sessions["a"]
	a.lastPushed, a.queued, a.forcePush = a.committed, false, false
	s.queue = s.queue[:0]
	s.mu.Unlock()
	if p := s.releaseTick(ctx); !reflect.DeepEqual(p.Release, []string{"a", "c"}) {
		t.Fatalf("third pass %+v", p)
	}
	// 100 tokens left: below the high watermark, nothing more.
	if p := s.releaseTick(ctx); len(p.Release)+len(p.Waiting) != 0 || p.Used != 100 {
		t.Fatalf("fourth pass %+v", p)
	}
	rw.mu.Lock()
	released, current := append([]string(nil), rw.released...), append([]bool(nil), rw.current...)
	rw.mu.Unlock()
	if !reflect.DeepEqual(released, []string{"b", "a", "c"}) || !reflect.DeepEqual(current, []bool{true, true, true}) {
		t.Fatalf("released %v (snapshot current %v); want b, a, c, each current", released, current)
	}
	ev := rep.kinds(kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED)
	for _, id := range []string{"a", "b", "c"} {
		if e := ev[id]; e == nil || !strings.Contains(e.GetDetail(), "capacity release") {
			t.Fatalf("EVICTED event of %s: %v", id, e)
		}
	}
	if len(ev) != 3 {
		t.Fatalf("EVICTED events %v", ev)
	}
	if got := s.Sessions(); len(got) != 2 || got[0].SessionID != "d" || got[1].SessionID != "e" {
		t.Fatalf("left %v", got)
	}
}

func TestCapacityReleaseRefusedKeepsSession(t *testing.T) {
	s := newTestSidecar(t)
	s.rel = newReleaser(ReleaseConfig{High: 0.1, Low: 0.05, AckTimeout: 2 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "x", PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "x", CommittedLen: 40, Pages: pages(10)}); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.sessions["x"].lastPushed, s.sessions["x"].queued, s.queue = 40, false, nil
	s.mu.Unlock()
	// No watcher: the release cannot be sent and the session stays.
	if p := s.releaseTick(ctx); !reflect.DeepEqual(p.Release, []string{"x"}) || len(s.Sessions()) != 1 {
		t.Fatalf("pass %+v, sessions %v", p, s.Sessions())
	}
	s.mu.Lock()
	releasing := s.sessions["x"].releasing
	s.mu.Unlock()
	if releasing {
		t.Fatal("a release that was not sent left the session marked")
	}
	// A worker that refuses (the session is in use).
	c := serveBridge(t, s)
	st, err := c.WatchCommands(ctx, &kvcv1.WatchCommandsRequest{WorkerInstance: "w"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	go func() {
		m, err := st.Recv()
		if err == nil {
			_, _ = c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: m.GetCommandId(), Error: "session x is in use by 1 running request(s)"})
		}
	}()
	s.releaseTick(ctx)
	if len(s.Sessions()) != 1 {
		t.Fatal("a refused release dropped the session")
	}
	// In use: passed over by the next passes and not reported evictable (a turn of its own waits
	// in the worker's prealloc queue; choosing it again freed nothing), until it commits again.
	s.mu.Lock()
	p := s.planReleaseLocked(time.Now())
	s.mu.Unlock()
	if len(p.Release)+len(p.Waiting) != 0 {
		t.Fatalf("a session in use picked again: %+v", p)
	}
	if l := s.Load(); l.GetEvictableTokens() != 0 || l.GetUsedTokens() != 40 {
		t.Fatalf("load %+v: a session in use is not evictable", l)
	}
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "x", CommittedLen: 40, Pages: pages(10)}); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.sessions["x"].queued, s.queue = false, nil
	p = s.planReleaseLocked(time.Now())
	s.mu.Unlock()
	if !reflect.DeepEqual(p.Release, []string{"x"}) {
		t.Fatalf("after its commit: %+v, want x released", p)
	}
}

func TestReleaseConfigValidate(t *testing.T) {
	for _, tt := range []struct {
		c  ReleaseConfig
		ok bool
	}{
		{ReleaseConfig{}, true},
		{ReleaseConfig{High: 0.9, Low: 0.8}, true},
		{ReleaseConfig{High: 1, Low: 0}, true},
		{ReleaseConfig{High: 1.1, Low: 0.5}, false},
		{ReleaseConfig{High: -0.5}, false},
		{ReleaseConfig{High: 0.8, Low: 0.8}, false},
		{ReleaseConfig{High: 0.8, Low: -0.1}, false},
		{ReleaseConfig{High: 0.8, Low: 0.5, MinIdle: -time.Second}, false},
	} {
		if err := tt.c.Validate(); (err == nil) != tt.ok {
			t.Errorf("%+v: %v", tt.c, err)
		}
	}
}

func TestAuxRowsReachWaitReceive(t *testing.T) {
	s := newTestSidecar(t)
	ctx := context.Background()
	room := func(id int64, kind kvcv1.TransferKind) {
		s.mu.Lock()
		s.rooms[id] = &recvRoom{req: &kvcv1.PrepareReceiveRequest{Room: id, SessionId: "s", Kind: kind, Tokens: 4}, created: time.Now(), done: make(chan struct{})}
		s.mu.Unlock()
	}
	aux := [][]byte{{1, 2, 3}, {}, []byte("room-991")}
	room(1, kvcv1.TransferKind_TRANSFER_KIND_SEED)
	if _, err := s.TransferDone(ctx, &kvcv1.TransferDoneRequest{Room: 1, Ok: true, Tokens: 4, Aux: aux}); err != nil {
		t.Fatal(err)
	}
	r, err := s.WaitReceive(ctx, &kvcv1.WaitReceiveRequest{Room: 1})
	if err != nil || !r.GetOk() || !reflect.DeepEqual(r.GetAux(), aux) {
		t.Fatalf("wait %v %v", r, err)
	}
	room(2, kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT)
	if _, err := s.TransferDone(ctx, &kvcv1.TransferDoneRequest{Room: 2, Ok: true, Tokens: 4, Aux: aux}); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.WaitReceive(ctx, &kvcv1.WaitReceiveRequest{Room: 2}); r.GetOk() || len(r.GetAux()) != 0 || !strings.Contains(r.GetError(), "snapshot") {
		t.Fatalf("snapshot with aux %v", r)
	}
	room(3, kvcv1.TransferKind_TRANSFER_KIND_SEED)
	if _, err := s.TransferDone(ctx, &kvcv1.TransferDoneRequest{Room: 3, Ok: true, Tokens: 4, Aux: [][]byte{make([]byte, kvxfer.MaxAuxBytes+1)}}); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.WaitReceive(ctx, &kvcv1.WaitReceiveRequest{Room: 3}); r.GetOk() || len(r.GetAux()) != 0 || !strings.Contains(r.GetError(), "aux rows refused") {
		t.Fatalf("oversized aux %v", r)
	}
	room(4, kvcv1.TransferKind_TRANSFER_KIND_SEED)
	if _, err := s.TransferDone(ctx, &kvcv1.TransferDoneRequest{Room: 4, Ok: false, Error: "boom", Aux: aux}); err != nil {
		t.Fatal(err)
	}
	if r, _ := s.WaitReceive(ctx, &kvcv1.WaitReceiveRequest{Room: 4}); r.GetOk() || len(r.GetAux()) != 0 {
		t.Fatalf("failed room returned aux %v", r)
	}
}

// TestLastTransferDoneKicksLoad: when the last room waiting for its transfer is done (landed or
// failed), the sidecar sends a load report at once (its transfer_queue_depth back to 0, which
// the control plane's local large append waits for), not at the next heartbeat; a room done
// while another still waits sends none.
func TestLastTransferDoneKicksLoad(t *testing.T) {
	s := newTestSidecar(t)
	rep := &recordingReporter{}
	s.SetReporter(rep)
	ctx := context.Background()
	for id := int64(1); id <= 2; id++ {
		s.mu.Lock()
		s.rooms[id] = &recvRoom{req: &kvcv1.PrepareReceiveRequest{Room: id, SessionId: "s", Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Tokens: 4}, created: time.Now(), done: make(chan struct{})}
		s.mu.Unlock()
	}
	if d := s.Load().GetTransferQueueDepth(); d != 2 {
		t.Fatalf("transfer queue depth %d, want 2", d)
	}
	for _, tt := range []struct {
		room      int64
		ok        bool
		depth     int32
		wantKicks int
	}{
		{room: 1, ok: true, depth: 1, wantKicks: 0}, // room 2 still waits
		{room: 2, ok: false, depth: 0, wantKicks: 1},
	} {
		if _, err := s.TransferDone(ctx, &kvcv1.TransferDoneRequest{Room: tt.room, Ok: tt.ok, Tokens: 4, Error: map[bool]string{false: "boom"}[tt.ok]}); err != nil {
			t.Fatal(err)
		}
		if d, k := s.Load().GetTransferQueueDepth(), rep.kicked(); d != tt.depth || k != tt.wantKicks {
			t.Fatalf("after room %d: depth %d, load kicks %d; want %d, %d", tt.room, d, k, tt.depth, tt.wantKicks)
		}
	}
}

// TestCapacityReleaseAgentHints: the agent hints carried by SetSnapshotTargetCommand — a pinned
// session is never picked (nor counted evictable) while its pin holds and is picked once it
// has expired; a low-priority session is picked before any other, whatever its idle time.
func TestCapacityReleaseAgentHints(t *testing.T) {
	s := newTestSidecar(t) // 256 tokens
	s.rel = newReleaser(ReleaseConfig{High: 0.5, Low: 0.25, MinIdle: time.Second})
	ctx := context.Background()
	now := time.Now()
	next := int64(0)
	add := func(id string, kv int64, idle time.Duration, pinnedUntil time.Time, low bool) {
		t.Helper()
		tc := &kvcv1.SetSnapshotTargetCommand{SessionId: id, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1",
			TransferEndpoint: "127.0.0.1:1", Generation: 1, LowPriority: low}
		if !pinnedUntil.IsZero() {
			tc.PinnedUntilUnixMs = pinnedUntil.UnixMilli()
		}
		if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: tc}}); err != nil {
			t.Fatal(err)
		}
		pg := make([]int64, (kv+3)/4)
		for i := range pg {
			pg[i] = next
			next++
		}
		if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: id, CommittedLen: kv, Pages: pg}); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		ss := s.sessions[id]
		ss.lastCommit, ss.lastPushed, ss.queued = now.Add(-idle), kv, false
		s.queue = s.queue[:0]
		s.mu.Unlock()
	}
	// 200 of 256 tokens (high 128, low 64): 136 to free.
	add("pinned", 80, time.Hour, now.Add(time.Hour), false)         // idlest and largest, but pinned
	add("old", 40, 10*time.Minute, time.Time{}, false)              // idle 10 min
	add("low", 40, 2*time.Second, time.Time{}, true)                // barely idle, low priority: first
	add("expired", 40, 5*time.Minute, now.Add(-time.Second), false) // pin over: ranks by idle time
	if l := s.Load(); l.GetEvictableTokens() != 120 {
		t.Fatalf("evictable %d, want 120 (the pinned session's 80 tokens are not evictable)", l.GetEvictableTokens())
	}
	s.mu.Lock()
	p := s.planReleaseLocked(now)
	s.mu.Unlock()
	if want := []string{"low", "old", "expired"}; !reflect.DeepEqual(p.Release, want) || len(p.Waiting) != 0 {
		t.Fatalf("plan %+v, want release %v", p, want)
	}
	// Once the pin has passed, the pinned session is a candidate like any other.
	s.mu.Lock()
	for _, id := range p.Release {
		s.sessions[id].releasing = false
	}
	p = s.planReleaseLocked(now.Add(2 * time.Hour))
	s.mu.Unlock()
	if len(p.Release) == 0 || p.Release[1] != "pinned" && p.Release[0] != "pinned" {
		t.Fatalf("after the pin: %+v", p)
	}
}
