package worker

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/launch"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// attachSidecar is a fake sidecar with the real attach half (sidecar.Attach): what a restarted
// kvc-sidecar-* process looks like to the worker.
type attachSidecar struct {
	*fakeSidecar
	att *sidecar.Attach
	reg chan struct{}
}

func (a *attachSidecar) RegisterKVPool(ctx context.Context, req *kvcv1.RegisterKVPoolRequest) (*kvcv1.RegisterKVPoolResponse, error) {
	res, err := a.fakeSidecar.RegisterKVPool(ctx, req)
	if err == nil {
		select {
		case <-a.reg:
		default:
			close(a.reg)
		}
		a.att.PoolRegistered()
	}
	return res, err
}

func (a *attachSidecar) WatchCommands(req *kvcv1.WatchCommandsRequest, s grpc.ServerStreamingServer[kvcv1.WatchCommandsResponse]) error {
	return a.att.Watch(req, s)
}

func (a *attachSidecar) AckCommand(_ context.Context, req *kvcv1.AckCommandRequest) (*kvcv1.AckCommandResponse, error) {
	return a.att.Ack(req)
}

// serveAttachSidecar serves a fresh attach sidecar on sock until the returned stop is called.
func serveAttachSidecar(t *testing.T, h *hub, sock string) (*attachSidecar, func()) {
	t.Helper()
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	a := &attachSidecar{fakeSidecar: &fakeSidecar{h: h, name: "d"}, reg: make(chan struct{})}
	a.att = sidecar.NewAttach(func() (bool, int32) {
		select {
		case <-a.reg:
			return true, 0
		default:
			return false, 0
		}
	}, zerolog.Nop())
	srv := grpcx.NewServer(zerolog.Nop())
	kvcv1.RegisterWorkerBridgeServiceServer(srv, a)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, lis, 100*time.Millisecond); close(done) }()
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		srv.Stop() // like kill -9: streams and connections cut at once
		cancel()
		<-done
		a.mu.Lock()
		for _, m := range a.maps {
			_ = m.Close()
		}
		a.mu.Unlock()
	}
	t.Cleanup(stop)
	return a, stop
}

func waitUntil(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	launch.WaitForT(t, what, d, 5*time.Millisecond, cond)
}

// addSession makes a committed resident session of kv tokens (as a finished turn leaves it).
func addSession(t *testing.T, w *Worker, id string, kv int64) {
	t.Helper()
	n := pagesFor(kv, w.cfg.Geometry.PageSize)
	w.mu.Lock()
	pages := w.alloc.take(n)
	s := &session{id: id, pages: pages, kvLen: kv, committed: true}
	w.touch(s)
	w.sessions[id] = s
	w.mu.Unlock()
	if pages == nil {
		t.Fatalf("no %d pages for %s", n, id)
	}
}

