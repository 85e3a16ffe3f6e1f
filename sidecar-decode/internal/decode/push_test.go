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
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
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

// readyEngine gives a tcp engine a ReadyEvent, like the cuda engine's, and holds every Wait
// until waitGate is closed: a push that sent its commit only after the copy completed would
// never get past Wait.
type readyEngine struct {
	rdma.Engine
	waitGate chan struct{}
	readyErr error

	mu       sync.Mutex
	readies  int
	released int
}

func (r *readyEngine) ReadyEvent(batches ...rdma.BatchID) ([]byte, func(), error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.readyErr != nil {
		return nil, nil, r.readyErr
	}
	r.readies++
	h := make([]byte, rdma.ReadyEventSize)
	h[0] = byte(len(batches))
	return h, func() { r.mu.Lock(); r.released++; r.mu.Unlock() }, nil
}

func (r *readyEngine) Wait(ctx context.Context, b rdma.BatchID) ([]rdma.TaskStatus, error) {
	select {
	case <-r.waitGate:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return r.Engine.Wait(ctx, b)
}

// readyStore is a snapshot store's TransferPeerService over a real arena: it records the
// commit's ready event and opens the engine's waits when the commit arrives.
type readyStore struct {
	kvcv1.UnimplementedTransferPeerServiceServer
	endpoint  string
	layout    *kvcv1.KVLayout
	commitErr error
	onCommit  func()

	mu     sync.Mutex
	events [][]byte
	log    []string
}

func (f *readyStore) ReserveSnapshot(_ context.Context, req *kvcv1.ReserveSnapshotRequest) (*kvcv1.ReserveSnapshotResponse, error) {
	f.mu.Lock()
	f.log = append(f.log, "reserve")
	f.mu.Unlock()
	return &kvcv1.ReserveSnapshotResponse{IngestId: 7, StoreLayout: f.layout, Pages: []int64{3, 4}, StoreTransferEndpoint: f.endpoint}, nil
}

func (f *readyStore) CommitSnapshot(_ context.Context, req *kvcv1.CommitSnapshotRequest) (*kvcv1.CommitSnapshotResponse, error) {
	f.mu.Lock()
	f.log = append(f.log, "commit")
	f.events = append(f.events, req.GetReadyEvent())
	f.mu.Unlock()
	f.onCommit()
	if f.commitErr != nil {
		return nil, f.commitErr
	}
	return &kvcv1.CommitSnapshotResponse{Seqlen: 8}, nil
}

func (f *readyStore) AbortSnapshot(context.Context, *kvcv1.AbortSnapshotRequest) (*kvcv1.AbortSnapshotResponse, error) {
	f.mu.Lock()
	f.log = append(f.log, "abort")
	f.mu.Unlock()
	return &kvcv1.AbortSnapshotResponse{}, nil
}

// TestPushCommitOverlapsCopy: with an engine that has ready events, the push sends its commit,
// carrying the event, before it waits for the copy; the bytes land; a failed commit is the
// push's error and aborts the reservation; no ready event means the commit follows the copy.
func TestPushCommitOverlapsCopy(t *testing.T) {
	tests := []struct {
		name      string
		readyErr  error
		commitErr error
		wantLog   string
		wantEvent bool
	}{
		{"overlapped", nil, nil, "reserve,commit", true},
		{"commit refused", nil, status.Error(codes.Aborted, "ready event: boom"), "reserve,commit,abort", true},
		{"no ready event", errors.New("no event"), nil, "reserve,commit", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			re := &readyEngine{waitGate: make(chan struct{}), readyErr: tt.readyErr}
			if tt.readyErr != nil {
				close(re.waitGate) // the commit follows the copy: the waits must pass
			}
			s := newTestSidecarWith(t, func(e rdma.Engine) rdma.Engine { re.Engine = e; return re })
			pool, err := s.registeredPool()
			if err != nil {
				t.Fatal(err)
			}
			for b := 0; b < pool.Buffers(); b++ {
				for i := range pool.Buffer(b) {
					pool.Buffer(b)[i] = byte(i*7 + b + 1)
				}
			}
			storeEng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = storeEng.Close() })
			store, err := kvxfer.NewArena(kvxfer.Shape{PageSize: 4, ItemLen: 32, PageCount: 16, NumLayers: 1})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { store.Close() })
			if err := store.Register(storeEng, "host"); err != nil {
				t.Fatal(err)
			}
			var once sync.Once
			f := &readyStore{endpoint: storeEng.SegmentName(), layout: store.Layout(), commitErr: tt.commitErr,
				onCommit: func() {
					if tt.readyErr == nil {
						once.Do(func() { close(re.waitGate) })
					}
				}}
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

			job := pushJob{session: "s", gen: 1, base: 0, end: 8, pages: []int64{5, 9},
				target: &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: "p", PeerAddr: lis.Addr().String(), Generation: 1}}
			var ph sidecar.PushPhases
			done := make(chan error, 1)
			go func() {
				_, _, err := s.pushOnce(context.Background(), pool, job, &ph)
				done <- err
			}()
			select {
			case err = <-done:
			case <-time.After(20 * time.Second):
				t.Fatal("push did not finish: the commit did not go out before the wait")
			}
			if (tt.commitErr == nil) != (err == nil) {
				t.Fatalf("push: %v, commit error %v", err, tt.commitErr)
			}
			f.mu.Lock()
			log, events := strings.Join(f.log, ","), f.events
			f.mu.Unlock()
			if log != tt.wantLog {
				t.Fatalf("store saw %s, want %s", log, tt.wantLog)
			}
			if len(events) != 1 || (len(events[0]) == rdma.ReadyEventSize) != tt.wantEvent {
				t.Fatalf("commit ready events %d (%v), want one with an event: %v", len(events), events, tt.wantEvent)
			}
			re.mu.Lock()
			if tt.wantEvent && (re.readies != 1 || re.released != 1) {
				t.Fatalf("ready events %d recorded, %d released", re.readies, re.released)
			}
			re.mu.Unlock()
			if err != nil {
				return
			}
			// tokens 0..7 of pages 5, 9 landed in store pages 3, 4
			for b := 0; b < pool.Buffers(); b++ {
				for p, sp := range []int64{5, 9} {
					src := pool.Buffer(b)[sp*4*32/4:][:4*32/4]
					dst := store.Buffer(b)[int64(3+p)*4*32/4:][:4*32/4]
					if string(src) != string(dst) {
						t.Fatalf("buffer %d page %d: bytes differ", b, p)
					}
				}
			}
		})
	}
}
