package rdma

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// hostSink runs descriptor groups in order on host memory: the submission logic of the cuda
// engine (routing, bounds checks, sharding, descriptor groups, task attachment, status,
// cancel and free) is tested here without a GPU; the GPU sink is tested by the GPU tests.
// Addresses are resolved through a table of byte slices.
type hostSink struct {
	mem    map[uint64][]byte // base address -> bytes
	queue  chan *cudaGroup
	work   map[*cudaGroup]*cudaDescBuf
	mu     sync.Mutex
	gate   chan struct{} // closed: groups may run
	failAt int           // run call that fails (1-based); 0: none
	runs   int
	sizes  []int // descriptors of each group run, in order
	queued int   // descriptors run and not yet copied
}

func newHostSink(mem map[uint64][]byte, gated bool) *hostSink {
	s := &hostSink{mem: mem, queue: make(chan *cudaGroup, 1<<16), work: map[*cudaGroup]*cudaDescBuf{}, gate: make(chan struct{})}
	if !gated {
		close(s.gate)
	}
	go func() {
		for g := range s.queue {
			<-s.gate
			s.mu.Lock()
			buf := s.work[g]
			s.mu.Unlock()
			if buf != nil {
				for _, d := range buf.descs {
					copy(s.at(d.dst, d.n), s.at(d.src, d.n))
				}
				s.mu.Lock()
				s.queued -= len(buf.descs)
				s.mu.Unlock()
			}
			close(g.done)
		}
	}()
	return s
}

func (s *hostSink) at(addr, n uint64) []byte {
	for base, b := range s.mem {
		if addr >= base && addr+n <= base+uint64(len(b)) {
			return b[addr-base : addr-base+n]
		}
	}
	panic("hostSink: descriptor outside test memory")
}

func (s *hostSink) buffer(n int) (*cudaDescBuf, error) {
	return &cudaDescBuf{descs: make([]cudaDesc, 0, n)}, nil
}

func (s *hostSink) release(*cudaDescBuf) {}

func (s *hostSink) backlog() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queued
}

func (s *hostSink) run(buf *cudaDescBuf) (*cudaGroup, error) {
	s.mu.Lock()
	s.runs++
	if s.failAt > 0 && s.runs >= s.failAt {
		s.mu.Unlock()
		return nil, errors.New("launch failed")
	}
	g := &cudaGroup{buf: buf, done: make(chan struct{})}
	s.work[g] = buf
	if buf != nil {
		s.sizes = append(s.sizes, len(buf.descs))
		s.queued += len(buf.descs)
	}
	s.mu.Unlock()
	s.queue <- g
	return g, nil
}

// hostEngine is a cuda engine whose copies run on the host sink, with one local region at
// 1<<40 and one peer segment (id 1) with a region at 2<<40 (host memory, -1 device).
func hostEngine(t *testing.T, opt CUDAOptions, shardMin int, gated bool) (*CUDAEngine, *hostSink, []byte, []byte) {
	t.Helper()
	if err := opt.defaults(); err != nil {
		t.Fatal(err)
	}
	const size = 1 << 20
	src, dst := make([]byte, size), make([]byte, size)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	sink := newHostSink(map[uint64][]byte{1 << 40: src, 2 << 40: dst}, gated)
	e := newCUDAEngine(opt, 0)
	e.testSink, e.shardMin, e.nextSeg = sink, shardMin, 2
	e.local = cudaSpans{{addr: 0x1000, len: size / 2, ptr: 1 << 40, dev: -1}, {addr: 0x1000 + size/2, len: size / 2, ptr: 1<<40 + size/2, dev: -1}}
	p := &cudaPeer{name: "host", done: make(chan struct{})}
	spans := cudaSpans{{addr: 0x9000000, len: size, ptr: 2 << 40, dev: -1}}
	regs := []cudaWireRegion{{Region: Region{Addr: 0x9000000, Len: size, Kind: MemHost}}}
	p.spans.Store(&spans)
	p.regs.Store(&regs)
	e.peers[1] = p
	t.Cleanup(func() { close(sink.queue) })
	return e, sink, src, dst
}

