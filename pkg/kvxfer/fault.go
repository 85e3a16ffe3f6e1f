package kvxfer

import (
	"context"
	"sync"
	"time"

	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// SlowEngine wraps an engine for fault injection: the requests of a batch are submitted to the
// real engine one at a time, each after Delay, so that a transfer can be caught (and canceled)
// in the middle. Canceled requests that were not submitted yet never touch memory.
type SlowEngine struct {
	rdma.Engine
	Delay time.Duration

	mu      sync.Mutex
	batches map[rdma.BatchID]*slowBatch
}

type slowBatch struct {
	n        int
	canceled chan struct{}
	once     sync.Once
	done     chan struct{} // closed when the feeder goroutine stops submitting
	mu       sync.Mutex
	sent     int
}

// NewSlowEngine wraps eng.
func NewSlowEngine(eng rdma.Engine, delay time.Duration) *SlowEngine {
	return &SlowEngine{Engine: eng, Delay: delay, batches: map[rdma.BatchID]*slowBatch{}}
}

func (s *SlowEngine) batch(b rdma.BatchID) *slowBatch {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, ok := s.batches[b]
	if !ok {
		sb = &slowBatch{canceled: make(chan struct{}), done: make(chan struct{})}
		close(sb.done)
		s.batches[b] = sb
	}
	return sb
}

// Submit starts feeding reqs to the real engine, one per Delay.
func (s *SlowEngine) Submit(ctx context.Context, b rdma.BatchID, reqs []rdma.Request) error {
	sb := &slowBatch{n: len(reqs), canceled: make(chan struct{}), done: make(chan struct{})}
	s.mu.Lock()
	s.batches[b] = sb
	s.mu.Unlock()
	go func() {
		defer close(sb.done)
		for _, r := range reqs {
			t := time.NewTimer(s.Delay)
			select {
			case <-sb.canceled:
				t.Stop()
				return
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			sb.mu.Lock()
			select {
			case <-sb.canceled:
				sb.mu.Unlock()
				return
			default:
			}
			err := s.Engine.Submit(ctx, b, []rdma.Request{r})
			if err == nil {
				sb.sent++
			}
			sb.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	return nil
}

// Wait waits for the feeder, then for the submitted tasks; unsent tasks read as canceled.
func (s *SlowEngine) Wait(ctx context.Context, b rdma.BatchID) ([]rdma.TaskStatus, error) {
	sb := s.batch(b)
	select {
	case <-sb.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	sb.mu.Lock()
	sent := sb.sent
	sb.mu.Unlock()
	var sts []rdma.TaskStatus
	if sent > 0 {
		var err error
		sts, err = s.Engine.Wait(ctx, b)
		if err != nil {
			return sts, err
		}
	}
	for len(sts) < sb.n {
		sts = append(sts, rdma.TaskStatus{State: rdma.TaskCanceled})
	}
	return sts, nil
}

// Cancel stops the feeder (no further request touches memory) and cancels submitted tasks.
func (s *SlowEngine) Cancel(b rdma.BatchID) error {
	sb := s.batch(b)
	sb.once.Do(func() {
		sb.mu.Lock()
		close(sb.canceled)
		sb.mu.Unlock()
	})
	return s.Engine.Cancel(b)
}

// FreeBatch forgets the batch and frees it in the real engine.
func (s *SlowEngine) FreeBatch(b rdma.BatchID) error {
	sb := s.batch(b)
	<-sb.done
	s.mu.Lock()
	delete(s.batches, b)
	s.mu.Unlock()
	return s.Engine.FreeBatch(b)
}
