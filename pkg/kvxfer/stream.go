package kvxfer

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// TokenPlan is a checked plan of a token transfer: the runs of tokens [from, to) that are
// contiguous on both sides, as byte offsets from each pool's first buffer. Every page of the
// range has been checked against both page maps, so laying the runs over the buffers (Requests,
// Transfer) cannot fail. Build it with PlanRuns.
type TokenPlan struct {
	runs         []tokenRun
	sAddrs       []uint64
	dAddrs       []uint64
	bytesPerRuns uint64 // bytes of one buffer's runs
}

type tokenRun struct{ s, d, n uint64 }

// PlanRuns checks tokens [from, to) of the local page map src and the remote page map dst and
// works out the runs contiguous on both sides; Requests lays them over every buffer as WRITE
// requests (one per run per buffer). Every buffer of a pool has the same page geometry, so the
// runs are worked out once, as offsets from the first buffer, with every page checked against
// both maps: a 50,000-token session of 96 buffers costs one pass over its 3,125 pages plus one
// store per request, not 96 passes through the page maps. Errors are PageMap.Addr's.
func PlanRuns(src, dst PageMap, from, to int64) (*TokenPlan, error) {
	if err := CompatibleLayouts(src.Layout, dst.Layout); err != nil {
		return nil, err
	}
	if from < 0 || to < from {
		return nil, status.Errorf(codes.InvalidArgument, "bad token range [%d, %d)", from, to)
	}
	p := &TokenPlan{sAddrs: src.Layout.GetBufferAddrs(), dAddrs: dst.Layout.GetBufferAddrs()}
	if from == to {
		return p, nil
	}
	ps := int64(src.Layout.GetPageSize())
	ib := src.Layout.GetItemLen() // the same on both sides (CompatibleLayouts)
	tb := uint64(ib / ps)
	sCount, dCount := src.Layout.GetPageCount(), dst.Layout.GetPageCount()
	// One pass over the range's pages with the layouts' fields hoisted: this runs between
	// ReserveSnapshot and the first copy of a push. A page outside a map or a pool takes the
	// checked path (PageMap.addr) for its error.
	p.runs = make([]tokenRun, 0, min((to-from)/ps+1, 1<<16))
	for t := from; t < to; {
		pi := t / ps
		end := min((pi+1)*ps, to)
		si, di := pi-src.First, pi-dst.First
		if si < 0 || si >= int64(len(src.Pages)) || src.Pages[si] < 0 || (sCount > 0 && src.Pages[si] >= sCount) {
			_, err := src.Addr(0, t)
			return nil, fmt.Errorf("source: %w", err)
		}
		if di < 0 || di >= int64(len(dst.Pages)) || dst.Pages[di] < 0 || (dCount > 0 && dst.Pages[di] >= dCount) {
			_, err := dst.Addr(0, t)
			return nil, fmt.Errorf("target: %w", err)
		}
		off := uint64(t%ps) * tb
		s, d := uint64(src.Pages[si]*ib)+off, uint64(dst.Pages[di]*ib)+off
		n := uint64(end-t) * tb
		if k := len(p.runs) - 1; k >= 0 && p.runs[k].s+p.runs[k].n == s && p.runs[k].d+p.runs[k].n == d {
			p.runs[k].n += n
		} else {
			p.runs = append(p.runs, tokenRun{s, d, n})
		}
		p.bytesPerRuns += n
		t = end
	}
	return p, nil
}

// Len is the number of requests of the plan (runs × buffers).
func (p *TokenPlan) Len() int { return len(p.runs) * len(p.sAddrs) }

// Bytes is the number of bytes the plan moves.
func (p *TokenPlan) Bytes() uint64 { return p.bytesPerRuns * uint64(len(p.sAddrs)) }

// layBuffers writes the WRITE requests of buffers [b0, b1) into out (len (b1-b0)·runs).
func (p *TokenPlan) layBuffers(out []rdma.Request, seg rdma.SegmentID, b0, b1 int) {
	i := 0
	for b := b0; b < b1; b++ {
		sb, db := p.sAddrs[b], p.dAddrs[b]
		for _, r := range p.runs {
			out[i] = rdma.Request{Op: rdma.OpWrite, Source: sb + r.s, Target: seg, TargetAddr: db + r.d, Length: r.n}
			i++
		}
	}
}

// Requests returns the plan's WRITE requests into segment seg, buffer by buffer.
func (p *TokenPlan) Requests(seg rdma.SegmentID) []rdma.Request {
	if len(p.runs) == 0 {
		return nil
	}
	out := make([]rdma.Request, p.Len())
	p.layBuffers(out, seg, 0, len(p.sAddrs))
	return out
}