func TestReattachAfterSidecarRestart(t *testing.T) {
	h := newHub()
	sock := filepath.Join(t.TempDir(), "b.sock")
	sc1, stop1 := serveAttachSidecar(t, h, sock)
	conn, err := grpc.NewClient("unix://"+sock, append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	g := Geometry{PageSize: 4, Layers: 2, BytesPerToken: 8, PageCount: 64}
	dir := t.TempDir()
	pool, err := CreatePool(dir, "d0", g)
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(Config{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, WorkerID: "d0", Geometry: g, Timing: zeroTiming()},
		pool, kvcv1.NewWorkerBridgeServiceClient(conn), prometheus.NewRegistry(), zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	// The pool file has no name in its directory (kill -9 leaves nothing behind).
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("pool directory holds %v", ents)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := w.RegisterPool(ctx); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "first attach", 5*time.Second, func() bool { return w.Attach().Attaches == 1 })
	if a := w.Attach(); a.Reregistrations != 0 || a.SidecarInstance != sc1.att.Instance() {
		t.Fatalf("first attach %+v (sidecar %s)", a, sc1.att.Instance())
	}
	<-sc1.att.Registered()
	addSession(t, w, "s1", 10)
	addSession(t, w, "s2", 33)
	addSession(t, w, "s3", 4)
	addSession(t, w, "s4", 8)
	w.mu.Lock()
	w.sessions["s3"].committed = false // its commit failed while the sidecar was down: nobody tracks it
	w.sessions["s4"].committed = false // a turn runs on it: the turn commits it when it finishes
	w.sessions["s4"].pinned = 1
	w.mu.Unlock()

	stop1() // the sidecar dies
	sc2, _ := serveAttachSidecar(t, h, sock)
	if sc2.att.Instance() == sc1.att.Instance() {
		t.Fatal("same instance id after a restart")
	}
	start := time.Now()
	select {
	case <-sc2.att.Registered():
	case <-time.After(5 * time.Second):
		t.Fatalf("restarted sidecar not ready within 5s: %s", sc2.att.WaitingFor())
	}
	t.Logf("re-attached in %v", time.Since(start))
	commits, _ := sc2.snapshotOf()
	got := map[string]int64{}
	for _, c := range commits {
		got[c.GetSessionId()] = c.GetCommittedLen()
		if int64(len(c.GetPages())) != pagesFor(c.GetCommittedLen(), g.PageSize) {
			t.Fatalf("re-commit of %s: %d pages for %d tokens", c.GetSessionId(), len(c.GetPages()), c.GetCommittedLen())
		}
	}
	// issue 23 item 6: s3, which no sidecar knew, is adopted (committed to the new sidecar,
	// which reports it to the control plane); the running turn's s4 is left to its turn.
	if len(got) != 3 || got["s1"] != 10 || got["s2"] != 33 || got["s3"] != 4 {
		t.Fatalf("re-committed %v; want s1:10 s2:33 s3:4", got)
	}
	w.mu.Lock()
	adopted, running := w.sessions["s3"].committed, w.sessions["s4"].committed
	w.mu.Unlock()
	if !adopted || running {
		t.Fatalf("committed flags after the re-attach: s3 %v (want true), s4 %v (want false)", adopted, running)
	}
	if a := w.Attach(); a.Reregistrations != 1 || a.SidecarInstance != sc2.att.Instance() || !sc2.att.Watcher().AttachAcked {
		t.Fatalf("after restart %+v, watcher %+v", a, sc2.att.Watcher())
	}
}

func TestReleaseCommand(t *testing.T) {
	h := newHub()
	sock := filepath.Join(t.TempDir(), "b.sock")
	sc, _ := serveAttachSidecar(t, h, sock)
	conn, err := grpc.NewClient("unix://"+sock, append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	g := Geometry{PageSize: 4, Layers: 2, BytesPerToken: 8, PageCount: 64}
	pool, err := CreatePool(t.TempDir(), "d0", g)
	if err != nil {
		t.Fatal(err)
	}
	w, err := New(Config{Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, WorkerID: "d0", Geometry: g, Timing: zeroTiming()},
		pool, kvcv1.NewWorkerBridgeServiceClient(conn), prometheus.NewRegistry(), zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := w.RegisterPool(ctx); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, "attach", 5*time.Second, func() bool { return sc.att.Watcher().AttachAcked })
	addSession(t, w, "idle", 30)
	addSession(t, w, "busy", 8)
	w.mu.Lock()
	w.sessions["busy"].pinned = 1
	free := w.alloc.available()
	w.mu.Unlock()

	release := func(id string) *kvcv1.AckCommandRequest {
		t.Helper()
		ack, err := sc.att.Send(ctx, &kvcv1.WatchCommandsResponse{Reason: kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY,
			Command: &kvcv1.WatchCommandsResponse_Release{Release: &kvcv1.WorkerReleaseCommand{SessionId: id}}})
		if err != nil {
			t.Fatal(err)
		}
		return ack
	}
	if ack := release("idle"); !ack.GetOk() || ack.GetFreedTokens() != 30 {
		t.Fatalf("release idle: %v", ack)
	}
	if ack := release("busy"); ack.GetOk() || ack.GetError() == "" {
		t.Fatalf("release of a session in use: %v", ack)
	}
	if ack := release("nope"); ack.GetOk() {
		t.Fatalf("release of an unknown session: %v", ack)
	}
	w.mu.Lock()
	_, idleThere := w.sessions["idle"]
	_, busyThere := w.sessions["busy"]
	freed := w.alloc.available() - free
	w.mu.Unlock()
	if idleThere || !busyThere || freed != pagesFor(30, g.PageSize) {
		t.Fatalf("idle resident %v, busy resident %v, %d pages freed", idleThere, busyThere, freed)
	}
	_, rels := sc.snapshotOf()
	if len(rels) != 1 || rels[0].GetSessionId() != "idle" || rels[0].GetReason() != kvcv1.ReleaseReason_RELEASE_REASON_EVICTED {
		t.Fatalf("ReleaseSession calls %v", rels)
	}
}
