package rdma_test

import (
	"bufio"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

// The push/reseed flow across processes, as the sidecars run it on one node:
//
//	worker (child process)    owns the decode KV pool D and a second pool D2 on GPU 0, fills D
//	                          with the known-bytes pattern and exports both by CUDA IPC handle;
//	D sidecar (child process) imports D and D2 from the worker's handles into its cuda engine
//	                          (device 0) and, on command, pushes the session D -> P store;
//	P sidecar (this process)  owns the snapshot store on GPU 1 (and a pinned host store),
//	                          measures the baseline, pulls the session into host memory, and
//	                          reseeds it from the GPU store into D2; verifies every byte.
//
// TestCUDAFlow runs it small on any GPU machine; TestCUDABenchGPU (KVC_GPU_BENCH=1) runs the
// Qwen3-30B-A3B-shaped 50,000-token session and prints the figures.

type cudaShape struct {
	Layers     int    `json:"layers"`
	Tokens     int    `json:"tokens"`
	PageSize   int    `json:"page_size"`
	TokenBytes uint64 `json:"token_bytes"` // per token per buffer
	PoolFactor int    `json:"pool_factor"` // pool pages = factor × session pages (fragmentation)
	Session    string `json:"session"`
}

func (s cudaShape) buffers() int      { return 2 * s.Layers }
func (s cudaShape) itemLen() uint64   { return uint64(s.PageSize) * s.TokenBytes }
func (s cudaShape) sessionPages() int { return (s.Tokens + s.PageSize - 1) / s.PageSize }
func (s cudaShape) poolPages() int    { return s.PoolFactor * s.sessionPages() }
func (s cudaShape) bufLen() uint64    { return uint64(s.poolPages()) * s.itemLen() }
func (s cudaShape) poolLen() uint64   { return uint64(s.buffers()) * s.bufLen() }
func (s cudaShape) sessionBytes() uint64 {
	return uint64(s.Tokens) * s.TokenBytes * uint64(s.buffers())
}
func (s cudaShape) seed() uint64 { return kvpool.SessionSeed(s.Session) }
func (s cudaShape) layout(base uint64) rdma.Layout {
	l := rdma.Layout{PageSize: s.PageSize, ItemLen: s.itemLen(), NumLayers: s.Layers, PageCount: int64(s.poolPages())}
	for b := 0; b < s.buffers(); b++ {
		l.BufferAddrs = append(l.BufferAddrs, base+uint64(b)*s.bufLen())
	}
	return l
}

// pages is the sorted random page map of one side ("D", "P", "H", "D2"): a random half (for
// pool factor 2) of the pool's pages, in token order.
func (s cudaShape) pages(side string) []int64 {
	rng := rand.New(rand.NewPCG(kvpool.SessionSeed(side), s.seed()))
	perm := rng.Perm(s.poolPages())[:s.sessionPages()]
	out := make([]int64, len(perm))
	for i, p := range perm {
		out[i] = int64(p)
	}
	slices.Sort(out)
	return out
}

type cudaPoolInfo struct {
	Base   uint64 `json:"base"`
	Handle string `json:"handle"`
	Device int    `json:"device"`
}

type cudaWorkerInfo struct {
	D  cudaPoolInfo `json:"d"`
	D2 cudaPoolInfo `json:"d2"`
}

func (p cudaPoolInfo) memory(off uint64) *rdma.CUDAMemory {
	h, _ := hex.DecodeString(p.Handle)
	return &rdma.CUDAMemory{Device: p.Device, IPCHandle: h, Offset: off}
}

// ---- child processes ----

// TestCUDAChild is the entry point of the flow's child processes; it does nothing otherwise.
func TestCUDAChild(t *testing.T) {
	role := os.Getenv("KVC_CUDA_CHILD")
	if role == "" {
		t.Skip("not a child process")
	}
	var shape cudaShape
	if err := json.Unmarshal([]byte(os.Getenv("KVC_CUDA_SHAPE")), &shape); err != nil {
		fmt.Println("ERROR shape:", err)
		os.Exit(1)
	}
	var err error
	switch role {
	case "worker":
		err = cudaWorkerMain(shape)
	case "dsidecar":
		err = cudaDSidecarMain(shape)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Println("ERROR", role+":", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// cudaWorkerMain allocates D and D2 on device 0, fills D's session pages with the pattern,
// prints the IPC handles and waits for stdin to close.
func cudaWorkerMain(s cudaShape) error {
	drv, err := cuda.Load()
	if err != nil {
		return err
	}
	ctx, err := drv.PrimaryContext(0)
	if err != nil {
		return err
	}
	var info cudaWorkerInfo
	for _, p := range []*cudaPoolInfo{&info.D, &info.D2} {
		base, err := ctx.MemAlloc(s.poolLen())
		if err != nil {
			return err
		}
		defer ctx.MemFree(base)
		if err := ctx.MemsetD8(base, 0, s.poolLen()); err != nil {
			return err
		}
		h, err := ctx.IPCGetHandle(base)
		if err != nil {
			return err
		}
		*p = cudaPoolInfo{Base: base, Handle: hex.EncodeToString(h[:]), Device: 0}
	}
	stage, err := ctx.MemHostAlloc(s.bufLen())
	if err != nil {
		return err
	}
	defer ctx.MemFreeHost(stage)
	img := cuda.HostBytes(stage, s.bufLen())
	pages := s.pages("D")
	for b := 0; b < s.buffers(); b++ {
		clear(img)
		cudaParallel(s.Tokens, func(tok int) {
			off := uint64(pages[tok/s.PageSize])*s.itemLen() + uint64(tok%s.PageSize)*s.TokenBytes
			kvpool.FillToken(img[off:off+s.TokenBytes], s.seed(), int64(tok), b)
		})
		if err := ctx.MemcpyHtoD(info.D.Base+uint64(b)*s.bufLen(), unsafe.Pointer(&img[0]), s.bufLen()); err != nil {
			return err
		}
	}
	js, _ := json.Marshal(info)
	fmt.Printf("WORKER %s\n", js)
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// cudaDSidecarMain imports the worker's pools into a cuda engine on device 0 and pushes the
// session to a peer segment on command: "push <segment> <reps> <chunk> <block> <group> <mode>".
func cudaDSidecarMain(s cudaShape) error {
	var w cudaWorkerInfo
	if err := json.Unmarshal([]byte(os.Getenv("KVC_CUDA_WORKER")), &w); err != nil {
		return err
	}
	ctx := context.Background()
	e, err := rdma.NewCUDA(ctx, rdma.Config{Backend: "cuda", CUDADevice: 0}, rdma.CUDAOptions{})
	if err != nil {
		return err
	}
	defer e.Close()
	for _, p := range []cudaPoolInfo{w.D, w.D2} {
		for b := 0; b < s.buffers(); b++ {
			off := uint64(b) * s.bufLen()
			r := rdma.Region{Addr: p.Base + off, Len: s.bufLen(), Kind: rdma.MemCUDA, Location: "cuda:0", CUDA: p.memory(off)}
			if err := e.RegisterMemory(r); err != nil {
				return err
			}
		}
	}
	fmt.Printf("SEGMENT %s\n", e.SegmentName())
	segs := map[string]rdma.SegmentID{}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == "ready" {
			if err := cudaReadyPush(ctx, e, s, w, f[1], segs); err != nil {
				return err
			}
			continue
		}
		if len(f) != 8 || f[0] != "push" {
			return fmt.Errorf("bad command %q", sc.Text())
		}
		seg, ok := segs[f[1]]
		if !ok {
			if seg, err = e.OpenSegment(ctx, f[1]); err != nil {
				return err
			}
			segs[f[1]] = seg
		}
		reps, _ := strconv.Atoi(f[2])
		opt, err := cudaParseOptions(f[3:])
		if err != nil {
			return err
		}
		if err := e.SetOptionsForTest(opt); err != nil {
			return err
		}
		regs, err := e.RemoteRegions(seg)
		if err != nil {
			return err
		}
		var store []uint64
		for _, r := range regs {
			if r.Kind == rdma.MemCUDA {
				store = append(store, r.Addr)
			}
		}
		sort.Slice(store, func(i, j int) bool { return store[i] < store[j] })
		if len(store) != s.buffers() {
			return fmt.Errorf("peer has %d device regions, want %d", len(store), s.buffers())
		}
		dst := s.layout(store[0])
		reqs, err := rdma.PlanPages(rdma.OpWrite, s.layout(w.D.Base), dst, s.pages("D"), s.pages("P"), seg)
		if err != nil {
			return err
		}
		times, subs, err := cudaTimeBatches(e, reqs, reps)
		if err != nil {
			return err
		}
		fmt.Printf("PUSHED %d %s %s\n", len(reqs), cudaDurations(times), cudaDurations(subs))
	}
	return sc.Err()
}

// cudaReadyPush pushes the session once into segment name's device store and, right after
// Submit, records a ready event and prints its handle ("READY <hex>") before it waits for the
// copy ("READYDONE"): the other process waits on the handle and checks the store at once.
func cudaReadyPush(ctx context.Context, e *rdma.CUDAEngine, s cudaShape, w cudaWorkerInfo, name string, segs map[string]rdma.SegmentID) error {
	if err := e.SetOptionsForTest(rdma.CUDAOptions{}); err != nil { // the default copy mode
		return err
	}
	seg, ok := segs[name]
	if !ok {
		var err error
		if seg, err = e.OpenSegment(ctx, name); err != nil {
			return err
		}
		segs[name] = seg
	}
	regs, err := e.RemoteRegions(seg)
	if err != nil {
		return err
	}
	var store []uint64
	for _, r := range regs {
		if r.Kind == rdma.MemCUDA {
			store = append(store, r.Addr)
		}
	}
	sort.Slice(store, func(i, j int) bool { return store[i] < store[j] })
	if len(store) != s.buffers() {
		return fmt.Errorf("peer has %d device regions, want %d", len(store), s.buffers())
	}
	reqs, err := rdma.PlanPages(rdma.OpWrite, s.layout(w.D.Base), s.layout(store[0]), s.pages("D"), s.pages("P"), seg)
	if err != nil {
		return err
	}
	b, err := e.AllocateBatch(len(reqs))
	if err != nil {
		return err
	}
	defer e.FreeBatch(b)
	if err := e.Submit(ctx, b, reqs); err != nil {
		return err
	}
	h, release, err := e.ReadyEvent(b)
	if err != nil {
		return err
	}
	fmt.Printf("READY %s\n", hex.EncodeToString(h))
	sts, err := e.Wait(ctx, b)
	if err != nil {
		return err
	}
	for t, st := range sts {
		if st.State != rdma.TaskCompleted {
			return fmt.Errorf("task %d: %s %v", t, st.State, st.Err)
		}
	}
	release()
	fmt.Printf("READYDONE %d\n", len(reqs))
	return nil
}

// cudaParseOptions parses "chunk block group copy [workers]".
func cudaParseOptions(f []string) (rdma.CUDAOptions, error) {
	var o rdma.CUDAOptions
	if len(f) != 4 && len(f) != 5 {
		return o, fmt.Errorf("options %q", f)
	}
	c, err1 := strconv.ParseUint(f[0], 10, 64)
	b, err2 := strconv.Atoi(f[1])
	g, err3 := strconv.Atoi(f[2])
	w, err4 := 0, error(nil)
	if len(f) == 5 {
		w, err4 = strconv.Atoi(f[4])
	}
	if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
		return o, fmt.Errorf("options %q", f)
	}
	o = rdma.CUDAOptions{ChunkBytes: c, BlockThreads: b, GroupDescs: g, Workers: w}
	if o.Copy, err1 = rdma.ParseCUDACopy(f[3]); err1 != nil {
		return o, err1
	}
	return rdma.CUDADefaultsForTest(o)
}

func cudaArgs(o rdma.CUDAOptions) string {
	return fmt.Sprintf("%d %d %d %s %d", o.ChunkBytes, o.BlockThreads, o.GroupDescs, o.Copy, o.Workers)
}

// cudaTimeBatches runs reqs as one batch reps+1 times (the first is a warm-up: kernel JIT,
// buffers, lazy peer mappings) and returns the wall time from Submit to Wait of each timed run,
// and the time Submit alone took (the host side: every copy queued). Any task that does not
// complete is an error.
func cudaTimeBatches(e rdma.Engine, reqs []rdma.Request, reps int) (total, submit []time.Duration, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	for i := 0; i <= reps; i++ {
		b, err := e.AllocateBatch(len(reqs))
		if err != nil {
			return nil, nil, err
		}
		start := time.Now()
		if err := e.Submit(ctx, b, reqs); err != nil {
			return nil, nil, err
		}
		sd := time.Since(start)
		st, err := e.Wait(ctx, b)
		d := time.Since(start)
		if err != nil {
			return nil, nil, err
		}
		for j, s := range st {
			if s.State != rdma.TaskCompleted {
				return nil, nil, fmt.Errorf("task %d: %v %v", j, s.State, s.Err)
			}
		}
		if err := e.FreeBatch(b); err != nil {
			return nil, nil, err
		}
		if i > 0 {
			total, submit = append(total, d), append(submit, sd)
		}
	}
	return total, submit, nil
}

func cudaDurations(ds []time.Duration) string {
	parts := make([]string, len(ds))
	for i, d := range ds {
		parts[i] = strconv.FormatInt(d.Nanoseconds(), 10)
	}
	return strings.Join(parts, ",")
}

func cudaParseDurations(s string) []time.Duration {
	var out []time.Duration
	for _, p := range strings.Split(s, ",") {
		if n, err := strconv.ParseInt(p, 10, 64); err == nil {
			out = append(out, time.Duration(n))
		}
	}
	return out
}

func cudaMedian(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

func cudaParallel(n int, f func(i int)) {
	w := runtime.GOMAXPROCS(0)
	var next atomic.Int64
	var wg sync.WaitGroup
	for k := 0; k < w; k++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				f(i)
			}
		}()
	}
	wg.Wait()
}

// cudaChild is a running child process of the flow, with its stdout as lines.
type cudaChild struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
}

