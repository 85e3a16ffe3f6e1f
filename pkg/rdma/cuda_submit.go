package rdma

import (
	"context"
	"fmt"
	"slices"
	"unsafe"

	"golang.org/x/sync/errgroup"

	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

// cudaSink runs groups of copy descriptors in order, like one CUDA stream. The engine's sink is
// the GPU (cudaGPUSink); tests of the submission logic use a host sink.
type cudaSink interface {
	// buffer returns an empty descriptor buffer with room for n descriptors.
	buffer(n int) (*cudaDescBuf, error)
	// release returns a buffer that was not run.
	release(buf *cudaDescBuf)
	// run starts the copies of buf (nil: none) and returns a group that completes after them
	// and after everything run before. On error the sink keeps buf.
	run(buf *cudaDescBuf) (*cudaGroup, error)
}

// cudaGPUSink runs descriptors with the copy kernel (or per-descriptor memcpy) on one device.
type cudaGPUSink struct {
	e *CUDAEngine
	d *cudaDev
}

// buffer hands out buffers of the full group size whatever n is (the first groups of a
// submission are smaller), so that every buffer of the pool fits every group.
func (s cudaGPUSink) buffer(n int) (*cudaDescBuf, error) {
	return s.d.getBuf(max(n, s.e.opt.GroupDescs))
}
func (s cudaGPUSink) release(buf *cudaDescBuf) { s.d.putBuf(buf) }
func (s cudaGPUSink) run(buf *cudaDescBuf) (*cudaGroup, error) {
	if buf == nil {
		return s.e.record(s.d, nil)
	}
	g, err := s.e.launch(s.d, buf)
	if err != nil {
		s.d.putBuf(buf)
	}
	return g, err
}

// backlog is the number of descriptors run on the device and not yet completed.
func (s cudaGPUSink) backlog() int { return int(s.d.queued.Load()) }

// cudaBacklogger is a sink that knows how many descriptors it still has to copy.
type cudaBacklogger interface{ backlog() int }

// firstGroup is the size of a submission's first descriptor group: cudaFirstGroup when the
// sink is idle, so that the copy starts after a few microseconds of building; when the sink
// is still copying earlier groups (the next batch of a streamed transfer), as many
// descriptors as it has queued, up to groupMax: building them takes a fraction of the time
// the sink needs for its backlog, and every group boundary is a kernel boundary at which the
// GPU drains (restarting at 1,024 for every batch of a stream made many small kernels).
func firstGroup(sink cudaSink, groupMax int) int {
	n := min(groupMax, cudaFirstGroup)
	if b, ok := sink.(cudaBacklogger); ok {
		n = min(groupMax, max(n, b.backlog()))
	}
	return n
}

func (e *CUDAEngine) sink() (cudaSink, error) {
	if e.testSink != nil {
		return e.testSink, nil
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return nil, err
	}
	return cudaGPUSink{e: e, d: d}, nil
}

// Task group markers (cudaBatch.group values below zero).
const (
	cudaTaskFailed     int32 = -1
	cudaTaskUnassigned int32 = -2
)

func (b *cudaBatch) fail(t int, err error) {
	b.group[t] = cudaTaskFailed
	b.gmu.Lock()
	b.errs[t] = err
	b.gmu.Unlock()
}

func (b *cudaBatch) addGroup(g *cudaGroup) int32 {
	b.gmu.Lock()
	defer b.gmu.Unlock()
	b.groups = append(b.groups, g)
	return int32(len(b.groups) - 1)
}

// shards is the number of goroutines that build the descriptors of n requests.
func (e *CUDAEngine) shards(n int) int {
	per := e.shardMin
	if per <= 0 {
		per = cudaShardMin
	}
	return max(1, min(e.opt.Workers, (n+per-1)/per))
}

// cudaShardMin is the fewest requests worth a descriptor-building goroutine of their own.
const cudaShardMin = 8192

// Submit implements Engine. Every request is bounds-checked against the local regions and the
// peer's advertised regions before any byte moves; refused requests fail as tasks. The rest
// are turned into copy descriptors — by up to Workers goroutines, each over a contiguous shard
// of the requests — and run in groups, each followed by an event.
func (e *CUDAEngine) Submit(ctx context.Context, id BatchID, reqs []Request) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	e.subMu.RLock()
	defer e.subMu.RUnlock()
	if e.shut.Load() {
		return ErrClosed
	}
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.lens)+len(reqs) > b.cap {
		return fmt.Errorf("%w: %d + %d > %d", ErrBatchFull, len(b.lens), len(reqs), b.cap)
	}
	e.mu.RLock()
	local := e.local
	segs := make(map[SegmentID]*cudaPeer, len(e.peers)) // a snapshot: the shards run unlocked
	for id, p := range e.peers {
		segs[id] = p
	}
	e.mu.RUnlock()

	// The task slots are sized here and filled by the shards (each owns its range).
	base := len(b.lens)
	b.lens = slices.Grow(b.lens, len(reqs))[:base+len(reqs)]
	b.group = slices.Grow(b.group, len(reqs))[:base+len(reqs)]
	sink, err := e.sink()
	if err != nil {
		for i, r := range reqs {
			b.lens[base+i] = r.Length
			b.fail(base+i, err)
		}
		return err
	}
	n := len(reqs)
	shards := e.shards(n)
	b.ready = nil
	if shards == 1 {
		err = e.submitShard(b, sink, reqs, base, local, segs)
	} else {
		size := (n + shards - 1) / shards
		var g errgroup.Group
		for lo := 0; lo < n; lo += size {
			hi := min(n, lo+size)
			g.Go(func() error { return e.submitShard(b, sink, reqs[lo:hi], base+lo, local, segs) })
		}
		err = g.Wait()
	}
	if err == nil && base == 0 {
		// Every copy is queued: while the GPU runs them, prepare what Wait returns if they
		// all complete, so that Wait costs nothing after the last copy.
		b.ready = b.optimistic()
	}
	return err
}

