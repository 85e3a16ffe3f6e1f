package rdma

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"
	"unsafe"

	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

// cudaTestDriver returns the driver, or skips the test when libcuda or a device is missing.
func cudaTestDriver(t testing.TB) *cuda.Driver {
	t.Helper()
	d, err := cuda.Load()
	if err != nil {
		t.Skipf("no CUDA here: %v", err)
	}
	return d
}

func TestCUDAUnavailableWithoutDriver(t *testing.T) {
	if _, err := cuda.Load(); err == nil {
		t.Skip("a CUDA driver and device are present")
	}
	_, err := New(context.Background(), Config{Backend: "cuda"})
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("New(cuda) without a driver: %v, want ErrUnavailable", err)
	}
}

func TestCUDAOptionsRejected(t *testing.T) {
	for _, o := range []CUDAOptions{{ChunkBytes: 100}, {BlockThreads: 48}, {GroupDescs: -1}, {Copy: 7}, {Workers: -2}} {
		if _, err := NewCUDA(context.Background(), Config{Backend: "cuda"}, o); !errors.Is(err, ErrInvalidRequest) {
			t.Fatalf("%+v: %v", o, err)
		}
	}
}

// TestCUDAEngineInProcess moves fragmented, unaligned and refused requests between two engines
// of this process (device 0 and the last device), in both copy modes, and checks every byte.
func TestCUDAEngineInProcess(t *testing.T) {
	drv := cudaTestDriver(t)
	n, err := drv.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	// Small chunks, groups and shards so that requests split over descriptors, groups and
	// descriptor-building goroutines.
	tests := []struct {
		name     string
		opt      CUDAOptions
		shardMin int
	}{
		{"kernel", CUDAOptions{ChunkBytes: 1024, GroupDescs: 7, Workers: 1}, 0},
		{"kernel sharded", CUDAOptions{ChunkBytes: 1024, GroupDescs: 7, Workers: 4}, 16},
		{"memcpy", CUDAOptions{Copy: CUDACopyMemcpy, GroupDescs: 7, Workers: 2}, 16},
		{"warp", CUDAOptions{Copy: CUDACopyWarp, ChunkBytes: 1024, GroupDescs: 7, Workers: 1}, 0},
		{"warp large chunks", CUDAOptions{Copy: CUDACopyWarp, ChunkBytes: 64 << 10, GroupDescs: 5, Workers: 2}, 16},
		{"batch", CUDAOptions{Copy: CUDACopyBatch, GroupDescs: 7, Workers: 2}, 16},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.opt.Copy == CUDACopyBatch && !drv.HasBatchMemcpy() {
				t.Skip("the driver has no cuMemcpyBatchAsync")
			}
			testCUDAEngines(t, drv, 0, n-1, tt.opt, tt.shardMin)
		})
	}
}

