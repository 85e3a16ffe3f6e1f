package kvxfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// ErrAborted reports a transfer canceled by its owner (for example, a session released mid-push).
var ErrAborted = errors.New("transfer aborted")

// cancelGrace bounds how long Transfer waits for canceled tasks to settle.
const cancelGrace = 30 * time.Second

// Transfer submits reqs as one batch and waits for all of them. When ctx ends first it cancels
// the batch and waits until no task is in flight any more before returning, so that when it
// returns no request still reads or writes the memory involved. It returns the bytes moved.
func Transfer(ctx context.Context, eng rdma.Engine, reqs []rdma.Request) (uint64, error) {
	if len(reqs) == 0 {
		return 0, nil
	}
	b, err := eng.AllocateBatch(len(reqs))
	if err != nil {
		return 0, fmt.Errorf("allocate batch: %w", err)
	}
	if err := eng.Submit(ctx, b, reqs); err != nil {
		settle(eng, b)
		return 0, fmt.Errorf("submit: %w", err)
	}
	sts, werr := eng.Wait(ctx, b)
	if werr != nil || ctx.Err() != nil {
		sts = settle(eng, b)
		var moved uint64
		for _, s := range sts {
			moved += s.BytesDone
		}
		if ctx.Err() != nil {
			return moved, fmt.Errorf("%w: %v", ErrAborted, context.Cause(ctx))
		}
		return moved, fmt.Errorf("wait: %w", werr)
	}
	var moved uint64
	var firstErr error
	for i, s := range sts {
		moved += s.BytesDone
		if s.State != rdma.TaskCompleted && firstErr == nil {
			firstErr = fmt.Errorf("task %d %s: %v", i, s.State, s.Err)
		}
	}
	_ = eng.FreeBatch(b)
	return moved, firstErr
}

// settle cancels b, waits for every task to be final and frees it.
func settle(eng rdma.Engine, b rdma.BatchID) []rdma.TaskStatus {
	_ = eng.Cancel(b)
	ctx, cancel := context.WithTimeout(context.Background(), cancelGrace)
	defer cancel()
	sts, _ := eng.Wait(ctx, b)
	_ = eng.FreeBatch(b)
	return sts
}

// Segments caches opened peer segments by name.
type Segments struct {
	eng rdma.Engine
	mu  sync.Mutex
	ids map[string]rdma.SegmentID
}

// NewSegments builds a cache over eng.
func NewSegments(eng rdma.Engine) *Segments {
	return &Segments{eng: eng, ids: map[string]rdma.SegmentID{}}
}

// Open returns the segment of name, opening (handshaking) it the first time or after Forget.
func (s *Segments) Open(ctx context.Context, name string) (rdma.SegmentID, error) {
	if name == "" {
		return 0, errors.New("empty transfer endpoint")
	}
	s.mu.Lock()
	id, ok := s.ids[name]
	s.mu.Unlock()
	if ok {
		return id, nil
	}
	id, err := s.eng.OpenSegment(ctx, name)
	if err != nil {
		return 0, fmt.Errorf("open segment %s: %w", name, err)
	}
	s.mu.Lock()
	if old, ok := s.ids[name]; ok {
		s.mu.Unlock()
		_ = s.eng.CloseSegment(id)
		return old, nil
	}
	s.ids[name] = id
	s.mu.Unlock()
	return id, nil
}

// Forget closes name's segment so that the next Open handshakes again (after a failure).
func (s *Segments) Forget(name string) {
	s.mu.Lock()
	id, ok := s.ids[name]
	delete(s.ids, name)
	s.mu.Unlock()
	if ok {
		_ = s.eng.CloseSegment(id)
	}
}

// Peers caches gRPC connections to other sidecars' TransferPeerService.
type Peers struct {
	mu    sync.Mutex
	conns map[string]*grpc.ClientConn
	opts  []grpc.DialOption
}

// NewPeers builds an empty cache; extra dial options (credentials) may be given.
func NewPeers(opts ...grpc.DialOption) *Peers {
	o := append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	return &Peers{conns: map[string]*grpc.ClientConn{}, opts: append(o, opts...)}
}

// Client returns a TransferPeerService client for addr.
func (p *Peers) Client(addr string) (kvcv1.TransferPeerServiceClient, error) {
	if addr == "" {
		return nil, errors.New("empty peer address")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.conns[addr]; ok {
		return kvcv1.NewTransferPeerServiceClient(c), nil
	}
	c, err := grpc.NewClient(addr, p.opts...)
	if err != nil {
		return nil, fmt.Errorf("dial peer %s: %w", addr, err)
	}
	p.conns[addr] = c
	return kvcv1.NewTransferPeerServiceClient(c), nil
}

// Close closes every connection.
func (p *Peers) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for a, c := range p.conns {
		_ = c.Close()
		delete(p.conns, a)
	}
}