func TestCUDASubmitLogic(t *testing.T) {
	tests := []struct {
		name     string
		opt      CUDAOptions
		shardMin int
	}{
		{"serial", CUDAOptions{ChunkBytes: 1024, GroupDescs: 5, Workers: 1}, 0},
		{"sharded", CUDAOptions{ChunkBytes: 1024, GroupDescs: 5, Workers: 4}, 16},
		{"sharded one group each", CUDAOptions{ChunkBytes: 64 << 10, GroupDescs: 1 << 14, Workers: 8}, 8},
		{"memcpy mode", CUDAOptions{Copy: CUDACopyMemcpy, GroupDescs: 3, Workers: 3}, 8},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, _, src, dst := hostEngine(t, tt.opt, tt.shardMin, false)
			const page = 4096
			rng := rand.New(rand.NewPCG(5, 6))
			perm := rng.Perm(len(dst) / page)
			exp := make([]byte, len(dst))
			var reqs []Request
			var ok []bool
			for i := 0; i < len(src)/page; i++ {
				switch i % 17 {
				case 3: // refused: past the peer's region
					reqs = append(reqs, Request{Op: OpWrite, Source: 0x1000, Target: 1, TargetAddr: 0x9000000 + uint64(len(dst)) - 8, Length: 16})
					ok = append(ok, false)
					continue
				case 9: // refused: unknown segment
					reqs = append(reqs, Request{Op: OpWrite, Source: 0x1000, Target: 7, TargetAddr: 0x9000000, Length: 16})
					ok = append(ok, false)
					continue
				}
				n := uint64(page)
				if i%5 == 0 {
					n = 1000 // unaligned length
				}
				reqs = append(reqs, Request{Op: OpWrite, Source: 0x1000 + uint64(i*page), Target: 1, TargetAddr: 0x9000000 + uint64(perm[i]*page), Length: n})
				ok = append(ok, true)
				copy(exp[perm[i]*page:][:n], src[i*page:][:n])
			}
			b, err := e.AllocateBatch(len(reqs))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := e.Submit(ctx, b, reqs); err != nil {
				t.Fatal(err)
			}
			st, err := e.Wait(ctx, b)
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range st {
				if ok[i] != (s.State == TaskCompleted) || (ok[i] && s.BytesDone != reqs[i].Length) {
					t.Fatalf("task %d: %+v (want ok=%v)", i, s, ok[i])
				}
				if !ok[i] && !errors.Is(s.Err, ErrOutOfBounds) && !errors.Is(s.Err, ErrUnknownSegment) {
					t.Fatalf("task %d: error %v", i, s.Err)
				}
			}
			if !bytes.Equal(dst, exp) {
				t.Fatalf("destination differs at %d", firstDiff(dst, exp))
			}
			if err := e.FreeBatch(b); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestCUDASubmitBusyCancel(t *testing.T) {
	e, sink, _, _ := hostEngine(t, CUDAOptions{ChunkBytes: 1024, GroupDescs: 4, Workers: 2}, 4, true)
	reqs := make([]Request, 32)
	for i := range reqs {
		reqs[i] = Request{Op: OpWrite, Source: 0x1000 + uint64(i)*4096, Target: 1, TargetAddr: 0x9000000 + uint64(i)*4096, Length: 4096}
	}
	ctx := context.Background()
	b, err := e.AllocateBatch(len(reqs))
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Submit(ctx, b, reqs); err != nil {
		t.Fatal(err)
	}
	if s, err := e.Status(b, 5); err != nil || s.State != TaskPending {
		t.Fatalf("gated task: %+v %v", s, err)
	}
	if err := e.FreeBatch(b); !errors.Is(err, ErrBatchBusy) {
		t.Fatalf("free while running: %v", err)
	}
	wctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := e.Wait(wctx, b); !errors.Is(err, context.Canceled) {
		t.Fatalf("wait with a done context: %v", err)
	}
	if err := e.Cancel(b); err != nil {
		t.Fatal(err)
	}
	if s, _ := e.Status(b, 0); s.State != TaskCanceled {
		t.Fatalf("canceled task: %+v", s)
	}
	freed := make(chan error, 1)
	go func() { freed <- e.FreeBatch(b) }()
	close(sink.gate) // the "GPU" finishes; FreeBatch of the canceled batch waited for it
	select {
	case err := <-freed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("FreeBatch of a canceled batch did not return")
	}
	if _, err := e.Status(b, 0); !errors.Is(err, ErrUnknownBatch) {
		t.Fatalf("freed batch: %v", err)
	}
}

func TestCUDASubmitLaunchFailure(t *testing.T) {
	for _, workers := range []int{1, 4} {
		e, sink, _, _ := hostEngine(t, CUDAOptions{ChunkBytes: 1024, GroupDescs: 4, Workers: workers}, 8, false)
		sink.failAt = 3
		reqs := make([]Request, 64)
		for i := range reqs {
			reqs[i] = Request{Op: OpWrite, Source: 0x1000 + uint64(i)*4096, Target: 1, TargetAddr: 0x9000000 + uint64(i)*4096, Length: 4096}
		}
		ctx := context.Background()
		b, _ := e.AllocateBatch(len(reqs))
		if err := e.Submit(ctx, b, reqs); err == nil {
			t.Fatal("Submit hid a launch failure")
		}
		st, err := e.Wait(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		failed := 0
		for i, s := range st {
			switch s.State {
			case TaskCompleted:
			case TaskFailed:
				failed++
				if s.Err == nil {
					t.Fatalf("task %d failed without a reason", i)
				}
			default:
				t.Fatalf("task %d left %v", i, s.State)
			}
		}
		if failed == 0 {
			t.Fatal("no task failed")
		}
		if err := e.FreeBatch(b); err != nil {
			t.Fatal(err)
		}
	}
}

// nullSink completes every group at once without copying: it isolates the host-side cost of
// a submission (routing, bounds checks, descriptor building, task bookkeeping). Buffers are
// reused, as the GPU sink's are.
type nullSink struct {
	pool *sync.Pool
	last *atomic.Int64 // when the last group was run (UnixNano)
}

func (s nullSink) buffer(n int) (*cudaDescBuf, error) {
	if b, ok := s.pool.Get().(*cudaDescBuf); ok && cap(b.descs) >= n {
		b.descs = b.descs[:0]
		return b, nil
	}
	return &cudaDescBuf{descs: make([]cudaDesc, 0, n)}, nil
}
func (s nullSink) release(b *cudaDescBuf) { s.pool.Put(b) }
func (s nullSink) run(b *cudaDescBuf) (*cudaGroup, error) {
	if b != nil {
		s.pool.Put(b)
	}
	g := &cudaGroup{done: make(chan struct{})}
	close(g.done)
	s.last.Store(time.Now().UnixNano())
	return g, nil
}

// BenchmarkCUDASubmitHost measures the host side of submitting the benchmark's session (50,000
// tokens of a Qwen3-30B-A3B-shaped pool, 50% fragmented: ~225,000 requests) with one
// descriptor-building goroutine and with the default number, and prints their ratio.
func BenchmarkCUDASubmitHost(b *testing.B) {
	const layers, ps, tb, pool = 48, 16, 1024, 6250
	pages := func(seed uint64) []int64 {
		rng := rand.New(rand.NewPCG(seed, 1))
		perm := rng.Perm(pool)[:pool/2]
		out := make([]int64, len(perm))
		for i, p := range perm {
			out[i] = int64(p)
		}
		slices.Sort(out)
		return out
	}
	layout := func(base uint64) Layout {
		l := Layout{PageSize: ps, ItemLen: ps * tb, NumLayers: layers, PageCount: pool}
		for i := 0; i < 2*layers; i++ {
			l.BufferAddrs = append(l.BufferAddrs, base+uint64(i)*pool*ps*tb)
		}
		return l
	}
	src, dst := layout(1<<40), layout(2<<40)
	reqs, err := PlanPages(OpWrite, src, dst, pages(1), pages(2), 1)
	if err != nil {
		b.Fatal(err)
	}
	// run returns the best time from Submit to the last group run (when the GPU would have
	// all its work) and from Submit to Wait's return.
	run := func(workers int) (fed, total time.Duration) {
		opt := CUDAOptions{Workers: workers}
		if err := opt.defaults(); err != nil {
			b.Fatal(err)
		}
		sink := nullSink{pool: &sync.Pool{}, last: &atomic.Int64{}}
		e := &CUDAEngine{opt: opt, testSink: sink, peers: map[SegmentID]*cudaPeer{}, batches: map[BatchID]*cudaBatch{}, nextBatch: 1}
		for i := range src.BufferAddrs {
			e.local = append(e.local, cudaSpan{addr: src.BufferAddrs[i], len: src.BufferLen(), ptr: src.BufferAddrs[i], dev: -1})
		}
		var spans cudaSpans
		for i := range dst.BufferAddrs {
			spans = append(spans, cudaSpan{addr: dst.BufferAddrs[i], len: dst.BufferLen(), ptr: dst.BufferAddrs[i], dev: -1})
		}
		p := &cudaPeer{}
		p.spans.Store(&spans)
		e.peers[1] = p
		fed, total = time.Duration(1<<62), time.Duration(1<<62)
		for i := 0; i < 5; i++ {
			id, _ := e.AllocateBatch(len(reqs))
			start := time.Now()
			if err := e.Submit(context.Background(), id, reqs); err != nil {
				b.Fatal(err)
			}
			st, err := e.Wait(context.Background(), id)
			d := time.Since(start)
			if err != nil || st[len(st)-1].State != TaskCompleted {
				b.Fatalf("%v %+v", err, st[len(st)-1])
			}
			_ = e.FreeBatch(id)
			fed = min(fed, time.Duration(sink.last.Load()-start.UnixNano()))
			total = min(total, d)
		}
		return fed, total
	}
	for i := 0; i < b.N; i++ {
		sFed, sTotal := run(1)
		w := min(4, runtime.GOMAXPROCS(0))
		pFed, pTotal := run(w)
		b.Logf("cuda-submit: %d requests; 1 worker (the default): all groups run after %v (%.1f ns/request), Wait returns after %v; %d workers: %v, %v; speedup %.2f",
			len(reqs), sFed, float64(sFed.Nanoseconds())/float64(len(reqs)), sTotal, w, pFed, pTotal, float64(sFed)/float64(pFed))
	}
}

func TestCUDAAllocRejects(t *testing.T) {
	e := newCUDAEngine(CUDAOptions{}, 0)
	if _, err := e.AllocDevice(0); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("zero-byte allocation: %v", err)
	}
	if err := e.FreeMemory(0x1234); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("free of foreign memory: %v", err)
	}
}

// TestCUDASubmitRoutes runs requests that move between regions, directions and segments, and
// refused ones right after accepted ones in the same region: the cached window of the fast
// path must never accept what the full route refuses, nor miss a region change.
func TestCUDASubmitRoutes(t *testing.T) {
	const half = 1 << 19 // local spans: [0x1000, +half) and [0x1000+half, +half); peer 0x9000000, 1 MiB
	type want int
	const (
		ok want = iota
		oob
		invalid
		unknown
	)
	w := func(src, dst, n uint64) Request {
		return Request{Op: OpWrite, Source: src, Target: 1, TargetAddr: dst, Length: n}
	}
	tests := []struct {
		name string
		req  Request
		want want
	}{
		{"write in span 0", w(0x1000, 0x9000000, 4096), ok},
		{"write in span 0 again", w(0x1000+4096, 0x9000000+4096, 4096), ok},
		{"straddles the local spans", w(0x1000+half-16, 0x9000000+8192, 32), oob},
		{"write in span 1", w(0x1000+half, 0x9000000+8192, 4096), ok},
		{"ends past span 1", w(0x1000+2*half-16, 0x9000000+16384, 32), oob},
		{"ends past the peer region", w(0x1000+half+4096, 0x9000000+(1<<20)-16, 32), oob},
		{"source wraps", w(^uint64(0)-15, 0x9000000, 32), oob},
		{"target wraps", w(0x1000+half+4096, ^uint64(0)-15, 32), oob},
		{"zero length", w(0x1000+half+4096, 0x9000000+20480, 0), invalid},
		{"bad opcode", Request{Op: 9, Source: 0x1000 + half + 4096, Target: 1, TargetAddr: 0x9000000 + 20480, Length: 16}, invalid},
		{"read into span 1", Request{Op: OpRead, Source: 0x1000 + half + 8192, Target: 1, TargetAddr: 0x9000000 + half, Length: 4096}, ok},
		{"unknown segment", Request{Op: OpWrite, Source: 0x1000, Target: 5, TargetAddr: 0x9000000, Length: 16}, unknown},
		{"back to the peer, unaligned", w(0x1000+100, 0x9000000+40960+3, 999), ok},
		{"before span 0", w(0x0f00, 0x9000000, 16), oob},
		{"split into chunks", w(0x1000+8192, 0x9000000+65536, 5000), ok},
	}
	for _, workers := range []int{1, 3} {
		e, _, src, dst := hostEngine(t, CUDAOptions{ChunkBytes: 1024, GroupDescs: 3, Workers: workers}, 2, false)
		srcAt := func(a uint64) []byte { return src[a-0x1000:] }
		exp := slices.Clone(dst)
		reqs := make([]Request, len(tests))
		for i, tt := range tests {
			reqs[i] = tt.req
		}
		// What the requests do, on copies of the memory (no two of them touch the same bytes,
		// so the order in which shards run them does not matter).
		want := slices.Clone(src)
		for _, tt := range tests {
			r := tt.req
			if tt.want != ok {
				continue
			}
			if r.Op == OpWrite {
				copy(exp[r.TargetAddr-0x9000000:][:r.Length], srcAt(r.Source)[:r.Length])
			} else {
				copy(want[r.Source-0x1000:][:r.Length], exp[r.TargetAddr-0x9000000:][:r.Length])
			}
		}
		ctx := context.Background()
		b, err := e.AllocateBatch(len(reqs))
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Submit(ctx, b, reqs); err != nil {
			t.Fatal(err)
		}
		st, err := e.Wait(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		for i, tt := range tests {
			s := st[i]
			var good bool
			switch tt.want {
			case ok:
				good = s.State == TaskCompleted && s.BytesDone == tt.req.Length
			case oob:
				good = s.State == TaskFailed && errors.Is(s.Err, ErrOutOfBounds)
			case invalid:
				good = s.State == TaskFailed && errors.Is(s.Err, ErrInvalidRequest)
			case unknown:
				good = s.State == TaskFailed && errors.Is(s.Err, ErrUnknownSegment)
			}
			if !good {
				t.Errorf("workers %d, %s: %+v", workers, tt.name, s)
			}
		}
		if !bytes.Equal(dst, exp) {
			t.Fatalf("workers %d: peer memory differs at %d", workers, firstDiff(dst, exp))
		}
		if !bytes.Equal(src, want) {
			t.Fatalf("workers %d: local memory differs at %d", workers, firstDiff(src, want))
		}
	}
}

// TestCUDASubmitGroupRamp checks that a submission's first group is small and later ones
// double up to GroupDescs, so that the GPU starts early.
func TestCUDASubmitGroupRamp(t *testing.T) {
	tests := []struct {
		name   string
		group  int
		reqs   int
		chunk  uint64
		length uint64
		want   []int
	}{
		{"ramp to the cap", 4096, 10000, 1024, 16, []int{1024, 2048, 4096, 2832}},
		{"cap below the first group", 100, 250, 1024, 16, []int{100, 100, 50}},
		{"chunked requests", 1 << 14, 1000, 1024, 3000, []int{1024, 1976}},
		{"one small group", 1 << 14, 10, 1024, 16, []int{10}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, sink, _, _ := hostEngine(t, CUDAOptions{ChunkBytes: tt.chunk, GroupDescs: tt.group, Workers: 1}, 0, false)
			reqs := make([]Request, tt.reqs)
			for i := range reqs {
				off := uint64(i) * 16 % (1<<19 - tt.length)
				reqs[i] = Request{Op: OpWrite, Source: 0x1000 + off, Target: 1, TargetAddr: 0x9000000 + off, Length: tt.length}
			}
			ctx := context.Background()
			b, _ := e.AllocateBatch(len(reqs))
			if err := e.Submit(ctx, b, reqs); err != nil {
				t.Fatal(err)
			}
			st, err := e.Wait(ctx, b)
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range st {
				if s.State != TaskCompleted {
					t.Fatalf("task %d: %+v", i, s)
				}
			}
			sink.mu.Lock()
			got := slices.Clone(sink.sizes)
			sink.mu.Unlock()
			if !slices.Equal(got, tt.want) {
				t.Fatalf("group sizes %v, want %v", got, tt.want)
			}
		})
	}
}

// TestCUDASubmitGroupBacklog checks that a submission made while earlier groups are still
// queued (the next batch of a streamed transfer) starts with a group as large as the backlog
// (up to GroupDescs) instead of restarting the ramp at 1,024, and that both batches complete
// with the right bytes.
func TestCUDASubmitGroupBacklog(t *testing.T) {
	tests := []struct {
		name         string
		group        int
		first, later int
		want         []int
	}{
		{"backlog below the cap", 4096, 3000, 10000, []int{1024, 1976, 3000, 4096, 2904}},
		{"backlog above the cap", 2048, 5000, 3000, []int{1024, 2048, 1928, 2048, 952}},
		{"idle sink ramps", 4096, 0, 3000, []int{1024, 1976}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, sink, src, dst := hostEngine(t, CUDAOptions{ChunkBytes: 1024, GroupDescs: tt.group, Workers: 1}, 0, true)
			mk := func(from, n int) []Request {
				reqs := make([]Request, n)
				for i := range reqs {
					off := uint64(from+i) * 16
					reqs[i] = Request{Op: OpWrite, Source: 0x1000 + off, Target: 1, TargetAddr: 0x9000000 + off, Length: 16}
				}
				return reqs
			}
			ctx := context.Background()
			var ids []BatchID
			for _, r := range [][]Request{mk(0, tt.first), mk(tt.first, tt.later)} {
				if len(r) == 0 {
					continue
				}
				b, err := e.AllocateBatch(len(r))
				if err != nil {
					t.Fatal(err)
				}
				if err := e.Submit(ctx, b, r); err != nil {
					t.Fatal(err)
				}
				ids = append(ids, b)
			}
			sink.mu.Lock()
			got := slices.Clone(sink.sizes)
			sink.mu.Unlock()
			close(sink.gate)
			for _, b := range ids {
				st, err := e.Wait(ctx, b)
				if err != nil {
					t.Fatal(err)
				}
				for i, s := range st {
					if s.State != TaskCompleted {
						t.Fatalf("batch %d task %d: %+v", b, i, s)
					}
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Fatalf("group sizes %v, want %v", got, tt.want)
			}
			n := 16 * (tt.first + tt.later)
			if !bytes.Equal(dst[:n], src[:n]) {
				t.Fatal("copied bytes differ")
			}
			if q := sink.backlog(); q != 0 {
				t.Fatalf("backlog %d after the copies", q)
			}
		})
	}
}

// TestCUDAWaitStatuses checks the statuses Wait prepares during a submission: handed out once
// (a second Wait builds its own), the same as computed ones, refused tasks included, and not
// used for a batch with two submissions or a canceled one.
func TestCUDAWaitStatuses(t *testing.T) {
	e, _, _, _ := hostEngine(t, CUDAOptions{ChunkBytes: 1024, GroupDescs: 4, Workers: 1}, 0, false)
	reqs := make([]Request, 20)
	for i := range reqs {
		reqs[i] = Request{Op: OpWrite, Source: 0x1000 + uint64(i)*4096, Target: 1, TargetAddr: 0x9000000 + uint64(i)*4096, Length: 4096}
	}
	reqs[7].Length = 0 // refused
	check := func(st []TaskStatus, n int) {
		t.Helper()
		if len(st) != n {
			t.Fatalf("%d statuses, want %d", len(st), n)
		}
		for i, s := range st {
			if i%len(reqs) == 7 {
				if s.State != TaskFailed || !errors.Is(s.Err, ErrInvalidRequest) {
					t.Fatalf("task %d: %+v", i, s)
				}
			} else if s.State != TaskCompleted || s.BytesDone != 4096 {
				t.Fatalf("task %d: %+v", i, s)
			}
		}
	}
	ctx := context.Background()

	b, _ := e.AllocateBatch(len(reqs))
	if err := e.Submit(ctx, b, reqs); err != nil {
		t.Fatal(err)
	}
	first, err := e.Wait(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	check(first, len(reqs))
	first[0] = TaskStatus{} // the caller owns what Wait returned
	second, err := e.Wait(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	check(second, len(reqs))

	b2, _ := e.AllocateBatch(2 * len(reqs))
	for range 2 {
		if err := e.Submit(ctx, b2, reqs); err != nil {
			t.Fatal(err)
		}
	}
	st, err := e.Wait(ctx, b2)
	if err != nil {
		t.Fatal(err)
	}
	check(st, 2*len(reqs))

	// Canceled while the "GPU" is held: every task that had not finished reports canceled.
	e2, sink2, _, _ := hostEngine(t, CUDAOptions{ChunkBytes: 1024, GroupDescs: 4, Workers: 1}, 0, true)
	b3, _ := e2.AllocateBatch(len(reqs))
	if err := e2.Submit(ctx, b3, reqs); err != nil {
		t.Fatal(err)
	}
	if err := e2.Cancel(b3); err != nil {
		t.Fatal(err)
	}
	close(sink2.gate)
	st, err = e2.Wait(ctx, b3)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range st {
		if i != 7 && s.State != TaskCanceled {
			t.Fatalf("canceled batch, task %d: %+v", i, s)
		}
	}
}
