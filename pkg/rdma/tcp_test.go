package rdma

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// mmapArena returns n bytes of anonymous memory outside the Go heap (registered memory must not
// be Go heap memory), unmapped at the end of the test.
func mmapArena(tb testing.TB, n int) []byte {
	tb.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = syscall.Munmap(b) })
	return b
}

func tAddr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func fillPattern(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func newTCPEngine(tb testing.TB, cfg Config) *tcpEngine {
	tb.Helper()
	cfg.Backend = "tcp"
	if cfg.ListenAddr == "" {
		cfg.ListenAddr = "127.0.0.1:0"
	}
	e, err := New(context.Background(), cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = e.Close() })
	return e.(*tcpEngine)
}

func waitCtx(tb testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	tb.Cleanup(cancel)
	return ctx
}

// poolIn lays a Layout over mem.
func poolIn(mem []byte, layers, ps int, tokenBytes uint64, pages int64) Layout {
	l := Layout{PageSize: ps, ItemLen: uint64(ps) * tokenBytes, NumLayers: layers, PageCount: pages}
	for b := 0; b < 2*layers; b++ {
		l.BufferAddrs = append(l.BufferAddrs, tAddr(mem)+uint64(b)*l.BufferLen())
	}
	return l
}

// fragmentedPages returns n distinct pages of [0, count) in random order.
func fragmentedPages(r *rand.Rand, n int, count int64) []int64 {
	perm := r.Perm(int(count))
	out := make([]int64, n)
	for i := range out {
		out[i] = int64(perm[i])
	}
	return out
}

func TestTCPFragmentedWriteAndRead(t *testing.T) {
	// Both ways of sending WRITE payloads: in place (writev) and copied next to their headers.
	for _, copyMax := range []int{0, 64 << 10} {
		t.Run(fmt.Sprintf("copy<=%d", copyMax), func(t *testing.T) {
			defer func(old int) { sendCopyMax = old }(sendCopyMax)
			sendCopyMax = copyMax
			testFragmentedWriteAndRead(t)
		})
	}
}