// optimistic returns every task's status assuming all groups complete.
func (b *cudaBatch) optimistic() []TaskStatus {
	out := make([]TaskStatus, len(b.lens))
	for t, gi := range b.group {
		if gi < 0 {
			out[t] = b.status(t)
		} else {
			out[t] = TaskStatus{State: TaskCompleted, BytesDone: b.lens[t]}
		}
	}
	return out
}

// cudaWindow caches the span the previous request resolved to on one side: [lo, hi) in the
// owner's addresses, ptr the address of lo in this process, dev where it lives. The zero value
// matches nothing.
type cudaWindow struct {
	lo, hi, ptr uint64
	dev         int
}

func (w *cudaWindow) set(s *cudaSpan) {
	*w = cudaWindow{lo: s.addr, hi: s.addr + s.len, ptr: s.ptr, dev: s.dev}
}

// cudaFirstGroup is the size of a shard's first descriptor group; later groups double up to
// GroupDescs, so that the GPU starts after a few microseconds of building and the host, which
// builds descriptors several times faster than the GPU copies them, stays ahead.
const cudaFirstGroup = 1024

// submitShard routes reqs (tasks base, base+1, …), fills descriptor buffers and runs each
// full one. A task is attached to the group holding its last descriptor: groups run in order,
// so that group's completion means all of the task's bytes have moved.
//
// The loop is the hot path of a submission (hundreds of thousands of requests for one long
// session): a request inside the spans the previous one resolved to (the common case, since
// planned requests are sorted by buffer) is checked with four compares and written straight
// into the descriptor buffer; anything else takes the full route (cudaRouteRequest: lookups,
// precise errors) and, when it succeeds, becomes the new cached window.
func (e *CUDAEngine) submitShard(b *cudaBatch, sink cudaSink, reqs []Request, base int, local cudaSpans, segs map[SegmentID]*cudaPeer) error {
	chunk, groupMax := e.opt.ChunkBytes, e.opt.GroupDescs
	// memcpy and batch copies are not split into chunks: one copy per request
	whole := e.opt.Copy == CUDACopyMemcpy || e.opt.Copy == CUDACopyBatch
	groupN := firstGroup(sink, groupMax)
	end := base + len(reqs)
	lens, group := b.lens[base:end], b.group[base:end]
	var buf *cudaDescBuf
	var descs []cudaDesc // buf's descriptors, full capacity; k are filled
	k := 0
	pend := 0 // first task (index into reqs) not yet attached to a group
	// flush runs buf (or, with no descriptors but tasks waiting, an empty group) and attaches
	// tasks [pend, upto) to it.
	flush := func(upto int) error {
		waiting := false
		for t := pend; t < upto && !waiting; t++ {
			waiting = group[t] != cudaTaskFailed
		}
		if buf != nil {
			buf.descs = descs[:k]
			if k == 0 {
				sink.release(buf)
				buf = nil
			}
		}
		descs, k = nil, 0
		if buf == nil && !waiting {
			pend = upto
			return nil
		}
		g, err := sink.run(buf)
		buf = nil
		if err != nil {
			return err
		}
		gi := b.addGroup(g)
		for t := pend; t < upto; t++ {
			if group[t] != cudaTaskFailed {
				group[t] = gi
			}
		}
		pend = upto
		groupN = min(groupMax, 2*groupN)
		return nil
	}
	cur := -1 // last task whose slot is filled
	abort := func(err error) error {
		if buf != nil {
			buf.descs = buf.descs[:0]
			sink.release(buf)
			buf = nil
		}
		for t := pend; t < len(reqs); t++ {
			if t > cur {
				lens[t] = reqs[t].Length
			} else if group[t] == cudaTaskFailed {
				continue // keeps its own reason
			}
			b.fail(base+t, err)
		}
		return err
	}

	var lastSeg SegmentID = -1
	var remote cudaSpans
	var segErr error
	var lw, rw cudaWindow
	lh, rh := -1, -1
	var peersOK [3]int
	peersOKSet := false
	for i := range reqs {
		r := &reqs[i]
		n := r.Length
		lens[i], group[i], cur = n, cudaTaskUnassigned, i
		if r.Target != lastSeg {
			lastSeg, rh, segErr, rw = r.Target, -1, nil, cudaWindow{}
			p, ok := segs[r.Target]
			switch {
			case !ok:
				segErr = fmt.Errorf("%w: %d", ErrUnknownSegment, r.Target)
			case p.gone.Load() != nil:
				segErr = *p.gone.Load()
			default:
				remote = *p.spans.Load()
			}
		}
		if segErr != nil {
			b.fail(base+i, segErr)
			continue
		}
		var src, dst uint64
		ls, rs := r.Source, r.TargetAddr
		if (r.Op == OpWrite || r.Op == OpRead) && n != 0 &&
			ls >= lw.lo && ls+n > ls && ls+n <= lw.hi && rs >= rw.lo && rs+n > rs && rs+n <= rw.hi {
			lp, rp := lw.ptr+(ls-lw.lo), rw.ptr+(rs-rw.lo)
			if r.Op == OpWrite {
				src, dst = lp, rp
			} else {
				src, dst = rp, lp
			}
		} else {
			rt, err := cudaRouteRequest(r, local, remote, e.defDev, &lh, &rh)
			if err == nil && (!peersOKSet || peersOK != [3]int{rt.dev, rt.srcDev, rt.dstDev}) {
				if err = e.ensurePeer(rt.dev, rt.srcDev); err == nil {
					err = e.ensurePeer(rt.dev, rt.dstDev)
				}
				if err == nil {
					peersOK, peersOKSet = [3]int{rt.dev, rt.srcDev, rt.dstDev}, true
				}
			}
			if err != nil {
				b.fail(base+i, err)
				continue
			}
			// The route succeeded, so lh and rh index the spans it used (and whose device
			// pair was just checked): later requests inside them take the fast path.
			lw.set(&local[lh])
			rw.set(&remote[rh])
			src, dst = rt.src, rt.dst
		}
		step := chunk
		if whole {
			step = n
		}
		for off := uint64(0); off < n; off += step {
			if buf == nil {
				var err error
				if buf, err = sink.buffer(groupN); err != nil {
					buf = nil
					return abort(err)
				}
				descs = buf.descs[:groupN]
			}
			descs[k] = cudaDesc{src: src + off, dst: dst + off, n: min(step, n-off)}
			k++
			if k == len(descs) {
				upto := i // this task's last descriptor is in the group only if no bytes remain
				if off+step >= n {
					upto = i + 1
				}
				if err := flush(upto); err != nil {
					return abort(err)
				}
			}
		}
	}
	if err := flush(len(reqs)); err != nil {
		return abort(err)
	}
	return nil
}

