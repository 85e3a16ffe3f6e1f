package rdma

import (
	"fmt"
	"sort"
)

// cudaSpan is a registered region resolved for this process: its registered (owner) address
// range, the pointer of its first byte here, and where it lives.
type cudaSpan struct {
	addr, len uint64
	ptr       uint64 // 0: not reachable from this process (err says why)
	dev       int    // device ordinal; -1 for pinned host memory
	err       error
}

// cudaSpans is sorted by addr and non-overlapping.
type cudaSpans []cudaSpan

func (s cudaSpans) sorted() cudaSpans {
	sort.Slice(s, func(i, j int) bool { return s[i].addr < s[j].addr })
	return s
}

// lookup returns the span containing [addr, addr+n). *hint is the index that matched last
// time (requests of a batch mostly hit the same region in a row) and is updated.
func (s cudaSpans) lookup(addr, n uint64, hint *int) *cudaSpan {
	if n == 0 || addr+n < addr {
		return nil
	}
	if h := *hint; h >= 0 && h < len(s) && addr >= s[h].addr && addr+n <= s[h].addr+s[h].len {
		return &s[h]
	}
	i := sort.Search(len(s), func(i int) bool { return s[i].addr+s[i].len > addr })
	if i < len(s) && addr >= s[i].addr && addr+n <= s[i].addr+s[i].len {
		*hint = i
		return &s[i]
	}
	return nil
}

// cudaRoute is one resolved request: copy n bytes from src to dst (pointers in this process),
// run on device dev; srcDev and dstDev say where the bytes live (-1 host).
type cudaRoute struct {
	src, dst, n    uint64
	dev            int
	srcDev, dstDev int
}

// cudaRouteRequest checks a request against the local and remote regions (bounds first,
// before any byte moves) and resolves it. The copy runs on the engine's device dev, the device
// in whose context peers' memory is imported (the pattern of NCCL and PyTorch IPC: each process
// maps foreign allocations into its own device and its kernels reach them over NVLink).
func cudaRouteRequest(r *Request, local, remote cudaSpans, dev int, lh, rh *int) (cudaRoute, error) {
	if r.Op != OpRead && r.Op != OpWrite {
		return cudaRoute{}, fmt.Errorf("%w: opcode %d", ErrInvalidRequest, r.Op)
	}
	if r.Length == 0 {
		return cudaRoute{}, fmt.Errorf("%w: zero length", ErrInvalidRequest)
	}
	ls := local.lookup(r.Source, r.Length, lh)
	if ls == nil {
		return cudaRoute{}, fmt.Errorf("%w: local [%#x,+%d)", ErrOutOfBounds, r.Source, r.Length)
	}
	rs := remote.lookup(r.TargetAddr, r.Length, rh)
	if rs == nil {
		return cudaRoute{}, fmt.Errorf("%w: remote [%#x,+%d)", ErrOutOfBounds, r.TargetAddr, r.Length)
	}
	if ls.ptr == 0 {
		return cudaRoute{}, fmt.Errorf("%w: local region %#x unusable: %v", ErrInvalidRequest, ls.addr, ls.err)
	}
	if rs.ptr == 0 {
		return cudaRoute{}, fmt.Errorf("%w: remote region %#x unreachable: %v", ErrInvalidRequest, rs.addr, rs.err)
	}
	lp, rp := ls.ptr+(r.Source-ls.addr), rs.ptr+(r.TargetAddr-rs.addr)
	rt := cudaRoute{n: r.Length}
	if r.Op == OpWrite {
		rt.src, rt.srcDev, rt.dst, rt.dstDev = lp, ls.dev, rp, rs.dev
	} else {
		rt.src, rt.srcDev, rt.dst, rt.dstDev = rp, rs.dev, lp, ls.dev
	}
	rt.dev = dev
	return rt, nil
}