func startCUDAChild(t *testing.T, role string, shape cudaShape, env ...string) *cudaChild {
	t.Helper()
	js, _ := json.Marshal(shape)
	cmd := exec.Command(os.Args[0], "-test.run=^TestCUDAChild$", "-test.timeout=20m")
	cmd.Env = append(os.Environ(), append([]string{"KVC_CUDA_CHILD=" + role, "KVC_CUDA_SHAPE=" + string(js)}, env...)...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &cudaChild{cmd: cmd, in: in, lines: make(chan string, 64)}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
		close(c.lines)
	}()
	t.Cleanup(func() {
		_ = c.in.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return c
}

// expect returns the rest of the first line starting with prefix; an ERROR line, the end of
// output or the deadline fail the test.
func (c *cudaChild) expect(t *testing.T, prefix string, timeout time.Duration) string {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-c.lines:
			if !ok {
				t.Fatalf("child exited before %q", prefix)
			}
			if strings.HasPrefix(l, "ERROR") {
				t.Fatalf("child: %s", l)
			}
			if rest, ok := strings.CutPrefix(l, prefix+" "); ok {
				return rest
			}
		case <-deadline:
			t.Fatalf("no %q from child within %v", prefix, timeout)
		}
	}
}

// ---- the P side (this process) ----