func testCUDAEngines(t *testing.T, drv *cuda.Driver, devA, devB int, opt CUDAOptions, shardMin int) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	a, err := NewCUDA(ctx, Config{Backend: "cuda", CUDADevice: devA}, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	a.shardMin = shardMin
	b, err := NewCUDA(ctx, Config{Backend: "cuda", CUDADevice: devB, ListenAddr: "unix:" + t.TempDir() + "/b.sock"}, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ca, err := drv.PrimaryContext(devA)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.Release()
	cb, err := drv.PrimaryContext(devB)
	if err != nil {
		t.Fatal(err)
	}
	defer cb.Release()

	const size = 1 << 20
	src, err := ca.MemAlloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.MemFree(src)
	dst, err := cb.MemAlloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer cb.MemFree(dst)
	host, err := ca.MemHostAlloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer ca.MemFreeHost(host)
	pattern := make([]byte, size)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range pattern {
		pattern[i] = byte(rng.Uint32())
	}
	if err := ca.MemcpyHtoD(src, unsafe.Pointer(&pattern[0]), size); err != nil {
		t.Fatal(err)
	}
	if err := cb.MemsetD8(dst, 0, size); err != nil {
		t.Fatal(err)
	}
	hb := cuda.HostBytes(host, size)
	clear(hb)

	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(a.RegisterMemory(Region{Addr: src, Len: size / 2, Kind: MemCUDA}))
	must(a.RegisterMemory(Region{Addr: src + size/2, Len: size / 2, Kind: MemCUDA}))
	must(a.RegisterMemory(Region{Addr: host, Len: size, Kind: MemHost}))
	must(b.RegisterMemory(Region{Addr: dst, Len: size, Kind: MemCUDA}))
	if err := a.RegisterMemory(Region{Addr: src + 16, Len: 32, Kind: MemCUDA}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("overlapping registration: %v", err)
	}
	if err := a.RegisterMemory(Region{Addr: uint64(uintptr(unsafe.Pointer(&pattern[0]))), Len: 64, Kind: MemHost}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("unpinned host registration: %v", err)
	}

	seg, err := a.OpenSegment(ctx, b.SegmentName())
	must(err)
	regs, err := a.RemoteRegions(seg)
	must(err)
	if len(regs) != 1 || regs[0].Addr != dst || regs[0].CUDA == nil || regs[0].CUDA.Device != devB {
		t.Fatalf("remote regions %+v", regs)
	}

	// WRITE: pages of 4 KiB in a shuffled map (runs cross the two local regions' boundary
	// only where both sides line up), one unaligned piece, and refused requests.
	const page = 4096
	perm := rng.Perm(size / page)
	var reqs []Request
	var want []bool
	for i := 0; i < size/page; i += 3 { // every third page, to a shuffled destination page
		reqs = append(reqs, Request{Op: OpWrite, Source: src + uint64(i*page), Target: seg, TargetAddr: dst + uint64(perm[i]*page), Length: page})
		want = append(want, true)
	}
	odd := Request{Op: OpWrite, Source: src + 1*page + 3, Target: seg, TargetAddr: dst + uint64(perm[1]*page) + 5, Length: 1001}
	reqs = append(reqs, odd)
	want = append(want, true)
	bad := []Request{
		{Op: OpWrite, Source: src, Target: seg, TargetAddr: dst + size - 8, Length: 16},      // past the peer's region
		{Op: OpWrite, Source: src + size - 8, Target: seg, TargetAddr: dst, Length: 16},      // past the local regions
		{Op: OpWrite, Source: src + size/2 - 8, Target: seg, TargetAddr: dst, Length: 16},    // across two local regions
		{Op: OpWrite, Source: src, Target: seg + 100, TargetAddr: dst, Length: 16},           // unknown segment
		{Op: OpWrite, Source: src, Target: seg, TargetAddr: dst, Length: 0},                  // empty
		{Op: Opcode(9), Source: src, Target: seg, TargetAddr: dst, Length: 16},               // bad opcode
		{Op: OpWrite, Source: src, Target: seg, TargetAddr: dst + size, Length: math1(size)}, // wraps
	}
	for _, r := range bad {
		reqs = append(reqs, r)
		want = append(want, false)
	}
	if _, err := a.AllocateBatch(0); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("zero capacity: %v", err)
	}
	bid, err := a.AllocateBatch(len(reqs))
	must(err)
	if err := a.Submit(ctx, bid, append(reqs, reqs[0])); !errors.Is(err, ErrBatchFull) {
		t.Fatalf("over capacity: %v", err)
	}
	must(a.Submit(ctx, bid, reqs))
	st, err := a.Wait(ctx, bid)
	must(err)
	for i, s := range st {
		if want[i] && (s.State != TaskCompleted || s.BytesDone != reqs[i].Length) {
			t.Fatalf("task %d: %+v", i, s)
		}
		if !want[i] && s.State != TaskFailed {
			t.Fatalf("refused task %d: %+v", i, s)
		}
	}
	if s, err := a.Status(bid, len(reqs)-1); err != nil || s.State != TaskFailed ||
		!(errors.Is(s.Err, ErrOutOfBounds) || errors.Is(s.Err, ErrInvalidRequest)) {
		t.Fatalf("status of a refused task: %+v %v", s, err)
	}
	if _, err := a.Status(bid, len(reqs)); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("status past the end: %v", err)
	}
	must(a.FreeBatch(bid))
	if _, err := a.Status(bid, 0); !errors.Is(err, ErrUnknownBatch) {
		t.Fatalf("freed batch: %v", err)
	}

	got := make([]byte, size)
	must(cb.MemcpyDtoH(unsafe.Pointer(&got[0]), dst, size))
	exp := make([]byte, size)
	for i := 0; i < size/page; i += 3 {
		copy(exp[perm[i]*page:][:page], pattern[i*page:][:page])
	}
	copy(exp[perm[1]*page+5:][:1001], pattern[page+3:][:1001])
	if !bytes.Equal(got, exp) {
		t.Fatalf("destination differs from expected at %d", firstDiff(got, exp))
	}

	// READ the destination back into pinned host memory (the kernel runs on devA, reads devB
	// over NVLink and writes host memory), as two requests.
	bid, err = a.AllocateBatch(2)
	must(err)
	must(a.Submit(ctx, bid, []Request{
		{Op: OpRead, Source: host, Target: seg, TargetAddr: dst, Length: size / 2},
		{Op: OpRead, Source: host + size/2, Target: seg, TargetAddr: dst + size/2, Length: size / 2},
	}))
	st, err = a.Wait(ctx, bid)
	must(err)
	for i, s := range st {
		if s.State != TaskCompleted {
			t.Fatalf("read task %d: %+v", i, s)
		}
	}
	if !bytes.Equal(hb, exp) {
		t.Fatalf("host copy differs at %d", firstDiff(hb, exp))
	}
	must(a.FreeBatch(bid))
	must(a.CloseSegment(seg))
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second close: %v", err)
	}
}