// launch uploads a group's descriptors and runs them (kernel, or one memcpy each), then
// records the group's event.
func (e *CUDAEngine) launch(d *cudaDev, buf *cudaDescBuf) (*cudaGroup, error) {
	n := len(buf.descs)
	switch e.opt.Copy {
	case CUDACopyMemcpy:
		for _, ds := range buf.descs {
			if err := d.ctx.MemcpyAsync(ds.dst, ds.src, ds.n, d.stream); err != nil {
				return nil, err
			}
		}
		return e.record(d, buf)
	case CUDACopyBatch:
		if n == 0 {
			return e.record(d, buf)
		}
		c := uint64(cap(buf.descs))
		if buf.batch == 0 {
			p, err := d.ctx.MemHostAlloc(3 * 8 * c)
			if err != nil {
				return nil, err
			}
			buf.batch = p
		}
		arr := unsafe.Slice((*uint64)(unsafe.Add(unsafe.Pointer(nil), uintptr(buf.batch))), 3*c)
		dsts, srcs, sizes := arr[:n], arr[c:c+uint64(n)], arr[2*c:2*c+uint64(n)]
		for i, ds := range buf.descs {
			dsts[i], srcs[i], sizes[i] = ds.dst, ds.src, ds.n
		}
		if err := d.ctx.MemcpyBatchAsync(buf.batch, buf.batch+8*c, buf.batch+16*c, n, d.stream); err != nil {
			return nil, err
		}
		return e.record(d, buf)
	}
	// The upload runs on its own stream, so that it overlaps the kernels of earlier groups;
	// the copy stream waits for it (an event) before this group's kernel.
	if err := d.ctx.MemcpyHtoDAsync(buf.dev, buf.host, uint64(n)*cuda.DescSize, d.up); err != nil {
		return nil, err
	}
	if err := d.ctx.EventRecord(buf.up, d.up); err != nil {
		return nil, err
	}
	if err := d.ctx.StreamWaitEvent(d.stream, buf.up); err != nil {
		return nil, err
	}
	fn, grid, block := d.fn, uint32(n), uint32(e.opt.BlockThreads)
	if e.opt.Copy == CUDACopyWarp {
		// enough CTAs to fill every multiprocessor once (2,048 threads each), fewer when the
		// group has fewer descriptors than the grid has warps
		warps := block / 32
		grid = min(uint32(max(1, d.sms))*(2048/block), (uint32(n)+warps-1)/warps)
		fn = d.warpFn
	}
	if err := d.ctx.LaunchCopy(fn, buf.dev, uint32(n), max(grid, 1), block, d.stream); err != nil {
		return nil, err
	}
	return e.record(d, buf)
}

func (e *CUDAEngine) record(d *cudaDev, buf *cudaDescBuf) (*cudaGroup, error) {
	ev, err := d.ctx.EventCreateSpin() // the completion goroutine's wait ends the transfer: no sleeping thread to wake
	if err != nil {
		return nil, err
	}
	if err := d.ctx.EventRecord(ev, d.stream); err != nil {
		_ = d.ctx.EventDestroy(ev)
		return nil, err
	}
	g := &cudaGroup{dev: d, ev: ev, buf: buf, done: make(chan struct{})}
	if buf != nil {
		g.n = int64(len(buf.descs))
		d.queued.Add(g.n)
	}
	d.pending <- g
	return g, nil
}
