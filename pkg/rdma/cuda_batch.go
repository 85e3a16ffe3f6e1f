package rdma

import (
	"context"
	"fmt"
)

// cudaPrealloc is the most task slots AllocateBatch allocates ahead (12 bytes each); a batch
// declared larger grows in Submit.
const cudaPrealloc = 1 << 20

// AllocateBatch implements Engine.
func (e *CUDAEngine) AllocateBatch(capacity int) (BatchID, error) {
	if capacity <= 0 {
		return 0, fmt.Errorf("%w: batch capacity %d", ErrInvalidRequest, capacity)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return 0, ErrClosed
	}
	id := e.nextBatch
	e.nextBatch++
	// The task slots are allocated here, outside Submit (whose first copy should start as soon
	// as possible), as Mooncake allocates its task list with the batch.
	e.batches[id] = &cudaBatch{cap: capacity, errs: map[int]error{}, canceled: map[int32]bool{},
		lens: make([]uint64, 0, min(capacity, cudaPrealloc)), group: make([]int32, 0, min(capacity, cudaPrealloc))}
	return id, nil
}

func (e *CUDAEngine) batch(id BatchID) (*cudaBatch, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return nil, ErrClosed
	}
	b, ok := e.batches[id]
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownBatch, id)
	}
	return b, nil
}

func (b *cudaBatch) status(t int) TaskStatus {
	gi := b.group[t]
	if gi < 0 {
		err := b.errs[t]
		if err == nil {
			err = fmt.Errorf("%w: not submitted", ErrInvalidRequest)
		}
		return TaskStatus{State: TaskFailed, Err: err}
	}
	g := b.groups[gi]
	select {
	case <-g.done:
		if b.canceled[gi] {
			return TaskStatus{State: TaskCanceled, Err: context.Canceled}
		}
		if g.err != nil {
			return TaskStatus{State: TaskFailed, Err: g.err}
		}
		return TaskStatus{State: TaskCompleted, BytesDone: b.lens[t]}
	default:
		if b.canceled[gi] {
			return TaskStatus{State: TaskCanceled, Err: context.Canceled}
		}
		return TaskStatus{State: TaskPending}
	}
}

// Status implements Engine.
func (e *CUDAEngine) Status(id BatchID, task int) (TaskStatus, error) {
	b, err := e.batch(id)
	if err != nil {
		return TaskStatus{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if task < 0 || task >= len(b.lens) {
		return TaskStatus{}, fmt.Errorf("%w: task %d of %d", ErrInvalidRequest, task, len(b.lens))
	}
	return b.status(task), nil
}

// Wait implements Engine.
func (e *CUDAEngine) Wait(ctx context.Context, id BatchID) ([]TaskStatus, error) {
	b, err := e.batch(id)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	groups := append([]*cudaGroup(nil), b.groups...)
	b.mu.Unlock()
	var werr error
	for _, g := range groups {
		select {
		case <-g.done:
		case <-ctx.Done():
			werr = ctx.Err()
		}
		if werr != nil {
			break
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if werr == nil && b.allCompleted() {
		if out := b.ready; len(out) == len(b.lens) {
			b.ready = nil
			return out, nil
		}
	}
	return b.statuses(), werr
}

// allCompleted reports whether every group has finished without error or cancel.
func (b *cudaBatch) allCompleted() bool {
	if len(b.canceled) > 0 {
		return false
	}
	for _, g := range b.groups {
		select {
		case <-g.done:
			if g.err != nil {
				return false
			}
		default:
			return false
		}
	}
	return true
}

// statuses is status for every task, looking at each group once.
func (b *cudaBatch) statuses() []TaskStatus {
	const (
		pending = iota
		completed
		failed
		canceled
	)
	gs := make([]uint8, len(b.groups))
	for i, g := range b.groups {
		select {
		case <-g.done:
			gs[i] = completed
			if g.err != nil {
				gs[i] = failed
			}
		default:
		}
		if b.canceled[int32(i)] {
			gs[i] = canceled
		}
	}
	out := make([]TaskStatus, len(b.lens))
	for t := range out {
		gi := b.group[t]
		if gi < 0 {
			out[t] = b.status(t)
			continue
		}
		switch gs[gi] {
		case completed:
			out[t] = TaskStatus{State: TaskCompleted, BytesDone: b.lens[t]}
		case failed:
			out[t] = TaskStatus{State: TaskFailed, Err: b.groups[gi].err}
		case canceled:
			out[t] = TaskStatus{State: TaskCanceled, Err: context.Canceled}
		default:
			out[t] = TaskStatus{State: TaskPending}
		}
	}
	return out
}

// Cancel implements Engine. Copies already launched cannot be stopped: their tasks report
// canceled (the target bytes are undefined) and FreeBatch waits for the GPU to finish them.
func (e *CUDAEngine) Cancel(id BatchID) error {
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for i, g := range b.groups {
		select {
		case <-g.done:
		default:
			b.canceled[int32(i)] = true
		}
	}
	return nil
}

// FreeBatch implements Engine: refused (ErrBatchBusy) while copies are in flight, except for a
// canceled batch, whose in-flight copies it waits out.
func (e *CUDAEngine) FreeBatch(id BatchID) error {
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	for i, g := range b.groups {
		select {
		case <-g.done:
		default:
			if !b.canceled[int32(i)] {
				b.mu.Unlock()
				return ErrBatchBusy
			}
			<-g.done
		}
	}
	b.mu.Unlock()
	e.mu.Lock()
	delete(e.batches, id)
	e.mu.Unlock()
	return nil
}