// Chunking of Transfer: the first batch holds about streamFirst requests (the copy starts
// after a few microseconds of laying out), later ones grow fourfold up to streamMax (always
// whole buffers): the host lays requests out several times faster than the GPU copies them,
// so after the first batch it is far enough ahead for large batches, and every batch boundary
// costs a partial descriptor group (a kernel boundary) and a Wait. Small plans go as one batch.
const (
	streamFirst  = 2048
	streamGrowth = 4
	streamMax    = 65536
)

// Transfer moves the plan into segment seg the way the package-level Transfer moves a request
// list, but overlaps laying out the requests with copying them: the requests of a few buffers
// are laid out and submitted as a batch of their own, the engine starts copying them, and the
// next buffers are laid out meanwhile (an engine runs the batches of one submitter in order, as
// it runs the groups of one batch). The request memory comes from a free list and is reused by
// the next transfer, so a long session costs no fresh allocation per push. On error or when
// ctx ends it cancels every batch submitted and waits until no task is in flight, exactly like
// Transfer. It returns the bytes moved.
func (p *TokenPlan) Transfer(ctx context.Context, eng rdma.Engine, seg rdma.SegmentID) (uint64, error) {
	return p.TransferThen(ctx, eng, seg, nil)
}

// TransferThen is Transfer with a hook: submitted, when not nil, is called once after the last
// batch was submitted and before the first Wait, with every batch of the transfer (in order),
// so that the caller can overlap work with the copy — e.g. record a ready event after the
// copies (rdma.CUDAEngine.ReadyEvent) and send its commit while the bytes still move. It is
// not called when a submission fails or ctx ends first.
func (p *TokenPlan) TransferThen(ctx context.Context, eng rdma.Engine, seg rdma.SegmentID, submitted func([]rdma.BatchID)) (uint64, error) {
	n := p.Len()
	if n == 0 {
		return 0, nil
	}
	buf := getReqs(n)
	defer putReqs(buf)
	reqs := (*buf)[:n]
	runs := len(p.runs)
	var batches []rdma.BatchID
	var moved uint64
	fail := func(err error) (uint64, error) {
		for _, b := range batches {
			for _, s := range settle(eng, b) {
				moved += s.BytesDone
			}
		}
		if ctx.Err() != nil {
			return moved, fmt.Errorf("%w: %v", ErrAborted, context.Cause(ctx))
		}
		return moved, err
	}
	target := streamFirst
	if n <= 2*streamFirst {
		target = n
	}
	for b0 := 0; b0 < len(p.sAddrs); {
		nb := max(1, (target+runs-1)/runs)
		b1 := min(len(p.sAddrs), b0+nb)
		chunk := reqs[b0*runs : b1*runs]
		p.layBuffers(chunk, seg, b0, b1)
		if err := ctx.Err(); err != nil {
			return fail(err)
		}
		id, err := eng.AllocateBatch(len(chunk))
		if err != nil {
			return fail(fmt.Errorf("allocate batch: %w", err))
		}
		if err := eng.Submit(ctx, id, chunk); err != nil {
			settle(eng, id)
			return fail(fmt.Errorf("submit: %w", err))
		}
		batches = append(batches, id)
		b0, target = b1, min(streamMax, streamGrowth*target)
	}
	if submitted != nil {
		submitted(slices.Clone(batches))
	}
	var firstErr error
	for i, id := range batches {
		sts, werr := eng.Wait(ctx, id)
		if werr != nil || ctx.Err() != nil {
			batches = batches[i:] // the earlier ones are waited for and freed
			if werr == nil {
				werr = ctx.Err()
			}
			return fail(fmt.Errorf("wait: %w", werr))
		}
		for t, s := range sts {
			moved += s.BytesDone
			if s.State != rdma.TaskCompleted && firstErr == nil {
				firstErr = fmt.Errorf("task %d %s: %v", t, s.State, s.Err)
			}
		}
		_ = eng.FreeBatch(id)
	}
	return moved, firstErr
}

// The request free list: a few slices, kept between transfers (a sync.Pool would drop them at
// every other garbage collection, and a 50,000-token push's list is several megabytes).
var (
	reqMu   sync.Mutex
	reqFree []*[]rdma.Request
)

const reqFreeMax = 8

func getReqs(n int) *[]rdma.Request {
	reqMu.Lock()
	for i := len(reqFree) - 1; i >= 0; i-- {
		if b := reqFree[i]; cap(*b) >= n {
			reqFree = append(reqFree[:i], reqFree[i+1:]...)
			reqMu.Unlock()
			return b
		}
	}
	reqMu.Unlock()
	b := make([]rdma.Request, n)
	return &b
}

func putReqs(b *[]rdma.Request) {
	reqMu.Lock()
	defer reqMu.Unlock()
	if len(reqFree) < reqFreeMax {
		reqFree = append(reqFree, b)
		return
	}
	// full: keep the larger slices
	for i, o := range reqFree {
		if cap(*o) < cap(*b) {
			reqFree[i] = b
			return
		}
	}
}
