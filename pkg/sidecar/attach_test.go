package sidecar

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/obs"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type attachBridge struct {
	kvcv1.UnimplementedWorkerBridgeServiceServer
	att *Attach
}

func (b *attachBridge) WatchCommands(req *kvcv1.WatchCommandsRequest, s grpc.ServerStreamingServer[kvcv1.WatchCommandsResponse]) error {
	return b.att.Watch(req, s)
}

func (b *attachBridge) AckCommand(_ context.Context, req *kvcv1.AckCommandRequest) (*kvcv1.AckCommandResponse, error) {
	return b.att.Ack(req)
}

// serveAttach serves an Attach over a real Unix-socket gRPC bridge and returns a client.
func serveAttach(t *testing.T, att *Attach) kvcv1.WorkerBridgeServiceClient {
	t.Helper()
	path := filepath.Join(t.TempDir(), "b.sock")
	lis, err := ListenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpcx.NewServer(zerolog.Nop())
	kvcv1.RegisterWorkerBridgeServiceServer(srv, &attachBridge{att: att})
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

func TestAttachProtocol(t *testing.T) {
	var pool atomic.Bool
	att := NewAttach(func() (bool, int32) { return pool.Load(), 7 }, zerolog.Nop())
	c := serveAttach(t, att)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	if w := att.WaitingFor(); w != "waiting for worker to register its KV pool (no watcher connected)" {
		t.Fatalf("waiting for %q", w)
	}
	if _, err := att.Send(ctx, &kvcv1.WatchCommandsResponse{}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("send without watcher: %v", err)
	}
	s1, err := c.WatchCommands(ctx, &kvcv1.WatchCommandsRequest{WorkerInstance: "w-1"})
	if err != nil {
		t.Fatal(err)
	}
	m, err := s1.Recv()
	if err != nil {
		t.Fatal(err)
	}
	st := m.GetAttach()
	if st == nil || st.GetSidecarInstance() != att.Instance() || st.GetPoolRegistered() || st.GetResidentSessions() != 7 || len(att.Instance()) != 16 {
		t.Fatalf("first message %v", m)
	}
	if w := att.WaitingFor(); !strings.Contains(w, "register its KV pool (worker w-1 watching since") {
		t.Fatalf("waiting for %q", w)
	}
	// The pool registers; readiness waits for the attach ack (the worker re-commits first).
	pool.Store(true)
	att.PoolRegistered()
	select {
	case <-att.Registered():
		t.Fatal("ready before the worker acknowledged its attach status")
	default:
	}
	if w := att.WaitingFor(); !strings.Contains(w, "re-commit") {
		t.Fatalf("waiting for %q", w)
	}
	if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: 999}); status.Code(err) != codes.NotFound {
		t.Fatalf("unknown ack: %v", err)
	}
	if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: m.GetCommandId(), Ok: true}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-att.Registered():
	case <-time.After(5 * time.Second):
		t.Fatal("not ready after the attach ack")
	}
	if att.WaitingFor() != "" || !att.Watcher().AttachAcked || att.Watcher().WorkerInstance != "w-1" {
		t.Fatalf("after ack: %q %+v", att.WaitingFor(), att.Watcher())
	}

	// A command and its ack.
	type res struct {
		ack *kvcv1.AckCommandRequest
		err error
	}
	rc := make(chan res, 1)
	go func() {
		a, err := att.Send(ctx, &kvcv1.WatchCommandsResponse{Reason: kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY,
			Command: &kvcv1.WatchCommandsResponse_Release{Release: &kvcv1.WorkerReleaseCommand{SessionId: "s1"}}})
		rc <- res{a, err}
	}()
	cmd, err := s1.Recv()
	if err != nil || cmd.GetRelease().GetSessionId() != "s1" || cmd.GetReason() != kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY {
		t.Fatalf("command %v %v", cmd, err)
	}
	if _, err := c.AckCommand(ctx, &kvcv1.AckCommandRequest{CommandId: cmd.GetCommandId(), Ok: true, FreedTokens: 42}); err != nil {
		t.Fatal(err)
	}
	if r := <-rc; r.err != nil || r.ack.GetFreedTokens() != 42 {
		t.Fatalf("send: %v %v", r.ack, r.err)
	}

	// A newer watcher replaces the older stream (ABORTED); its attach says the pool is held.
	s2, err := c.WatchCommands(ctx, &kvcv1.WatchCommandsRequest{WorkerInstance: "w-2"})
	if err != nil {
		t.Fatal(err)
	}
	m2, err := s2.Recv()
	if err != nil || !m2.GetAttach().GetPoolRegistered() || m2.GetCommandId() == m.GetCommandId() {
		t.Fatalf("second attach %v %v", m2, err)
	}
	if _, err := s1.Recv(); status.Code(err) != codes.Aborted {
		t.Fatalf("replaced stream: %v", err)
	}
	if att.Watcher().WorkerInstance != "w-2" {
		t.Fatalf("watcher %+v", att.Watcher())
	}
	// A command whose watcher goes away fails instead of hanging.
	go func() {
		a, err := att.Send(ctx, &kvcv1.WatchCommandsResponse{Command: &kvcv1.WatchCommandsResponse_Release{Release: &kvcv1.WorkerReleaseCommand{SessionId: "s2"}}})
		rc <- res{a, err}
	}()
	if _, err := s2.Recv(); err != nil {
		t.Fatal(err)
	}
	s3, err := c.WatchCommands(ctx, &kvcv1.WatchCommandsRequest{WorkerInstance: "w-3"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s3.Recv(); err != nil {
		t.Fatal(err)
	}
	if r := <-rc; status.Code(r.err) != codes.Unavailable {
		t.Fatalf("send whose watcher was replaced: %v %v", r.ack, r.err)
	}
	// Shutting down ends the stream at once (the bridge's graceful stop does not wait for it).
	att.Close()
	if _, err := s3.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("stream after Close: %v", err)
	}
	long := strings.Repeat("x", maxWorkerInstance+1)
	s4, err := c.WatchCommands(ctx, &kvcv1.WatchCommandsRequest{WorkerInstance: long})
	if err == nil {
		_, err = s4.Recv()
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("long instance: %v", err)
	}
}

func TestAttachReadyWithoutWatcher(t *testing.T) {
	att := NewAttach(func() (bool, int32) { return true, 0 }, zerolog.Nop())
	att.PoolRegistered() // a worker that never watches (an older client): ready at once
	select {
	case <-att.Registered():
	default:
		t.Fatal("not ready")
	}
	if NewAttach(nil, zerolog.Nop()).Instance() == att.Instance() {
		t.Fatal("instance ids repeat")
	}
}

func TestReadyzSaysWhy(t *testing.T) {
	var ready obs.Ready
	next := http.NewServeMux()
	next.HandleFunc("GET /other", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "other") })
	srv := httptest.NewServer(readyzHandler(next, &ready, func() string { return "waiting for worker to register its KV pool (no watcher connected)" }))
	defer srv.Close()
	get := func(p string) (int, string) {
		resp, err := http.Get(srv.URL + p)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/readyz"); code != 503 || body != "not ready: waiting for worker to register its KV pool (no watcher connected)\n" {
		t.Fatalf("%d %q", code, body)
	}
	ready.Set(true)
	if code, body := get("/readyz"); code != 200 || body != "ready\n" {
		t.Fatalf("%d %q", code, body)
	}
	if code, body := get("/other"); code != 200 || body != "other" {
		t.Fatalf("%d %q", code, body)
	}
}