func testFragmentedWriteAndRead(t *testing.T) {
	const layers, ps, tb, pages = 3, 16, 24, 64
	srcMem := mmapArena(t, 2*layers*ps*tb*pages)
	dstMem := mmapArena(t, 2*layers*ps*tb*pages)
	backMem := mmapArena(t, 2*layers*ps*tb*pages)
	fillPattern(srcMem, 1)
	src, dst, back := poolIn(srcMem, layers, ps, tb, pages), poolIn(dstMem, layers, ps, tb, pages), poolIn(backMem, layers, ps, tb, pages)

	a := newTCPEngine(t, Config{Conns: 3, SliceBytes: 1000}) // odd slice size: slices straddle pages
	b := newTCPEngine(t, Config{Conns: 2})
	for _, r := range src.Regions(MemHost, "cpu") {
		if err := a.RegisterMemory(r); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range back.Regions(MemHost, "cpu") {
		if err := a.RegisterMemory(r); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range dst.Regions(MemShared, "/dev/shm/x") {
		if err := b.RegisterMemory(r); err != nil {
			t.Fatal(err)
		}
	}
	ctx := waitCtx(t)
	seg, err := a.OpenSegment(ctx, b.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	regs, err := a.RemoteRegions(seg)
	if err != nil || len(regs) != 2*layers || regs[0].Kind != MemShared {
		t.Fatalf("remote regions %+v, %v", regs, err)
	}
	rnd := rand.New(rand.NewPCG(7, 8))
	srcPages := fragmentedPages(rnd, 40, pages)
	dstPages := fragmentedPages(rnd, 40, pages)
	// Make a few runs contiguous on both sides.
	for i := 0; i < 3; i++ {
		srcPages[10+i], dstPages[10+i] = srcPages[10]+int64(i), dstPages[10]+int64(i)
	}
	dedupe := func(ps []int64) {
		seen := map[int64]bool{}
		for i, p := range ps {
			for seen[p] {
				p = (p + 1) % pages
			}
			seen[p] = true
			ps[i] = p
		}
	}
	dedupe(srcPages)
	dedupe(dstPages)
	reqs, err := PlanPages(OpWrite, src, dst, srcPages, dstPages, seg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := TransferSync(ctx, a, reqs, Deadline{Base: 10 * time.Second})
	if err != nil {
		t.Fatalf("write: %v (%+v)", err, res.Tasks[:1])
	}
	want := uint64(len(srcPages)) * src.ItemLen * uint64(src.NumBuffers())
	if res.Bytes != want || res.Failed != 0 {
		t.Fatalf("moved %d bytes (%d failed), want %d", res.Bytes, res.Failed, want)
	}
	written := map[int64]int64{}
	for i := range dstPages {
		written[dstPages[i]] = srcPages[i]
	}
	for buf := 0; buf < src.NumBuffers(); buf++ {
		for p := int64(0); p < pages; p++ {
			d := memAt(dst.BufferAddrs[buf]+uint64(p)*dst.ItemLen, dst.ItemLen)
			if sp, ok := written[p]; ok {
				if !bytes.Equal(d, memAt(src.BufferAddrs[buf]+uint64(sp)*src.ItemLen, src.ItemLen)) {
					t.Fatalf("buffer %d page %d differs from source page %d", buf, p, sp)
				}
			} else if !bytes.Equal(d, make([]byte, len(d))) {
				t.Fatalf("buffer %d page %d written though not in the page map", buf, p)
			}
		}
	}

	// READ it back from b into a third pool, token-granular: tokens [5, 600) of the session
	// whose pages (in token order) are dstPages on b and backPages locally.
	backPages := make([]int64, len(dstPages))
	for i := range backPages {
		backPages[i] = int64(len(dstPages) - 1 - i)
	}
	rreqs, err := PlanTokens(OpRead, dst, back, dstPages, backPages, 5, 600, seg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := TransferSync(ctx, a, rreqs, Deadline{Base: 10 * time.Second}); err != nil {
		t.Fatalf("read: %v", err)
	}
	for buf := 0; buf < src.NumBuffers(); buf++ {
		for tok := int64(0); tok < int64(len(dstPages))*ps; tok++ {
			pi, in := tok/ps, uint64(tok%ps)*tb
			got := memAt(back.BufferAddrs[buf]+uint64(backPages[pi])*back.ItemLen+in, tb)
			exp := memAt(src.BufferAddrs[buf]+uint64(srcPages[pi])*src.ItemLen+in, tb)
			if tok >= 5 && tok < 600 {
				if !bytes.Equal(got, exp) {
					t.Fatalf("read back: buffer %d token %d differs", buf, tok)
				}
			} else if !bytes.Equal(got, make([]byte, tb)) {
				t.Fatalf("read back: buffer %d token %d outside [5,600) was written", buf, tok)
			}
		}
	}
	if err := a.CloseSegment(seg); err != nil {
		t.Fatal(err)
	}
	if err := a.CloseSegment(seg); !errors.Is(err, ErrUnknownSegment) {
		t.Fatalf("second CloseSegment = %v", err)
	}
}

// TestTCPBounds: every request that leaves registered memory fails as a task with a clear error,
// the owner refuses out-of-region targets, and no byte outside the region changes.
func TestTCPBounds(t *testing.T) {
	const guard, size = 4096, 8192
	ownerMem := mmapArena(t, guard+size+guard)
	fillPattern(ownerMem, 3)
	orig := append([]byte(nil), ownerMem...)
	region := ownerMem[guard : guard+size]
	localMem := mmapArena(t, 2*size)
	fillPattern(localMem, 4)

	owner := newTCPEngine(t, Config{Conns: 2})
	if err := owner.RegisterMemory(Region{Addr: tAddr(region), Len: size, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	cli := newTCPEngine(t, Config{Conns: 2})
	if err := cli.RegisterMemory(Region{Addr: tAddr(localMem), Len: size, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	ra, la := tAddr(region), tAddr(localMem)
	tests := []struct {
		name string
		req  Request
		want error
	}{
		{"write before region", Request{OpWrite, la, seg, ra - 1, 16}, ErrOutOfBounds},
		{"write past end", Request{OpWrite, la, seg, ra + size - 8, 16}, ErrOutOfBounds},
		{"write far away", Request{OpWrite, la, seg, ra + 1<<30, 16}, ErrOutOfBounds},
		{"write wraps", Request{OpWrite, la, seg, ^uint64(0) - 4, 16}, ErrOutOfBounds},
		{"big write past end", Request{OpWrite, la, seg, ra + 100, size}, ErrOutOfBounds},
		{"read past end", Request{OpRead, la, seg, ra + size - 1, 2}, ErrOutOfBounds},
		{"read null", Request{OpRead, la, seg, 0, 2}, ErrOutOfBounds},
		{"zero length", Request{OpWrite, la, seg, ra, 0}, ErrInvalidRequest},
		{"bad opcode", Request{Opcode(7), la, seg, ra, 8}, ErrInvalidRequest},
		{"unknown segment", Request{OpWrite, la, seg + 100, ra, 8}, ErrUnknownSegment},
		{"local source unregistered", Request{OpWrite, la + size, seg, ra, 8}, ErrOutOfBounds},
		{"local destination straddles", Request{OpRead, la + size - 4, seg, ra, 8}, ErrOutOfBounds},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := TransferSync(ctx, cli, []Request{tt.req}, Deadline{Base: 10 * time.Second})
			if !errors.Is(err, tt.want) || res.Failed != 1 || res.Tasks[0].State != TaskFailed || !errors.Is(res.Tasks[0].Err, tt.want) {
				t.Fatalf("got %v (%+v), want %v", err, res.Tasks, tt.want)
			}
		})
	}
	// A good request next to bad ones in one batch still completes.
	res, err := TransferSync(ctx, cli, []Request{
		{OpWrite, la, seg, ra + size - 8, 16},
		{OpWrite, la, seg, ra + 8, 100},
	}, Deadline{Base: 10 * time.Second})
	if err == nil || res.Tasks[0].State != TaskFailed || res.Tasks[1].State != TaskCompleted || res.Tasks[1].BytesDone != 100 {
		t.Fatalf("mixed batch: %v %+v", err, res.Tasks)
	}
	copy(orig[guard+8:], localMem[:100])
	if !bytes.Equal(ownerMem, orig) {
		t.Fatal("owner memory changed outside the accepted write")
	}
	// Unregistered owner memory is refused afterwards, and the refusal is the owner's.
	if err := owner.UnregisterMemory(ra); err != nil {
		t.Fatal(err)
	}
	res, err = TransferSync(ctx, cli, []Request{{OpWrite, la, seg, ra, 8}}, Deadline{Base: 10 * time.Second})
	if !errors.Is(err, ErrOutOfBounds) || !strings.Contains(err.Error(), "refused by the owner") {
		t.Fatalf("write to withdrawn region: %v", err)
	}
	if !bytes.Equal(ownerMem, orig) {
		t.Fatal("withdrawn region written")
	}
}

func TestTCPRegisterErrors(t *testing.T) {
	e := newTCPEngine(t, Config{})
	mem := mmapArena(t, 8192)
	a := tAddr(mem)
	if err := e.RegisterMemory(Region{Addr: a, Len: 4096, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	bad := []Region{
		{Addr: a + 100, Len: 10, Kind: MemHost},  // inside
		{Addr: a - 10, Len: 20, Kind: MemHost},   // overlaps start
		{Addr: a + 4096, Len: 0, Kind: MemHost},  // empty
		{Addr: ^uint64(0) - 5, Len: 100},         // wraps
		{Addr: a + 4096, Len: 10, Kind: MemCUDA}, // device memory
	}
	for _, r := range bad {
		if err := e.RegisterMemory(r); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("RegisterMemory(%+v) = %v", r, err)
		}
	}
	if err := e.RegisterMemory(Region{Addr: a + 4096, Len: 4096, Kind: MemHost}); err != nil {
		t.Fatalf("adjacent region: %v", err)
	}
	if err := e.UnregisterMemory(a + 1); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("unregister inside a region: %v", err)
	}
	if _, err := e.AllocateBatch(0); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("AllocateBatch(0) = %v", err)
	}
	b, _ := e.AllocateBatch(1)
	if err := e.Submit(context.Background(), b, make([]Request, 2)); !errors.Is(err, ErrBatchFull) {
		t.Fatalf("over capacity: %v", err)
	}
	if _, err := e.Status(b+1, 0); !errors.Is(err, ErrUnknownBatch) {
		t.Fatalf("unknown batch: %v", err)
	}
	if _, err := e.OpenSegment(context.Background(), "127.0.0.1:1"); !errors.Is(err, ErrUnknownSegment) {
		t.Fatalf("open unreachable segment: %v", err)
	}
	for _, cfg := range []Config{{Backend: "tcp", Conns: -1}, {Backend: "tcp", Conns: 1000}, {Backend: "tcp", SliceBytes: 1 << 30},
		{Backend: "tcp", Layout: &Layout{PageSize: 16, ItemLen: 100, NumLayers: 2}}} {
		if _, err := New(context.Background(), cfg); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("New(%+v) = %v", cfg, err)
		}
	}
	if _, err := New(context.Background(), Config{Backend: "nope"}); !errors.Is(err, ErrUnknownBackend) {
		t.Errorf("unknown backend: %v", err)
	}
}

func TestTCPLayoutHandshake(t *testing.T) {
	mem := mmapArena(t, 1<<16)
	l1 := poolIn(mem, 2, 16, 8, 16)
	l2 := l1
	l2.ItemLen = 16 * 16
	a := newTCPEngine(t, Config{Layout: &l1})
	same := newTCPEngine(t, Config{Layout: &l1})
	other := newTCPEngine(t, Config{Layout: &l2})
	none := newTCPEngine(t, Config{})
	ctx := waitCtx(t)
	if _, err := a.OpenSegment(ctx, other.SegmentName()); !errors.Is(err, ErrLayoutMismatch) {
		t.Fatalf("mismatched layout: %v", err)
	}
	if _, err := other.OpenSegment(ctx, a.SegmentName()); !errors.Is(err, ErrLayoutMismatch) {
		t.Fatalf("mismatched layout (other way): %v", err)
	}
	for _, peer := range []*tcpEngine{same, none} {
		if _, err := a.OpenSegment(ctx, peer.SegmentName()); err != nil {
			t.Fatalf("compatible peer: %v", err)
		}
	}
}

// TestTCPCancel: tasks held up at the owner are canceled at once; the batch can then be freed.
func TestTCPCancel(t *testing.T) {
	mem := mmapArena(t, 1<<20)
	owner := newTCPEngine(t, Config{Conns: 1})
	entered, release := make(chan struct{}, 1), make(chan struct{})
	owner.serverHook = func(uint8) {
		select {
		case entered <- struct{}{}:
		default:
		}
		<-release
	}
	if err := owner.RegisterMemory(Region{Addr: tAddr(mem), Len: 1 << 19, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	cli := newTCPEngine(t, Config{Conns: 1})
	if err := cli.RegisterMemory(Region{Addr: tAddr(mem) + 1<<19, Len: 1 << 19, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := cli.AllocateBatch(8)
	var reqs []Request
	for i := uint64(0); i < 8; i++ {
		reqs = append(reqs, Request{OpWrite, tAddr(mem) + 1<<19 + i*4096, seg, tAddr(mem) + i*4096, 4096})
	}
	if err := cli.Submit(ctx, b, reqs); err != nil {
		t.Fatal(err)
	}
	select {
	case <-entered:
	case <-ctx.Done():
		t.Fatal("owner never saw a frame")
	}
	if st, err := cli.Status(b, 0); err != nil || st.State != TaskPending {
		t.Fatalf("task 0 before cancel: %+v %v", st, err)
	}
	if _, err := cli.Status(b, 8); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("status of task 8: %v", err)
	}
	if err := cli.FreeBatch(b); !errors.Is(err, ErrBatchBusy) {
		t.Fatalf("free with pending tasks: %v", err)
	}
	if err := cli.Cancel(b); err != nil {
		t.Fatal(err)
	}
	st, err := cli.Wait(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range st {
		if s.State != TaskCanceled {
			t.Fatalf("task %d: %v", i, s.State)
		}
	}
	if err := cli.FreeBatch(b); err != nil {
		t.Fatal(err)
	}
	close(release)
}

// TestTCPDeadlineTimeout: TransferSync gives up at base + bytes × per-byte and reports timeouts.
func TestTCPDeadlineTimeout(t *testing.T) {
	mem := mmapArena(t, 1<<16)
	owner := newTCPEngine(t, Config{Conns: 1})
	release := make(chan struct{})
	owner.serverHook = func(uint8) { <-release }
	defer close(release)
	_ = owner.RegisterMemory(Region{Addr: tAddr(mem), Len: 1 << 15, Kind: MemHost})
	cli := newTCPEngine(t, Config{Conns: 1})
	_ = cli.RegisterMemory(Region{Addr: tAddr(mem) + 1<<15, Len: 1 << 15, Kind: MemHost})
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	d := Deadline{Base: 50 * time.Millisecond, PerByte: time.Microsecond}
	if got := d.For(1000); got != 51*time.Millisecond {
		t.Fatalf("Deadline.For = %v", got)
	}
	res, err := TransferSync(ctx, cli, []Request{{OpWrite, tAddr(mem) + 1<<15, seg, tAddr(mem), 1000}}, d)
	if !errors.Is(err, ErrTimeout) || res.Tasks[0].State != TaskTimeout {
		t.Fatalf("got %v %+v", err, res.Tasks)
	}
}

// fakeOwner accepts one connection per handshake, answers it with one region, then runs serve.
func fakeOwner(t *testing.T, region Region, serve func(c net.Conn, br *bufio.Reader)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				if _, n, err := tcpReadHeader(br); err != nil {
					return
				} else if _, err := tcpReadBody(br, n); err != nil {
					return
				}
				if _, err := c.Write(tcpEncodeHelloAck(tcpHelloAck{version: tcpWireVersion, regions: []Region{region}})); err != nil {
					return
				}
				serve(c, br)
			}()
		}
	}()
	return ln.Addr().String()
}

// TestTCPPeerDiesMidBatch: the owner reads part of a batch and disconnects; every unfinished
// task fails with ErrPeerGone long before the deadline.
func TestTCPPeerDiesMidBatch(t *testing.T) {
	local := mmapArena(t, 1<<20)
	name := fakeOwner(t, Region{Addr: 1 << 40, Len: 1 << 30, Kind: MemHost}, func(c net.Conn, br *bufio.Reader) {
		_, _, _ = tcpReadHeader(br) // one frame header, then gone
	})
	cli := newTCPEngine(t, Config{Conns: 2, SliceBytes: 64 << 10})
	_ = cli.RegisterMemory(Region{Addr: tAddr(local), Len: 1 << 20, Kind: MemHost})
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	var reqs []Request
	for i := uint64(0); i < 16; i++ {
		reqs = append(reqs, Request{OpWrite, tAddr(local) + i<<16, seg, 1<<40 + i<<16, 1 << 16})
	}
	start := time.Now()
	res, err := TransferSync(ctx, cli, reqs, Deadline{Base: 30 * time.Second})
	if !errors.Is(err, ErrPeerGone) || res.Failed != len(reqs) {
		t.Fatalf("got %v, %d failed", err, res.Failed)
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("failure took %v", el)
	}
	// The broken segment is not reused: a new OpenSegment reconnects.
	seg2, err := cli.OpenSegment(ctx, name)
	if err != nil || seg2 == seg {
		t.Fatalf("reopen: %d %v", seg2, err)
	}
	// Submitting to the dead segment fails at once.
	res, err = TransferSync(ctx, cli, reqs[:1], Deadline{Base: 30 * time.Second})
	if !errors.Is(err, ErrPeerGone) {
		t.Fatalf("dead segment: %v %+v", err, res.Tasks)
	}
}

// TestTCPProtocolViolation: an owner answering garbage breaks the connection, failing tasks.
func TestTCPProtocolViolation(t *testing.T) {
	local := mmapArena(t, 1<<16)
	name := fakeOwner(t, Region{Addr: 1 << 40, Len: 1 << 30, Kind: MemHost}, func(c net.Conn, br *bufio.Reader) {
		if _, _, err := tcpReadHeader(br); err != nil {
			return
		}
		_, _ = c.Write([]byte{5, 0, 0, 0, tcpFtReadResp, 1, 2, 3, 4}) // READ_RESP to a WRITE
		_, _ = io.Copy(io.Discard, br)
	})
	cli := newTCPEngine(t, Config{Conns: 1})
	_ = cli.RegisterMemory(Region{Addr: tAddr(local), Len: 1 << 16, Kind: MemHost})
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	_, err = TransferSync(ctx, cli, []Request{{OpWrite, tAddr(local), seg, 1 << 40, 100}}, Deadline{Base: 30 * time.Second})
	if !errors.Is(err, ErrPeerGone) {
		t.Fatalf("got %v", err)
	}
}

func TestTCPEngineClose(t *testing.T) {
	mem := mmapArena(t, 1<<16)
	owner := newTCPEngine(t, Config{Conns: 1})
	release := make(chan struct{})
	owner.serverHook = func(uint8) { <-release }
	defer close(release)
	_ = owner.RegisterMemory(Region{Addr: tAddr(mem), Len: 1 << 15, Kind: MemHost})
	cli := newTCPEngine(t, Config{Conns: 2})
	_ = cli.RegisterMemory(Region{Addr: tAddr(mem) + 1<<15, Len: 1 << 15, Kind: MemHost})
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := cli.AllocateBatch(1)
	if err := cli.Submit(ctx, b, []Request{{OpWrite, tAddr(mem) + 1<<15, seg, tAddr(mem), 10}}); err != nil {
		t.Fatal(err)
	}
	if err := cli.Close(); err != nil {
		t.Fatal(err)
	}
	st, err := cli.Wait(ctx, b)
	if err != nil || st[0].State != TaskFailed || !errors.Is(st[0].Err, ErrClosed) {
		t.Fatalf("after Close: %+v %v", st, err)
	}
	if _, err := cli.OpenSegment(ctx, owner.SegmentName()); !errors.Is(err, ErrClosed) {
		t.Fatalf("OpenSegment after Close: %v", err)
	}
}

// ---- two processes ----

const helperEnv = "KVC_RDMA_TEST_HELPER"

// TestHelperProcess is the peer process of the two-process tests (it does nothing in a normal run).
// It serves a registered region filled with pattern 42, prints "READY name addr len", and exits
// when stdin closes; in mode "die" it exits abruptly on the 2nd data frame.
func TestHelperProcess(t *testing.T) {
	mode := os.Getenv(helperEnv)
	if mode == "" {
		t.Skip("helper process only")
	}
	mem, err := syscall.Mmap(-1, 0, 4<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		os.Exit(2)
	}
	fillPattern(mem, 42)
	e, err := New(context.Background(), Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 2})
	if err != nil {
		os.Exit(2)
	}
	if mode == "die" {
		var frames atomic.Int32
		e.(*tcpEngine).serverHook = func(uint8) {
			if frames.Add(1) == 2 {
				os.Exit(3)
			}
		}
	}
	if err := e.RegisterMemory(Region{Addr: tAddr(mem), Len: uint64(len(mem)), Kind: MemHost}); err != nil {
		os.Exit(2)
	}
	fmt.Printf("READY %s %d %d\n", e.SegmentName(), tAddr(mem), len(mem))
	_, _ = io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

type helper struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	name  string
	addr  uint64
	size  uint64
}

func startHelper(t *testing.T, mode string) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := &helper{cmd: cmd, stdin: stdin}
	t.Cleanup(func() {
		stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("helper: %v", err)
	}
	f := strings.Fields(line)
	if len(f) != 4 || f[0] != "READY" {
		t.Fatalf("helper said %q", line)
	}
	h.name = f[1]
	h.addr, _ = strconv.ParseUint(f[2], 10, 64)
	h.size, _ = strconv.ParseUint(f[3], 10, 64)
	return h
}

func TestTCPTwoProcesses(t *testing.T) {
	h := startHelper(t, "serve")
	remote := make([]byte, h.size)
	fillPattern(remote, 42) // what the helper holds
	local := mmapArena(t, int(h.size))
	cli := newTCPEngine(t, Config{Conns: 3, SliceBytes: 100 << 10})
	if err := cli.RegisterMemory(Region{Addr: tAddr(local), Len: h.size, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, h.name)
	if err != nil {
		t.Fatal(err)
	}
	// READ the whole remote region in fragmented 4 KiB pages.
	const pg = 4096
	n := int(h.size / pg)
	perm := rand.New(rand.NewPCG(1, 2)).Perm(n)
	var reqs []Request
	for i, p := range perm {
		reqs = append(reqs, Request{OpRead, tAddr(local) + uint64(i)*pg, seg, h.addr + uint64(p)*pg, pg})
	}
	if _, err := TransferSync(ctx, cli, reqs, Deadline{Base: 15 * time.Second}); err != nil {
		t.Fatal(err)
	}
	for i, p := range perm {
		if !bytes.Equal(local[i*pg:(i+1)*pg], remote[p*pg:(p+1)*pg]) {
			t.Fatalf("page %d (remote %d) differs", i, p)
		}
	}
	// WRITE a new pattern into the second half in one large request, READ it back, verify.
	half := h.size / 2
	fillPattern(local[:half], 99)
	want := append([]byte(nil), local[:half]...)
	if _, err := TransferSync(ctx, cli, []Request{{OpWrite, tAddr(local), seg, h.addr + half, half}}, Deadline{Base: 15 * time.Second}); err != nil {
		t.Fatal(err)
	}
	clear(local)
	if _, err := TransferSync(ctx, cli, []Request{{OpRead, tAddr(local), seg, h.addr, h.size}}, Deadline{Base: 15 * time.Second}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(local[half:], want) || !bytes.Equal(local[:half], remote[:half]) {
		t.Fatal("remote region after WRITE is not what was written")
	}
}

func TestTCPTwoProcessesPeerDeath(t *testing.T) {
	h := startHelper(t, "die")
	local := mmapArena(t, int(h.size))
	cli := newTCPEngine(t, Config{Conns: 2, SliceBytes: 64 << 10})
	_ = cli.RegisterMemory(Region{Addr: tAddr(local), Len: h.size, Kind: MemHost})
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, h.name)
	if err != nil {
		t.Fatal(err)
	}
	// 64 writes of 64 KiB: each connection carries one WRITE_BATCH; the helper exits when it has
	// read the second frame's header, so at least that frame's writes never land.
	var reqs []Request
	for i := uint64(0); i < 64; i++ {
		reqs = append(reqs, Request{OpWrite, tAddr(local) + i<<16, seg, h.addr + i<<16, 1 << 16})
	}
	start := time.Now()
	res, err := TransferSync(ctx, cli, reqs, Deadline{Base: 15 * time.Second})
	if !errors.Is(err, ErrPeerGone) || res.Failed < 1 {
		t.Fatalf("got %v, %d failed", err, res.Failed)
	}
	for i, st := range res.Tasks {
		if st.State != TaskCompleted && (st.State != TaskFailed || !errors.Is(st.Err, ErrPeerGone)) {
			t.Fatalf("task %d: %+v", i, st)
		}
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("peer death noticed after %v", el)
	}
	if err := h.cmd.Wait(); err == nil || h.cmd.ProcessState.ExitCode() != 3 {
		t.Fatalf("helper exit: %v", err)
	}
}

// TestRegionWithdrawWaitsForCopies: UnregisterMemory does not return while a copy holds the
// region, and no new copy can start once it began.
func TestRegionWithdrawWaitsForCopies(t *testing.T) {
	var tbl regionTable
	if err := tbl.add(Region{Addr: 1 << 20, Len: 4096}); err != nil {
		t.Fatal(err)
	}
	r := tbl.acquire(1<<20+10, 100)
	if r == nil {
		t.Fatal("acquire inside the region failed")
	}
	if tbl.acquire(1<<20+4000, 100) != nil {
		t.Fatal("acquire across the end succeeded")
	}
	done := make(chan error)
	go func() { done <- tbl.remove(1 << 20) }()
	for !r.gone.Load() {
		runtime.Gosched() // wait until the withdrawal has started
	}
	if r.use() {
		t.Fatal("a new copy started on a region being withdrawn")
	}
	select {
	case err := <-done:
		t.Fatalf("UnregisterMemory returned (%v) while a copy held the region", err)
	default:
	}
	r.release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if tbl.acquire(1<<20+10, 100) != nil {
		t.Fatal("acquire after withdrawal succeeded")
	}
}

// TestTCPStalledPeerReleasesRegion: a peer that announces a WRITE_BATCH and never sends the payload
// loses its connection after the payload timeout, so UnregisterMemory does not wait forever.
func TestTCPStalledPeerReleasesRegion(t *testing.T) {
	defer func(old time.Duration) { tcpPayloadTimeout = old }(tcpPayloadTimeout)
	tcpPayloadTimeout = 200 * time.Millisecond
	mem := mmapArena(t, 1<<16)
	owner := newTCPEngine(t, Config{})
	entered := make(chan struct{}, 1)
	owner.serverHook = func(uint8) { entered <- struct{}{} }
	if err := owner.RegisterMemory(Region{Addr: tAddr(mem), Len: 1 << 16, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(tcpEncodeHello(tcpHello{version: tcpWireVersion})); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	if _, n, err := tcpReadHeader(br); err != nil {
		t.Fatal(err)
	} else if _, err := tcpReadBody(br, n); err != nil {
		t.Fatal(err)
	}
	frame := writeBatchFrame(1, []uint64{tAddr(mem)}, [][]byte{make([]byte, 4096)})
	if _, err := c.Write(frame[:len(frame)-4000]); err != nil { // descriptor and 96 payload bytes
		t.Fatal(err)
	}
	<-entered
	r := owner.regions.find(tAddr(mem), 1)
	for deadline := time.Now().Add(10 * time.Second); r.users.Load() == 0; runtime.Gosched() {
		if time.Now().After(deadline) {
			t.Fatal("the owner never took the region for the payload")
		}
	}
	done := make(chan error, 1)
	go func() { done <- owner.UnregisterMemory(tAddr(mem)) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("UnregisterMemory still waiting for a stalled peer")
	}
	// The owner dropped the stalled connection: reading from it ends.
	_, _ = io.Copy(io.Discard, br)
}

// TestTCPBackToBackWrites: many small WRITEs whose sources, targets or both lie back to back, across
// the boundary of two adjacent registered regions on each side (the sender joins contiguous
// payloads into one iovec, the owner joins contiguous targets), each landing exactly where asked.
func TestTCPBackToBackWrites(t *testing.T) {
	const n, l, half = 400, 100, 64 << 10
	srcMem, dstMem := mmapArena(t, 2*half), mmapArena(t, 2*half)
	fillPattern(srcMem, 3)
	a := newTCPEngine(t, Config{Conns: 2})
	b := newTCPEngine(t, Config{Conns: 2})
	for _, m := range []struct {
		e   *tcpEngine
		mem []byte
	}{{a, srcMem}, {b, dstMem}} {
		for h := 0; h < 2; h++ {
			if err := m.e.RegisterMemory(Region{Addr: tAddr(m.mem) + uint64(h*half), Len: half, Kind: MemHost, Location: "cpu"}); err != nil {
				t.Fatal(err)
			}
		}
	}
	ctx := waitCtx(t)
	seg, err := a.OpenSegment(ctx, b.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	// Offsets start so that the run crosses the middle of each arena (the region boundary).
	contiguous := func(i int) uint64 { return uint64(half - n/2*l + i*l) }
	scattered := func(i int) uint64 { return uint64(half - n/2*(l+37) + i*(l+37)) }
	for _, c := range []struct {
		name     string
		src, dst func(int) uint64
	}{
		{"sources back to back", contiguous, scattered},
		{"targets back to back", scattered, contiguous},
		{"both back to back", contiguous, contiguous},
	} {
		t.Run(c.name, func(t *testing.T) {
			clear(dstMem)
			reqs := make([]Request, n)
			want := make([]byte, len(dstMem))
			for i := range reqs {
				reqs[i] = Request{Op: OpWrite, Source: tAddr(srcMem) + c.src(i), Target: seg, TargetAddr: tAddr(dstMem) + c.dst(i), Length: l}
				copy(want[c.dst(i):c.dst(i)+l], srcMem[c.src(i):c.src(i)+l])
			}
			res, err := TransferSync(ctx, a, reqs, Deadline{Base: 10 * time.Second})
			if err != nil || res.Bytes != n*l {
				t.Fatalf("moved %d bytes, %v", res.Bytes, err)
			}
			if !bytes.Equal(dstMem, want) {
				i := 0
				for dstMem[i] == want[i] {
					i++
				}
				t.Fatalf("target memory differs first at offset %d", i)
			}
		})
	}
}