type cudaFlowResult struct {
	baseline, push, pull, pushHost, hostBaseline, reseed time.Duration
	pullSubmit, readyWait                                time.Duration
	requests                                             int
	sweep                                                []string
	checked, mismatches                                  int64
}

// cudaTestDriver returns the driver, or skips the test when libcuda or a device is missing.
func cudaTestDriver(t testing.TB) *cuda.Driver {
	t.Helper()
	d, err := cuda.Load()
	if err != nil {
		t.Skipf("no CUDA here: %v", err)
	}
	return d
}

func gbps(bytes uint64, d time.Duration) float64 { return float64(bytes) / d.Seconds() / 1e9 }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// cudaVerify copies each buffer of the pool at base back to host memory and checks every token
// slot of the session against the pattern and every other page for zeros.
func cudaVerify(s cudaShape, ctx *cuda.Context, base uint64, onHost bool, pages []int64, stage []byte, stagePtr uint64, res *cudaFlowResult) error {
	inSession := make([]bool, s.poolPages())
	for _, p := range pages {
		inSession[p] = true
	}
	var bad atomic.Int64
	for b := 0; b < s.buffers(); b++ {
		var img []byte
		if onHost {
			img = cuda.HostBytes(base+uint64(b)*s.bufLen(), s.bufLen())
		} else {
			if err := ctx.MemcpyDtoH(unsafe.Pointer(&stage[0]), base+uint64(b)*s.bufLen(), s.bufLen()); err != nil {
				return err
			}
			img = stage
		}
		cudaParallel(s.poolPages(), func(p int) {
			pg := img[uint64(p)*s.itemLen():][:s.itemLen()]
			if !inSession[p] {
				for _, c := range pg {
					if c != 0 {
						bad.Add(1)
						return
					}
				}
			}
		})
		cudaParallel(s.Tokens, func(tok int) {
			off := uint64(pages[tok/s.PageSize])*s.itemLen() + uint64(tok%s.PageSize)*s.TokenBytes
			if !kvpool.CheckToken(img[off:off+s.TokenBytes], s.seed(), int64(tok), b) {
				bad.Add(1)
			}
		})
		res.checked += int64(s.Tokens)
	}
	_ = stagePtr
	res.mismatches += bad.Load()
	return nil
}