func math1(n uint64) uint64 { return ^uint64(0) - n + 2 }

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// TestCUDAEngineAlloc moves bytes pinned host -> device -> pinned host through memory the
// engine allocated, over a segment the engine opened to itself.
func TestCUDAEngineAlloc(t *testing.T) {
	cudaTestDriver(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	e, err := NewCUDA(ctx, Config{Backend: "cuda"}, CUDAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	const size = 3 << 20
	in, inb, err := e.AllocPinned(size)
	if err != nil {
		t.Fatal(err)
	}
	out, outb, err := e.AllocPinned(size)
	if err != nil {
		t.Fatal(err)
	}
	dev, err := e.AllocDevice(size)
	if err != nil {
		t.Fatal(err)
	}
	for i := range inb {
		inb[i] = byte(i*7 + i>>11)
	}
	clear(outb)
	for _, r := range []Region{{Addr: in, Len: size, Kind: MemHost}, {Addr: out, Len: size, Kind: MemHost}, {Addr: dev, Len: size, Kind: MemCUDA}} {
		if err := e.RegisterMemory(r); err != nil {
			t.Fatal(err)
		}
	}
	seg, err := e.OpenSegment(ctx, e.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []Request{
		{Op: OpWrite, Source: in, Target: seg, TargetAddr: dev, Length: size},
		{Op: OpRead, Source: out, Target: seg, TargetAddr: dev, Length: size},
	} {
		b, err := e.AllocateBatch(1)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Submit(ctx, b, []Request{r}); err != nil {
			t.Fatal(err)
		}
		st, err := e.Wait(ctx, b)
		if err != nil || st[0].State != TaskCompleted {
			t.Fatalf("%v: %+v %v", r.Op, st, err)
		}
		if err := e.FreeBatch(b); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(inb, outb) {
		t.Fatalf("round trip differs at %d", firstDiff(inb, outb))
	}
	if err := e.UnregisterMemory(dev); err != nil {
		t.Fatal(err)
	}
	if err := e.FreeMemory(dev); err != nil {
		t.Fatal(err)
	}
	if err := e.FreeMemory(dev); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("second free: %v", err)
	}
}

func TestParseCUDACopy(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want CUDACopy
		ok   bool
	}{
		{"kernel", CUDACopyKernel, true}, {"memcpy", CUDACopyMemcpy, true}, {"warp", CUDACopyWarp, true},
		{"batch", CUDACopyBatch, true}, {"", 0, false}, {"Kernel", 0, false}, {"dma", 0, false},
	} {
		got, err := ParseCUDACopy(tt.in)
		if tt.ok != (err == nil) || (tt.ok && got != tt.want) {
			t.Errorf("ParseCUDACopy(%q) = %v, %v", tt.in, got, err)
		}
		if err != nil && !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("ParseCUDACopy(%q): %v, want ErrInvalidRequest", tt.in, err)
		}
		if tt.ok && got.String() != tt.in {
			t.Errorf("%v.String() = %q", got, got.String())
		}
	}
	if s := CUDACopy(9).String(); s != "CUDACopy(9)" {
		t.Errorf("String of an unknown mode: %q", s)
	}
}

func TestCUDACopyEnvRejected(t *testing.T) {
	t.Setenv(CUDACopyEnv, "dma")
	_, err := New(context.Background(), Config{Backend: "cuda"})
	if !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("New(cuda) with %s=dma: %v, want ErrInvalidRequest", CUDACopyEnv, err)
	}
}

func TestCUDAReadyEventHandleSize(t *testing.T) {
	e := newCUDAEngine(CUDAOptions{}, 0)
	for _, n := range []int{0, 63, 65} {
		if err := e.WaitReady(context.Background(), make([]byte, n)); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("WaitReady with a %d-byte handle: %v, want ErrInvalidRequest", n, err)
		}
	}
}

func TestCUDAChunkEnvRejected(t *testing.T) {
	for _, v := range []string{"0", "-1", "x", "100"} {
		t.Setenv(CUDAChunkEnv, v)
		if _, err := New(context.Background(), Config{Backend: "cuda"}); !errors.Is(err, ErrInvalidRequest) {
			t.Fatalf("New(cuda) with %s=%s: %v, want ErrInvalidRequest", CUDAChunkEnv, v, err)
		}
	}
}
