package rdma

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
)

// task is one request of a batch. Its state moves waiting → pending → a final state once; the
// final transition happens under the batch lock so Wait sees a consistent count.
type task struct {
	b     *batch
	state atomic.Uint32
	bytes atomic.Uint64
	left  atomic.Int64 // slices not yet acknowledged
	err   error        // set with the final state, under b.mu
}

func (t *task) final() bool { return TaskState(t.state.Load()).Done() }

// start marks the task in flight.
func (t *task) start() { t.state.CompareAndSwap(uint32(TaskWaiting), uint32(TaskPending)) }

// finish moves the task to a final state; it reports false when it already was final.
func (t *task) finish(st TaskState, err error) bool {
	b := t.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if t.final() {
		return false
	}
	t.err = err
	t.state.Store(uint32(st))
	b.pending--
	if b.pending == 0 {
		close(b.done)
	}
	return true
}

type batch struct {
	capacity int
	mu       sync.Mutex
	tasks    []*task
	pending  int
	done     chan struct{} // closed when pending reaches 0
}

// add creates n waiting tasks.
func (b *batch) add(n int) ([]*task, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.tasks)+n > b.capacity {
		return nil, fmt.Errorf("%w: %d tasks + %d > capacity %d", ErrBatchFull, len(b.tasks), n, b.capacity)
	}
	if n > 0 && b.pending == 0 {
		b.done = make(chan struct{})
	}
	if b.tasks == nil {
		b.tasks = make([]*task, 0, n)
	}
	block := make([]task, n)
	for i := range block {
		block[i].b = b
		b.tasks = append(b.tasks, &block[i])
	}
	b.pending += n
	// Callers only read the returned slice; a later add may move b.tasks but not these pointers.
	return b.tasks[len(b.tasks)-n:], nil
}

func (b *batch) statusLocked(t *task) TaskStatus {
	st := TaskStatus{State: TaskState(t.state.Load()), BytesDone: t.bytes.Load()}
	if st.State.Done() {
		st.Err = t.err
	}
	return st
}

func (b *batch) status(i int) (TaskStatus, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i < 0 || i >= len(b.tasks) {
		return TaskStatus{}, fmt.Errorf("%w: task %d of %d", ErrInvalidRequest, i, len(b.tasks))
	}
	return b.statusLocked(b.tasks[i]), nil
}

func (b *batch) all() []TaskStatus {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]TaskStatus, len(b.tasks))
	for i, t := range b.tasks {
		out[i] = b.statusLocked(t)
	}
	return out
}

func (b *batch) wait(ctx context.Context) ([]TaskStatus, error) {
	b.mu.Lock()
	ch, pending := b.done, b.pending
	b.mu.Unlock()
	if pending > 0 {
		select {
		case <-ch:
		case <-ctx.Done():
			return b.all(), ctx.Err()
		}
	}
	return b.all(), nil
}

// cancel finishes every task that is not final.
func (b *batch) cancel(st TaskState, err error) {
	b.mu.Lock()
	tasks := append([]*task(nil), b.tasks...)
	b.mu.Unlock()
	for _, t := range tasks {
		if !t.final() {
			t.finish(st, err)
		}
	}
}

// batchTable holds an engine's batches.
type batchTable struct {
	mu   sync.Mutex
	next BatchID
	m    map[BatchID]*batch
}

func (bt *batchTable) allocate(capacity int) (BatchID, error) {
	if capacity <= 0 {
		return 0, fmt.Errorf("%w: batch capacity %d", ErrInvalidRequest, capacity)
	}
	bt.mu.Lock()
	defer bt.mu.Unlock()
	if bt.m == nil {
		bt.m = map[BatchID]*batch{}
	}
	bt.next++
	bt.m[bt.next] = &batch{capacity: capacity, done: make(chan struct{})}
	return bt.next, nil
}

func (bt *batchTable) get(id BatchID) (*batch, error) {
	bt.mu.Lock()
	defer bt.mu.Unlock()
	b, ok := bt.m[id]
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownBatch, id)
	}
	return b, nil
}

func (bt *batchTable) free(id BatchID) error {
	bt.mu.Lock()
	defer bt.mu.Unlock()
	b, ok := bt.m[id]
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownBatch, id)
	}
	b.mu.Lock()
	pending := b.pending
	b.mu.Unlock()
	if pending > 0 {
		return fmt.Errorf("%w: %d of batch %d", ErrBatchBusy, pending, id)
	}
	delete(bt.m, id)
	return nil
}

// failAll fails every unfinished task of every batch (engine shutdown).
func (bt *batchTable) failAll(err error) {
	bt.mu.Lock()
	bs := make([]*batch, 0, len(bt.m))
	for _, b := range bt.m {
		bs = append(bs, b)
	}
	bt.mu.Unlock()
	for _, b := range bs {
		b.cancel(TaskFailed, err)
	}
}
