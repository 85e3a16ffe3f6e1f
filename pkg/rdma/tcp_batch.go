package rdma

import (
	"context"
	"fmt"
	"sync"
)

// sliceChunk is how many slices Submit hands to a writer at once; chunks are recycled.
const sliceChunk = 1024

var chunkPool = sync.Pool{New: func() any { return new([]sliceOp) }}

func getChunk() []sliceOp {
	p := chunkPool.Get().(*[]sliceOp)
	if cap(*p) < sliceChunk {
		return make([]sliceOp, 0, sliceChunk)
	}
	return (*p)[:0]
}

// putChunk recycles a chunk whose slices the writer has taken.
func putChunk(q []sliceOp) {
	if cap(q) != sliceChunk {
		return
	}
	clear(q)
	q = q[:0]
	chunkPool.Put(&q)
}

func (e *tcpEngine) AllocateBatch(capacity int) (BatchID, error) {
	if e.isClosed() {
		return 0, ErrClosed
	}
	return e.batches.allocate(capacity)
}

func (e *tcpEngine) Submit(ctx context.Context, id BatchID, reqs []Request) error {
	if e.isClosed() {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b, err := e.batches.get(id)
	if err != nil {
		return err
	}
	tasks, err := b.add(len(reqs))
	if err != nil {
		return err
	}
	// Slices are handed to each connection's writer in chunks as they are planned, so the
	// first bytes leave while the rest of a large batch is still being cut. Consecutive slices
	// stay on one connection until it has about SliceBytes of them, so each writer walks memory
	// in order (contiguous payloads share an iovec) while large requests still spread over all
	// connections.
	type segQueues struct {
		seg   *tcpSegment
		q     [][]sliceOp
		ci    int    // the connection taking slices now
		bytes uint64 // bytes given to it since it was picked
	}
	var (
		queues     []*segQueues
		lastTarget SegmentID
		lastQ      *segQueues
		lastLocal  *memRegion
	)
	for i, r := range reqs {
		t := &tasks[i]
		if r.Op != OpRead && r.Op != OpWrite {
			t.finish(b, TaskFailed, fmt.Errorf("%w: opcode %v", ErrInvalidRequest, r.Op))
			continue
		}
		if r.Length == 0 {
			t.finish(b, TaskFailed, fmt.Errorf("%w: zero length", ErrInvalidRequest))
			continue
		}
		if lastQ == nil || r.Target != lastTarget {
			e.mu.Lock()
			seg, ok := e.segs[r.Target]
			e.mu.Unlock()
			if !ok {
				t.finish(b, TaskFailed, fmt.Errorf("%w: %d", ErrUnknownSegment, r.Target))
				continue
			}
			lastQ = nil
			for _, q := range queues {
				if q.seg == seg {
					lastQ = q
				}
			}
			if lastQ == nil {
				lastQ = &segQueues{seg: seg, q: make([][]sliceOp, len(seg.conns)), ci: int(seg.next.Add(1) % uint64(len(seg.conns)))}
				queues = append(queues, lastQ)
			}
			lastTarget = r.Target
		}
		if r.TargetAddr+r.Length < r.TargetAddr {
			t.finish(b, TaskFailed, fmt.Errorf("%w: target [%#x, +%d) wraps", ErrOutOfBounds, r.TargetAddr, r.Length))
			continue
		}
		local := lastLocal
		if local == nil || !local.Contains(r.Source, r.Length) {
			if local = e.regions.find(r.Source, r.Length); local == nil {
				t.finish(b, TaskFailed, fmt.Errorf("%w: local [%#x, +%d) is not registered", ErrOutOfBounds, r.Source, r.Length))
				continue
			}
			lastLocal = local
		}
		seg := lastQ.seg
		t.left.Store(int64((r.Length + e.sliceBytes - 1) / e.sliceBytes))
		for off := uint64(0); off < r.Length; off += e.sliceBytes {
			n := min(e.sliceBytes, r.Length-off)
			if lastQ.bytes >= e.sliceBytes {
				lastQ.ci, lastQ.bytes = int(seg.next.Add(1)%uint64(len(seg.conns))), 0
			}
			ci := lastQ.ci
			lastQ.bytes += n
			q := lastQ.q[ci]
			if q == nil {
				q = getChunk()
			}
			q = append(q, sliceOp{t: t, b: b, op: r.Op, local: local, laddr: r.Source + off, raddr: r.TargetAddr + off, n: n})
			if len(q) == cap(q) {
				seg.conns[ci].enqueue(q) // the writer owns q now
				q = nil
			}
			lastQ.q[ci] = q
		}
	}
	for _, sq := range queues {
		for ci, q := range sq.q {
			if len(q) > 0 {
				sq.seg.conns[ci].enqueue(q)
			}
		}
	}
	return nil
}

func (e *tcpEngine) Status(id BatchID, i int) (TaskStatus, error) {
	b, err := e.batches.get(id)
	if err != nil {
		return TaskStatus{}, err
	}
	return b.status(i)
}

func (e *tcpEngine) Wait(ctx context.Context, id BatchID) ([]TaskStatus, error) {
	b, err := e.batches.get(id)
	if err != nil {
		return nil, err
	}
	return b.wait(ctx)
}

func (e *tcpEngine) Cancel(id BatchID) error {
	b, err := e.batches.get(id)
	if err != nil {
		return err
	}
	b.cancel(TaskCanceled, context.Canceled)
	return nil
}

func (e *tcpEngine) FreeBatch(id BatchID) error { return e.batches.free(id) }
