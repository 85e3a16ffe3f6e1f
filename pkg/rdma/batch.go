package rdma

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
)

// task is one request of a batch. Its state moves waiting → pending → a final state once; the
// final transition happens under the batch lock so Wait sees a consistent count. A task does not
// point back to its batch (its callers know it), so a batch's tasks are one pointer-free-but-err
// block that add does not have to touch.
type task struct {
	state atomic.Uint32
	bytes atomic.Uint64
	left  atomic.Int64 // slices not yet acknowledged
	err   error        // set with the final state, under b.mu
	// serr is the first error of a slice (tcp): the task fails with it once every slice has
	// been answered, so that no byte of a failed task is still on its way when Wait returns.
	serr atomic.Pointer[error]
}

func (t *task) final() bool { return TaskState(t.state.Load()).Done() }

// start marks the task in flight.
func (t *task) start() { t.state.CompareAndSwap(uint32(TaskWaiting), uint32(TaskPending)) }

// finish moves the task, which belongs to b, to a final state; it reports false when it already
// was final.
func (t *task) finish(b *batch, st TaskState, err error) bool {
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
	blocks   [][]task // one per add, in task order
	starts   []int    // index of each block's first task
	n        int      // tasks in all blocks
	pending  int
	done     chan struct{} // closed when pending reaches 0
}

// add creates n waiting tasks (TaskWaiting is the zero state) and returns them.
func (b *batch) add(n int) ([]task, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.n+n > b.capacity {
		return nil, fmt.Errorf("%w: %d tasks + %d > capacity %d", ErrBatchFull, b.n, n, b.capacity)
	}
	if n == 0 {
		return nil, nil
	}
	if b.pending == 0 {
		b.done = make(chan struct{})
	}
	block := make([]task, n)
	b.blocks = append(b.blocks, block)
	b.starts = append(b.starts, b.n)
	b.n += n
	b.pending += n
	return block, nil
}

// taskLocked returns task i, which must exist.
func (b *batch) taskLocked(i int) *task {
	k := sort.Search(len(b.starts), func(k int) bool { return b.starts[k] > i }) - 1
	return &b.blocks[k][i-b.starts[k]]
}

func statusOf(t *task) TaskStatus {
	st := TaskStatus{State: TaskState(t.state.Load()), BytesDone: t.bytes.Load()}
	if st.State.Done() {
		st.Err = t.err
	}
	return st
}

func (b *batch) status(i int) (TaskStatus, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i < 0 || i >= b.n {
		return TaskStatus{}, fmt.Errorf("%w: task %d of %d", ErrInvalidRequest, i, b.n)
	}
	return statusOf(b.taskLocked(i)), nil
}

func (b *batch) all() []TaskStatus {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]TaskStatus, 0, b.n)
	for _, blk := range b.blocks {
		for i := range blk {
			out = append(out, statusOf(&blk[i]))
		}
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
	blocks := append([][]task(nil), b.blocks...)
	b.mu.Unlock()
	for _, blk := range blocks {
		for i := range blk {
			if t := &blk[i]; !t.final() {
				t.finish(b, st, err)
			}
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
