package rdma

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

// Ready events let the side that copies tell the other process "these bytes have landed"
// without waiting for the copy itself: the copier records an interprocess CUDA event on its
// copy stream right after its last submission and sends the event's handle (64 bytes) in its
// commit message; the receiver opens the handle and waits for the event before it treats the
// bytes as written. The commit's round trip then overlaps the copy instead of following it,
// and its answer still means every byte landed (events complete in stream order).

// ReadyEventSize is the size of a ready-event handle (a CUipcEventHandle).
const ReadyEventSize = cuda.IPCEventHandleSize

// cudaReady holds the interprocess events of an engine: a free list of events it records
// (ReadyEvent) and the peers' events it opened (WaitReady), by handle.
type cudaReady struct {
	mu     sync.Mutex
	free   []cudaReadyEvent
	all    []cudaReadyEvent
	opened map[cuda.IPCEventHandle]cuda.Event
}

type cudaReadyEvent struct {
	ev cuda.Event
	h  cuda.IPCEventHandle
}

// readyOpenMax bounds the peers' events kept open; past it a wait opens and closes its own.
const readyOpenMax = 256

// ReadyEvent records an interprocess event on the engine's copy stream after every copy
// submitted so far and returns its handle for another process's WaitReady, and a release
// function to call once that process has answered (the event is reused afterwards; call it
// exactly once). It fails with ErrInvalidRequest when a task of one of batches was already
// refused at submission: those bytes will never land, and no event must claim they did.
func (e *CUDAEngine) ReadyEvent(batches ...BatchID) ([]byte, func(), error) {
	for _, id := range batches {
		b, err := e.batch(id)
		if err != nil {
			return nil, nil, err
		}
		b.mu.Lock()
		failed := -1
		for t, g := range b.group {
			if g == cudaTaskFailed {
				failed = t
				break
			}
		}
		b.mu.Unlock()
		if failed >= 0 {
			return nil, nil, fmt.Errorf("%w: batch %d task %d was refused", ErrInvalidRequest, id, failed)
		}
	}
	e.subMu.RLock()
	defer e.subMu.RUnlock()
	if e.shut.Load() {
		return nil, nil, ErrClosed
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return nil, nil, err
	}
	r := &e.ready
	r.mu.Lock()
	var re cudaReadyEvent
	if n := len(r.free); n > 0 {
		re, r.free = r.free[n-1], r.free[:n-1]
		r.mu.Unlock()
	} else {
		r.mu.Unlock()
		ev, err := d.ctx.EventCreateIPC()
		if err != nil {
			return nil, nil, fmt.Errorf("rdma/cuda: ready event: %w", err)
		}
		h, err := d.ctx.IPCEventHandle(ev)
		if err != nil {
			_ = d.ctx.EventDestroy(ev)
			return nil, nil, fmt.Errorf("rdma/cuda: ready event handle: %w", err)
		}
		re = cudaReadyEvent{ev: ev, h: h}
		r.mu.Lock()
		r.all = append(r.all, re)
		r.mu.Unlock()
	}
	put := func() {
		r.mu.Lock()
		r.free = append(r.free, re)
		r.mu.Unlock()
	}
	if err := d.ctx.EventRecord(re.ev, d.stream); err != nil {
		put()
		return nil, nil, fmt.Errorf("rdma/cuda: record ready event: %w", err)
	}
	var once sync.Once
	return append([]byte(nil), re.h[:]...), func() { once.Do(put) }, nil
}

// WaitReady queries a peer's event in a tight loop (yielding the processor between queries)
// for up to readySpin, then every readyPoll. A sleep of a few microseconds is no option: an
// idle Go process wakes from a timer through epoll with millisecond resolution, which would
// add up to a millisecond to every commit; a spin finds the event within microseconds. A
// 50,000-token push takes about 15 ms over NVLink and 100 ms into host memory.
const (
	readySpin = 250 * time.Millisecond
	readyPoll = time.Millisecond
)

// WaitReady waits until the event of handle (another process's ReadyEvent) has completed, or
// ctx ends. A handle that does not open, or an event that reports an error, is an error: the
// caller must not treat the bytes as written.
func (e *CUDAEngine) WaitReady(ctx context.Context, handle []byte) error {
	if len(handle) != ReadyEventSize {
		return fmt.Errorf("%w: ready event handle of %d bytes, want %d", ErrInvalidRequest, len(handle), ReadyEventSize)
	}
	var h cuda.IPCEventHandle
	copy(h[:], handle)
	e.subMu.RLock()
	defer e.subMu.RUnlock()
	if e.shut.Load() {
		return ErrClosed
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return err
	}
	r := &e.ready
	r.mu.Lock()
	ev, ok := r.opened[h]
	r.mu.Unlock()
	if !ok {
		if ev, err = d.ctx.IPCOpenEvent(h); err != nil {
			return fmt.Errorf("%w: open ready event: %v", ErrInvalidRequest, err)
		}
		r.mu.Lock()
		switch prev, dup := r.opened[h]; {
		case dup: // opened meanwhile by another wait
			_ = d.ctx.EventDestroy(ev)
			ev = prev
		case len(r.opened) < readyOpenMax:
			if r.opened == nil {
				r.opened = map[cuda.IPCEventHandle]cuda.Event{}
			}
			r.opened[h] = ev
		default: // cache full: this wait owns the event
			defer func() { _ = d.ctx.EventDestroy(ev) }()
		}
		r.mu.Unlock()
	}
	spinUntil := time.Now().Add(readySpin)
	var t *time.Timer
	for {
		done, err := d.ctx.EventQuery(ev)
		if err != nil {
			return fmt.Errorf("rdma/cuda: ready event: %w", err)
		}
		if done {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		if time.Now().Before(spinUntil) {
			runtime.Gosched()
			continue
		}
		if t == nil {
			t = time.NewTimer(readyPoll)
			defer t.Stop()
		} else {
			t.Reset(readyPoll)
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-t.C:
		}
	}
}

// closeReady destroys the ready events (Close, with the device still held).
func (e *CUDAEngine) closeReady(d *cudaDev) {
	r := &e.ready
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, re := range r.all {
		_ = d.ctx.EventDestroy(re.ev)
	}
	for _, ev := range r.opened {
		_ = d.ctx.EventDestroy(ev)
	}
	r.all, r.free, r.opened = nil, nil, nil
}
