package decode

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// slowAbortStore is a snapshot store's TransferPeerService that, like the real store, refuses a
// reservation while the session has one in flight, and whose AbortSnapshot holds until the test
// opens gate. Its layout points outside its engine's memory, so every transfer into it fails
// after a successful reservation.
type slowAbortStore struct {
	kvcv1.UnimplementedTransferPeerServiceServer
	endpoint     string
	abortStarted chan struct{}
	gate         chan struct{}

	mu       sync.Mutex
	inflight map[string]uint64
	next     uint64
	log      []string
}

func (f *slowAbortStore) record(s string) {
	f.mu.Lock()
	f.log = append(f.log, s)
	f.mu.Unlock()
}

func (f *slowAbortStore) ReserveSnapshot(_ context.Context, req *kvcv1.ReserveSnapshotRequest) (*kvcv1.ReserveSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if id, ok := f.inflight[req.GetSessionId()]; ok {
		f.log = append(f.log, "reserve refused")
		return nil, status.Errorf(codes.Aborted, "session %s already has ingest %d in flight", req.GetSessionId(), id)
	}
	f.next++
	f.inflight[req.GetSessionId()] = f.next
	f.log = append(f.log, "reserve")
	lay := &kvcv1.KVLayout{PageSize: 4, ItemLen: 32, NumLayers: 1, PageCount: 64, BufferAddrs: []uint64{1 << 50, 1<<50 + 1<<20}}
	return &kvcv1.ReserveSnapshotResponse{IngestId: f.next, StoreLayout: lay, Pages: []int64{0, 1}, StoreTransferEndpoint: f.endpoint}, nil
}

func (f *slowAbortStore) AbortSnapshot(ctx context.Context, req *kvcv1.AbortSnapshotRequest) (*kvcv1.AbortSnapshotResponse, error) {
	select {
	case f.abortStarted <- struct{}{}:
	default:
	}
	select {
	case <-f.gate:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for s, id := range f.inflight {
		if id == req.GetIngestId() {
			delete(f.inflight, s)
		}
	}
	f.log = append(f.log, "abort")
	return &kvcv1.AbortSnapshotResponse{}, nil
}

// TestRetryWaitsForAbort: a push whose transfer fails after its reservation is retried only
// once the store has dropped the reservation, so the retry's reserve is never refused with
// "already has ingest N in flight"; both attempts report the transfer's own error.
func TestRetryWaitsForAbort(t *testing.T) {
	s := newTestSidecar(t)
	pool, err := s.registeredPool()
	if err != nil {
		t.Fatal(err)
	}
	storeEng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = storeEng.Close() })
	f := &slowAbortStore{endpoint: storeEng.SegmentName(), abortStarted: make(chan struct{}, 1), gate: make(chan struct{}), inflight: map[string]uint64{}}
	srv := grpcx.NewServer(zerolog.Nop())
	kvcv1.RegisterTransferPeerServiceServer(srv, f)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(ctx, lis, time.Second) }()
	t.Cleanup(func() { cancel(); <-served })

	job := pushJob{session: "s", gen: 1, base: 0, end: 8, pages: []int64{0, 1},
		target: &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: "p", PeerAddr: lis.Addr().String(), Generation: 1}}
	done := make(chan error, 1)
	go func() {
		_, err := s.doPush(context.Background(), pool, job)
		done <- err
	}()
	select {
	case <-f.abortStarted: // the first attempt failed and is aborting its reservation
	case <-time.After(20 * time.Second):
		t.Fatal("the failed attempt did not abort its reservation")
	}
	close(f.gate)
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("push did not finish")
	}
	if err == nil || strings.Contains(err.Error(), "in flight") || !errors.Is(err, rdma.ErrOutOfBounds) && !strings.Contains(err.Error(), "task") {
		t.Fatalf("push error %v; want the transfer's own failure", err)
	}
	f.mu.Lock()
	got := strings.Join(f.log, ",")
	f.mu.Unlock()
	if got != "reserve,abort,reserve,abort" {
		t.Fatalf("store saw %s", got)
	}
}

func TestPendingAborts(t *testing.T) {
	var p pendingAborts
	if err := p.wait(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	first := p.start("a")
	second := p.start("a")
	short, cancel := context.WithCancelCause(context.Background())
	cancel(errors.New("gave up"))
	if err := p.wait(short, "a"); err == nil || err.Error() != "gave up" {
		t.Fatalf("wait with a running abort and an ended context: %v", err)
	}
	if err := p.wait(context.Background(), "b"); err != nil {
		t.Fatalf("another session waited: %v", err)
	}
	secondDone := make(chan struct{})
	go func() { second(); close(secondDone) }() // finishes only after the first
	select {
	case <-secondDone:
		t.Fatal("a later abort finished before an earlier one")
	default:
	}
	first()
	<-secondDone
	if err := p.wait(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	n := len(p.m)
	p.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d aborts still tracked", n)
	}
}