func runCUDAFlow(t *testing.T, s cudaShape, reps int, sweep []rdma.CUDAOptions) cudaFlowResult {
	drv := cudaTestDriver(t)
	ndev, err := drv.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	storeDev := min(1, ndev-1)
	var res cudaFlowResult

	worker := startCUDAChild(t, "worker", s)
	wjs := worker.expect(t, "WORKER", 5*time.Minute)
	var w cudaWorkerInfo
	if err := json.Unmarshal([]byte(wjs), &w); err != nil {
		t.Fatal(err)
	}
	dside := startCUDAChild(t, "dsidecar", s, "KVC_CUDA_WORKER="+wjs)
	dseg := dside.expect(t, "SEGMENT", time.Minute)

	ctx := context.Background()
	p, err := rdma.NewCUDA(ctx, rdma.Config{Backend: "cuda", CUDADevice: storeDev}, sweep[0])
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	sctx, err := drv.PrimaryContext(storeDev)
	if err != nil {
		t.Fatal(err)
	}
	defer sctx.Release()

	store, err := sctx.MemAlloc(s.poolLen())
	if err != nil {
		t.Fatal(err)
	}
	defer sctx.MemFree(store)
	host, err := sctx.MemHostAlloc(s.poolLen())
	if err != nil {
		t.Fatal(err)
	}
	defer sctx.MemFreeHost(host)
	stagePtr, err := sctx.MemHostAlloc(s.bufLen())
	if err != nil {
		t.Fatal(err)
	}
	defer sctx.MemFreeHost(stagePtr)
	stage := cuda.HostBytes(stagePtr, s.bufLen())
	for b := 0; b < s.buffers(); b++ {
		off := uint64(b) * s.bufLen()
		if err := p.RegisterMemory(rdma.Region{Addr: store + off, Len: s.bufLen(), Kind: rdma.MemCUDA}); err != nil {
			t.Fatal(err)
		}
		if err := p.RegisterMemory(rdma.Region{Addr: host + off, Len: s.bufLen(), Kind: rdma.MemHost}); err != nil {
			t.Fatal(err)
		}
	}
	dsid, err := p.OpenSegment(ctx, dseg)
	if err != nil {
		t.Fatal(err)
	}
	dBase, err := p.ImportForTest(w.D.memory(0))
	if err != nil {
		t.Fatal(err)
	}
	d2Base, err := p.ImportForTest(w.D2.memory(0))
	if err != nil {
		t.Fatal(err)
	}
	if storeDev != 0 {
		if err := p.EnablePeerForTest(storeDev, 0); err != nil {
			t.Fatal(err)
		}
	}

	// Baseline: one contiguous peer copy of the session's bytes, D (GPU 0) -> store (GPU 1).
	stream, err := sctx.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer sctx.StreamDestroy(stream)
	timeCopy := func(f func() error) time.Duration {
		var ds []time.Duration
		for i := 0; i <= reps; i++ {
			ev, err := sctx.EventCreate(false)
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if err := f(); err != nil {
				t.Fatal(err)
			}
			if err := sctx.EventRecord(ev, stream); err != nil {
				t.Fatal(err)
			}
			if err := sctx.EventSynchronize(ev); err != nil {
				t.Fatal(err)
			}
			if i > 0 {
				ds = append(ds, time.Since(start))
			}
			_ = sctx.EventDestroy(ev)
		}
		return cudaMedian(ds)
	}
	n := s.sessionBytes()
	res.baseline = timeCopy(func() error { return sctx.MemcpyDtoDAsync(store, dBase, n, stream) })
	res.hostBaseline = timeCopy(func() error { return sctx.MemcpyDtoHAsync(host, dBase, n, stream) })
	if err := sctx.MemsetD8(store, 0, s.poolLen()); err != nil {
		t.Fatal(err)
	}
	clear(cuda.HostBytes(host, s.poolLen()))

	// Push D -> P (GPU store), by the D sidecar, for each option set of the sweep; the store
	// is cleared before and checked after each.
	for i, o := range sweep {
		if i > 0 {
			if err := sctx.MemsetD8(store, 0, s.poolLen()); err != nil {
				t.Fatal(err)
			}
		}
		fmt.Fprintf(dside.in, "push %s %d %s\n", p.SegmentName(), reps, cudaArgs(o))
		f := strings.Fields(dside.expect(t, "PUSHED", 10*time.Minute))
		res.requests, _ = strconv.Atoi(f[0])
		d := cudaMedian(cudaParseDurations(f[1]))
		if i == 0 {
			res.push = d
		}
		res.sweep = append(res.sweep, fmt.Sprintf("push   chunk=%-6d block=%-4d group=%-6d copy=%-6s workers=%-2d %7.1f GB/s %6.2f ms, Submit %5.2f ms (medians of %d, %d requests)",
			o.ChunkBytes, o.BlockThreads, o.GroupDescs, o.Copy, o.Workers, gbps(n, d), ms(d), ms(cudaMedian(cudaParseDurations(f[2]))), reps, res.requests))
		if err := cudaVerify(s, sctx, store, false, s.pages("P"), stage, stagePtr, &res); err != nil {
			t.Fatal(err)
		}
	}

	// Ready event across processes: the D sidecar submits a push, records a ready event right
	// after Submit and sends its handle before it waits; this process waits on the handle and
	// checks the whole store at once, before the D side reports its own Wait.
	if err := sctx.MemsetD8(store, 0, s.poolLen()); err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(dside.in, "ready %s\n", p.SegmentName())
	hexh := strings.TrimSpace(dside.expect(t, "READY", time.Minute))
	h, err := hex.DecodeString(hexh)
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, time.Minute)
	t0 := time.Now()
	err = p.WaitReady(wctx, h)
	wcancel()
	if err != nil {
		t.Fatalf("WaitReady: %v", err)
	}
	res.readyWait = time.Since(t0)
	if err := cudaVerify(s, sctx, store, false, s.pages("P"), stage, stagePtr, &res); err != nil {
		t.Fatalf("store after WaitReady: %v", err)
	}
	dside.expect(t, "READYDONE", time.Minute)

	// Pull D -> P store: the P side reads D over NVLink (the kernel runs on the store's GPU).
	if err := sctx.MemsetD8(store, 0, s.poolLen()); err != nil {
		t.Fatal(err)
	}
	dl := s.layout(w.D.Base)
	reqs, err := rdma.PlanPages(rdma.OpRead, dl, s.layout(store), s.pages("D"), s.pages("P"), dsid)
	if err != nil {
		t.Fatal(err)
	}
	ts, subs, err := cudaTimeBatches(p, reqs, reps)
	if err != nil {
		t.Fatal(err)
	}
	res.pull, res.pullSubmit = cudaMedian(ts), cudaMedian(subs)
	if err := cudaVerify(s, sctx, store, false, s.pages("P"), stage, stagePtr, &res); err != nil {
		t.Fatal(err)
	}

	// Push D -> P into pinned host memory: the P side reads (the kernel runs on the P side's
	// GPU, reads D over NVLink and writes host memory over PCIe).
	reqs, err = rdma.PlanPages(rdma.OpRead, dl, s.layout(host), s.pages("D"), s.pages("H"), dsid)
	if err != nil {
		t.Fatal(err)
	}
	ts, _, err = cudaTimeBatches(p, reqs, reps)
	if err != nil {
		t.Fatal(err)
	}
	res.pushHost = cudaMedian(ts)
	if err := cudaVerify(s, nil, host, true, s.pages("H"), nil, 0, &res); err != nil {
		t.Fatal(err)
	}

	// Reseed P (GPU store) -> D2 (GPU 0), by the P sidecar, for each option set. D2 starts
	// zeroed: it is checked after the first (reported) option set and after the last.
	reqs, err = rdma.PlanPages(rdma.OpWrite, s.layout(store), s.layout(w.D2.Base), s.pages("P"), s.pages("D2"), dsid)
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range sweep {
		if err := p.SetOptionsForTest(o); err != nil {
			t.Fatal(err)
		}
		ts, subs, err := cudaTimeBatches(p, reqs, reps)
		if err != nil {
			t.Fatal(err)
		}
		d := cudaMedian(ts)
		if i == 0 {
			res.reseed = d
		}
		res.sweep = append(res.sweep, fmt.Sprintf("reseed chunk=%-6d block=%-4d group=%-6d copy=%-6s workers=%-2d %7.1f GB/s %6.2f ms, Submit %5.2f ms (medians of %d, %d requests)",
			o.ChunkBytes, o.BlockThreads, o.GroupDescs, o.Copy, o.Workers, gbps(n, d), ms(d), ms(cudaMedian(subs)), reps, len(reqs)))
		if i == 0 || i == len(sweep)-1 {
			if err := cudaVerify(s, sctx, d2Base, false, s.pages("D2"), stage, stagePtr, &res); err != nil {
				t.Fatal(err)
			}
		}
	}
	return res
}

