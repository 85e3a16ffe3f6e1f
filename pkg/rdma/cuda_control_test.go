package rdma

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"
)

// waitUpdate waits for the next snapshot applied for peer id of e.
func waitUpdate(t *testing.T, e *CUDAEngine, id SegmentID) {
	t.Helper()
	e.mu.RLock()
	p := e.peers[id]
	e.mu.RUnlock()
	select {
	case <-p.updated:
	case <-time.After(10 * time.Second):
		t.Fatal("no region snapshot from the peer")
	}
}

// TestCUDAControlProtocol runs the cuda engine's control socket for real (handshake, region
// snapshots on register/unregister, malformed openers, peer loss) between two engines of this
// process, whose copies run on the host sink (same-process regions are used by pointer).
func TestCUDAControlProtocol(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	opener, sink, src, dst := hostEngine(t, CUDAOptions{Workers: 1}, 0, false)
	if err := opener.listen(ctx, Config{}); err != nil {
		t.Fatal(err)
	}
	defer opener.Close()
	owner := newCUDAEngine(CUDAOptions{}, 0)
	if err := owner.listen(ctx, Config{ListenAddr: "unix:" + t.TempDir() + "/owner.sock"}); err != nil {
		t.Fatal(err)
	}
	half := uint64(len(dst) / 2)
	region := func(addr, ptr, n uint64) (cudaSpan, cudaWireRegion) {
		return cudaSpan{addr: addr, len: n, ptr: ptr, dev: -1},
			cudaWireRegion{Region: Region{Addr: addr, Len: n, Kind: MemHost, Location: "cpu"}, Ptr: ptr}
	}
	if err := owner.addRegion(region(0x5000000, 2<<40, half)); err != nil {
		t.Fatal(err)
	}
	if err := owner.addRegion(region(0x5000000+16, 2<<40, 16)); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("overlapping region: %v", err)
	}

	if _, err := opener.OpenSegment(ctx, "127.0.0.1:1"); !errors.Is(err, ErrUnknownSegment) {
		t.Fatalf("open of nothing: %v", err)
	}
	seg, err := opener.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	waitUpdate(t, opener, seg) // the handshake's snapshot
	regs, err := opener.RemoteRegions(seg)
	if err != nil || len(regs) != 1 || regs[0].Addr != 0x5000000 || regs[0].Len != half || regs[0].Kind != MemHost {
		t.Fatalf("regions %+v %v", regs, err)
	}
	write := func(target uint64) TaskStatus {
		t.Helper()
		b, err := opener.AllocateBatch(1)
		if err != nil {
			t.Fatal(err)
		}
		if err := opener.Submit(ctx, b, []Request{{Op: OpWrite, Source: 0x1000, Target: seg, TargetAddr: target, Length: 4096}}); err != nil {
			t.Fatal(err)
		}
		st, err := opener.Wait(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		if err := opener.FreeBatch(b); err != nil {
			t.Fatal(err)
		}
		return st[0]
	}
	if s := write(0x5000000 + 8192); s.State != TaskCompleted || string(dst[8192:8192+4096]) != string(src[:4096]) {
		t.Fatalf("write through the handshake's regions: %+v", s)
	}

	// A second region appears at the opener; withdrawing the first refuses writes to it.
	if err := owner.addRegion(region(0x7000000, 2<<40+half, half)); err != nil {
		t.Fatal(err)
	}
	waitUpdate(t, opener, seg)
	if regs, _ := opener.RemoteRegions(seg); len(regs) != 2 {
		t.Fatalf("after register: %+v", regs)
	}
	if err := owner.UnregisterMemory(0x5000000); err != nil {
		t.Fatal(err)
	}
	if err := owner.UnregisterMemory(0x5000000); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("second unregister: %v", err)
	}
	waitUpdate(t, opener, seg)
	if s := write(0x5000000); s.State != TaskFailed || !errors.Is(s.Err, ErrOutOfBounds) {
		t.Fatalf("write to a withdrawn region: %+v", s)
	}
	if s := write(0x7000000); s.State != TaskCompleted || string(dst[half:half+4096]) != string(src[:4096]) {
		t.Fatalf("write to the new region: %+v", s)
	}

	// A malformed opener is dropped; the owner keeps serving.
	c, err := net.Dial("unix", owner.SegmentName()[len("unix:"):])
	if err != nil {
		t.Fatal(err)
	}
	if err := cudaWriteFrame(c, []byte("not a hello")); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := cudaReadFrame(c); err == nil {
		t.Fatal("owner answered a malformed hello")
	}
	c.Close()

	// The owner goes away — with an opener that never says hello still connected, which must
	// not hold Close up — and the segment is gone: submissions to it fail as tasks.
	silent, err := net.Dial("unix", owner.SegmentName()[len("unix:"):])
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	closed := make(chan error, 1)
	go func() { closed <- owner.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second): // the hello deadline is 10 s
		t.Fatal("Close waited for an opener's hello")
	}
	opener.mu.RLock()
	p := opener.peers[seg]
	opener.mu.RUnlock()
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Fatal("peer loss not noticed")
	}
	if s := write(0x7000000); s.State != TaskFailed || !errors.Is(s.Err, ErrPeerGone) {
		t.Fatalf("write to a gone peer: %+v", s)
	}
	if err := opener.CloseSegment(seg); err != nil {
		t.Fatal(err)
	}
	if err := opener.CloseSegment(seg); !errors.Is(err, ErrUnknownSegment) {
		t.Fatalf("second close: %v", err)
	}
	if _, err := opener.RemoteRegions(seg); !errors.Is(err, ErrUnknownSegment) {
		t.Fatalf("regions of a closed segment: %v", err)
	}
	_ = sink
}
