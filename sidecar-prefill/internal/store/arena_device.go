package store

import (
	"context"
	"fmt"
	"io"
	"syscall"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// deviceAllocator is the part of the cuda engine (rdma.CUDAEngine) NewArena needs (MemoryCUDA).
type deviceAllocator interface {
	AllocDevice(n uint64) (uint64, error)
	FreeMemory(p uint64) error
}

// newDeviceArena is NewArena in device memory (MemoryCUDA).
func newDeviceArena(eng rdma.Engine, s kvxfer.Shape) (*kvxfer.Pool, error) {
	alloc, ok := eng.(deviceAllocator)
	if eng.Backend() != "cuda" || !ok {
		return nil, fmt.Errorf("a device-memory snapshot store needs the cuda transport, not %s", eng.Backend())
	}
	if err := s.Check(); err != nil {
		return nil, err
	}
	mem := kvxfer.Memory{Addrs: []uint64{}}
	n := uint64(s.ItemLen * s.PageCount)
	for i := 0; i < s.Buffers(); i++ {
		ptr, err := alloc.AllocDevice(n)
		if err != nil {
			kvxfer.Adopt(s, mem).Close()
			return nil, fmt.Errorf("arena: device memory, %d bytes: %w", n, err)
		}
		mem.Addrs = append(mem.Addrs, ptr)
		mem.Free = append(mem.Free, func() { _ = alloc.FreeMemory(ptr) })
	}
	p := kvxfer.Adopt(s, mem)
	regions := make([]rdma.Region, 0, len(mem.Addrs))
	for _, a := range mem.Addrs {
		regions = append(regions, rdma.Region{Addr: a, Len: n, Kind: rdma.MemCUDA})
	}
	if err := p.RegisterRegions(eng, regions...); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

// pinnedAllocator is the part of the cuda engine (rdma.CUDAEngine) NewReader needs.
type pinnedAllocator interface {
	AllocPinned(n uint64) (uint64, []byte, error)
	FreeMemory(p uint64) error
}

// Reader copies a pool's tokens into a registered bounce buffer through the engine and hands
// them to the CPU: the way to read a pool without a CPU view (a device-memory snapshot store).
// It works with any backend whose engine can open its own segment (tcp and cuda do). Not safe
// for concurrent use; Close it.
type Reader struct {
	eng    rdma.Engine
	seg    rdma.SegmentID
	bounce []byte
	addr   uint64
	free   func()
}

// NewReader allocates and registers a bounce buffer of size bytes (pinned host memory with the
// cuda backend, anonymous memory otherwise), then opens eng's own segment: the handshake
// carries every region registered so far, the bounce buffer included (a segment opened
// earlier learns of it only asynchronously).
func NewReader(ctx context.Context, eng rdma.Engine, size int) (*Reader, error) {
	if size <= 0 {
		return nil, fmt.Errorf("reader: bounce of %d bytes", size)
	}
	r := &Reader{eng: eng}
	if eng.Backend() == "cuda" {
		alloc, ok := eng.(pinnedAllocator)
		if !ok {
			return nil, fmt.Errorf("the %T engine cannot allocate pinned memory", eng)
		}
		ptr, mem, err := alloc.AllocPinned(uint64(size))
		if err != nil {
			return nil, fmt.Errorf("reader: pinned %d bytes: %w", size, err)
		}
		r.bounce, r.addr, r.free = mem, ptr, func() { _ = alloc.FreeMemory(ptr) }
	} else {
		mem, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
		if err != nil {
			return nil, fmt.Errorf("reader: mmap %d bytes: %w", size, err)
		}
		r.bounce, r.addr, r.free = mem, addrOf(mem), func() { _ = syscall.Munmap(mem) }
	}
	if err := eng.RegisterMemory(rdma.Region{Addr: r.addr, Len: uint64(size), Kind: rdma.MemHost, Location: "bounce"}); err != nil {
		r.free()
		return nil, fmt.Errorf("reader: register bounce: %w", err)
	}
	seg, err := eng.OpenSegment(ctx, eng.SegmentName())
	if err != nil {
		_ = eng.UnregisterMemory(r.addr)
		r.free()
		return nil, fmt.Errorf("reader: open own segment: %w", err)
	}
	r.seg = seg
	return r, nil
}

// Close closes the segment, unregisters and frees the bounce buffer.
func (r *Reader) Close() {
	_ = r.eng.CloseSegment(r.seg)
	_ = r.eng.UnregisterMemory(r.addr)
	r.free()
}

// Tokens writes tokens [from, to) of buffer b of the page map m (token slots back to back, the
// order of the snapshot_kv endpoint) to w, copying as many tokens at a time as the bounce
// buffer holds. m's layout addresses are local registered memory of the engine.
func (r *Reader) Tokens(ctx context.Context, m kvxfer.PageMap, b int, from, to int64, w io.Writer) error {
	l := m.Layout
	ps := int64(l.GetPageSize())
	if ps <= 0 || b < 0 || b >= len(l.GetBufferAddrs()) || from < 0 || to < from {
		return fmt.Errorf("reader: buffer %d, tokens [%d, %d) of a layout of %d buffers", b, from, to, len(l.GetBufferAddrs()))
	}
	tb := l.GetItemLen() / ps
	per := int64(len(r.bounce)) / tb
	if per < 1 {
		return fmt.Errorf("reader: bounce of %d bytes is below one token slot (%d)", len(r.bounce), tb)
	}
	for t0 := from; t0 < to; t0 += per {
		t1 := min(t0+per, to)
		var reqs []rdma.Request
		var cur *rdma.Request
		for t := t0; t < t1; {
			end := min((t/ps+1)*ps, t1)
			src, err := m.Addr(b, t)
			if err != nil {
				return err
			}
			dst := r.addr + uint64((t-t0)*tb)
			n := uint64((end - t) * tb)
			if cur != nil && cur.Source+cur.Length == src {
				cur.Length += n
			} else {
				reqs = append(reqs, rdma.Request{Op: rdma.OpWrite, Source: src, Target: r.seg, TargetAddr: dst, Length: n})
				cur = &reqs[len(reqs)-1]
			}
			t = end
		}
		if _, err := kvxfer.Transfer(ctx, r.eng, reqs); err != nil {
			return fmt.Errorf("reader: copy tokens [%d, %d) of buffer %d: %w", t0, t1, b, err)
		}
		if _, err := w.Write(r.bounce[:(t1-t0)*tb]); err != nil {
			return err
		}
	}
	return nil
}