func TestCUDAFlow(t *testing.T) {
	if testing.Short() {
		t.Skip("multi-process GPU flow")
	}
	s := cudaShape{Layers: 2, Tokens: 1000, PageSize: 16, TokenBytes: 1024, PoolFactor: 2, Session: "flow"}
	res := runCUDAFlow(t, s, 1, []rdma.CUDAOptions{{ChunkBytes: 4096, GroupDescs: 64}})
	if res.mismatches != 0 {
		t.Fatalf("%d of %d token slots (and stray pages) mismatched", res.mismatches, res.checked)
	}
	if res.checked != int64(5*s.Tokens*s.buffers()) { // push, ready push, pull, host, reseed
		t.Fatalf("checked %d token slots", res.checked)
	}
}

// TestCUDABenchGPU is the H200 benchmark (make bench-gpu; deploy/gpu/bench-gpu.sh). Knobs:
// KVC_GPU_BENCH=1 to run, KVC_GPU_BENCH_TOKENS (50000), KVC_GPU_BENCH_REPS (5),
// KVC_GPU_BENCH_SWEEP ("chunk:block:group:copy[:workers],..."; the first is the reported one).
func TestCUDABenchGPU(t *testing.T) {
	if os.Getenv("KVC_GPU_BENCH") != "1" {
		t.Skip("set KVC_GPU_BENCH=1 to run the GPU benchmark")
	}
	drv := cudaTestDriver(t)
	tokens, reps := 50000, 5
	if v, err := strconv.Atoi(os.Getenv("KVC_GPU_BENCH_TOKENS")); err == nil && v > 0 {
		tokens = v
	}
	if v, err := strconv.Atoi(os.Getenv("KVC_GPU_BENCH_REPS")); err == nil && v > 0 {
		reps = v
	}
	sweep := []rdma.CUDAOptions{{}}
	if v := os.Getenv("KVC_GPU_BENCH_SWEEP"); v != "" {
		sweep = nil
		for _, item := range strings.Split(v, ",") {
			o, err := cudaParseOptions(strings.Split(item, ":"))
			if err != nil {
				t.Fatal(err)
			}
			sweep = append(sweep, o)
		}
	}
	for i := range sweep {
		o, err := rdma.CUDADefaultsForTest(sweep[i])
		if err != nil {
			t.Fatal(err)
		}
		sweep[i] = o
	}
	s := cudaShape{Layers: 48, Tokens: tokens, PageSize: 16, TokenBytes: 1024, PoolFactor: 2, Session: "bench-session"}
	ndev, _ := drv.DeviceCount()
	ver, _ := drv.Version()
	var names []string
	for i := 0; i < ndev; i++ {
		nm, _ := drv.DeviceName(i)
		names = append(names, nm)
	}
	fmt.Printf("device: %d × %s, CUDA driver %d.%d, GOMAXPROCS %d\n", ndev, strings.Join(names, " / "), ver/1000, ver%1000/10, runtime.GOMAXPROCS(0))
	fmt.Printf("shape: %d layers × K,V, %d B per token, page %d, %d tokens = %d bytes, pools of %d pages (%.0f%% fragmented), %d runs per buffer\n",
		s.Layers, s.TokenBytes*uint64(s.buffers()), s.PageSize, s.Tokens, s.sessionBytes(), s.poolPages(), 100*(1-1/float64(s.PoolFactor)), cudaRuns(s.pages("D"), s.pages("P")))
	start := time.Now()
	res := runCUDAFlow(t, s, reps, sweep)
	n := s.sessionBytes()
	fmt.Printf("baseline: one contiguous peer copy GPU 0 -> GPU 1 of the same bytes %.1f GB/s, %.2f ms\n", gbps(n, res.baseline), ms(res.baseline))
	for _, l := range res.sweep {
		fmt.Println(l)
	}
	fmt.Printf("pull: P reads the session from D over NVLink (copy kernel on GPU 1) %.1f GB/s, %.2f ms, Submit %.2f ms, ratio %.2f\n",
		gbps(n, res.pull), ms(res.pull), ms(res.pullSubmit), float64(res.baseline)/float64(res.pull))
	fmt.Printf("ready event: the P side's WaitReady on the D side's event (recorded right after Submit) returned after %.2f ms; the store, checked at once, was complete\n", ms(res.readyWait))
	fmt.Printf("host: push to pinned host %.1f GB/s, contiguous device-to-host baseline %.1f GB/s, ratio %.2f\n",
		gbps(n, res.pushHost), gbps(n, res.hostBaseline), float64(res.hostBaseline)/float64(res.pushHost))
	fmt.Printf("verify: %d token slots checked (x %d B) in %d destination images (each push of the sweep, pull, host, first and last reseed) plus every page outside the session, %d mismatches; bench took %v\n",
		res.checked, s.TokenBytes, res.checked/int64(s.Tokens*s.buffers()), res.mismatches, time.Since(start).Round(time.Second))
	push, reseed, base := gbps(n, res.push), gbps(n, res.reseed), gbps(n, res.baseline)
	fmt.Printf("gpu: push %.1f GB/s, reseed %.1f GB/s, peer-copy baseline %.1f GB/s, ratio %.2f\n",
		push, reseed, base, min(push, reseed)/base)
	if res.mismatches != 0 {
		t.Fatalf("%d mismatches", res.mismatches)
	}
}

func cudaRuns(a, b []int64) int {
	runs := 0
	for i := range a {
		if i == 0 || a[i] != a[i-1]+1 || b[i] != b[i-1]+1 {
			runs++
		}
	}
	return runs
}
