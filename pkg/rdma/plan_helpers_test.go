package rdma

// The planners, LayoutFromProto and TransferSync are this package's tests' tools (the sidecars
// plan with kvxfer.PlanRuns and transfer with kvxfer.Transfer): kept out of the production
// package, shared by the internal and external tests of it.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// LayoutFromProto converts the wire form; the result is validated.
func LayoutFromProto(p *kvcv1.KVLayout) (Layout, error) {
	if p == nil {
		return Layout{}, fmt.Errorf("%w: nil layout", ErrInvalidRequest)
	}
	if p.GetItemLen() < 0 {
		return Layout{}, fmt.Errorf("%w: negative item_len %d", ErrInvalidRequest, p.GetItemLen())
	}
	l := Layout{
		PageSize:    int(p.GetPageSize()),
		ItemLen:     uint64(p.GetItemLen()),
		NumLayers:   int(p.GetNumLayers()),
		BufferAddrs: append([]uint64(nil), p.GetBufferAddrs()...),
		PageCount:   p.GetPageCount(),
		MLA:         p.GetNumLayers() > 0 && len(p.GetBufferAddrs()) == int(p.GetNumLayers()),
	}
	return l, l.Validate()
}

// Deadline is the time budget of a synchronous transfer, base + bytes × per-byte, as SGLang
// computes its transfer timeouts.
type Deadline struct {
	Base    time.Duration
	PerByte time.Duration // may be 0; use PerGB for readability
}

// For returns the budget for n bytes.
func (d Deadline) For(n uint64) time.Duration {
	return d.Base + time.Duration(float64(d.PerByte)*float64(n))
}

// ErrTimeout is wrapped by TransferSync when the deadline passed before every task finished.
var ErrTimeout = errors.New("rdma: transfer deadline passed")

// Result is the outcome of TransferSync.
type Result struct {
	// Bytes is the number of bytes moved (summed over tasks, completed or not).
	Bytes uint64
	// Tasks is the final status of each request, in order. Tasks cut off by the deadline are
	// reported as TaskTimeout.
	Tasks []TaskStatus
	// Failed counts tasks that did not complete.
	Failed int
	// Elapsed is the wall time from submission to the last status.
	Elapsed time.Duration
}

// TransferSync runs reqs as one batch and waits for it with the budget d.For(total bytes), the
// way SGLang times its transfers: allocate, submit, wait, cancel what is left at the deadline,
// free. A zero budget means no deadline beyond ctx. The error is nil only when every task
// completed; otherwise it wraps ErrTimeout or the first task's error (ErrOutOfBounds,
// ErrPeerGone, ...).
func TransferSync(ctx context.Context, e Engine, reqs []Request, d Deadline) (Result, error) {
	if len(reqs) == 0 {
		return Result{}, nil
	}
	var total uint64
	for _, r := range reqs {
		total += r.Length
	}
	b, err := e.AllocateBatch(len(reqs))
	if err != nil {
		return Result{}, err
	}
	start := time.Now()
	wctx, cancel := ctx, context.CancelFunc(func() {})
	if budget := d.For(total); budget > 0 {
		wctx, cancel = context.WithTimeout(ctx, budget)
	}
	defer cancel()
	if err := e.Submit(wctx, b, reqs); err != nil {
		_ = e.Cancel(b)
		_ = e.FreeBatch(b)
		return Result{}, err
	}
	st, werr := e.Wait(wctx, b)
	timedOut := false
	if werr != nil {
		timedOut = ctx.Err() == nil // our deadline, not the caller's context
		_ = e.Cancel(b)
		// Backends whose Cancel is immediate make every task final now; give the others a
		// moment to settle so the batch can be freed.
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		st, _ = e.Wait(sctx, b)
		scancel()
	}
	res := Result{Tasks: st, Elapsed: time.Since(start)}
	var first error
	for i := range res.Tasks {
		t := &res.Tasks[i]
		res.Bytes += t.BytesDone
		if t.State == TaskCompleted {
			continue
		}
		res.Failed++
		if timedOut && (t.State == TaskCanceled || !t.State.Done()) {
			t.State, t.Err = TaskTimeout, ErrTimeout
		}
		if first == nil {
			first = t.Err
			if first == nil {
				first = fmt.Errorf("task %d %v", i, t.State)
			}
		}
	}
	ferr := e.FreeBatch(b)
	switch {
	case timedOut:
		err = fmt.Errorf("%w: %d of %d tasks unfinished after %v (%d bytes)", ErrTimeout, res.Failed, len(reqs), d.For(total), total)
	case werr != nil:
		err = fmt.Errorf("rdma: %d of %d tasks unfinished: %w", res.Failed, len(reqs), werr)
	case res.Failed > 0:
		err = fmt.Errorf("rdma: %d of %d tasks failed: %w", res.Failed, len(reqs), first)
	}
	if ferr != nil {
		err = errors.Join(err, ferr)
	}
	return res, err
}

// PlanStats counts requests before and after merging runs.
type PlanStats struct {
	// Unmerged is what one request per page (or partial page) per buffer would have been.
	Unmerged int
	// Merged is the number of requests produced.
	Merged int
	// Runs is the number of contiguous runs per buffer.
	Runs int
	// Bytes is the total length of the requests.
	Bytes uint64
}

// String is a one-line summary.
func (s PlanStats) String() string {
	return fmt.Sprintf("%d requests merged from %d (%d runs per buffer, %d bytes)", s.Merged, s.Unmerged, s.Runs, s.Bytes)
}

// ErrBadPages is wrapped by planning errors about page lists.
var ErrBadPages = errors.New("rdma: bad page list")

// piece is one contiguous byte range, as offsets from the start of a buffer on each side.
type piece struct{ src, dst, n uint64 }

// PlanPages turns a page map into the fewest requests: srcPages[i] of the data source moves to
// dstPages[i] of the data destination; runs contiguous on both sides are merged, and each run
// becomes one request per buffer (layer × K/V).
//
// src and dst always name where the data comes from and where it goes. For OpWrite the source is
// local (Request.Source in src) and the destination is the peer target; for OpRead the
// destination is local (Request.Source in dst) and the source is the peer target. Page indices
// must be in range and must not repeat on either side.
func PlanPages(op Opcode, src, dst Layout, srcPages, dstPages []int64, target SegmentID) ([]Request, error) {
	reqs, _, err := PlanPagesStats(op, src, dst, srcPages, dstPages, target)
	return reqs, err
}

// PlanPagesStats is PlanPages that also returns the request counts before and after merging.
func PlanPagesStats(op Opcode, src, dst Layout, srcPages, dstPages []int64, target SegmentID) ([]Request, PlanStats, error) {
	if err := checkPlan(op, src, dst); err != nil {
		return nil, PlanStats{}, err
	}
	if len(srcPages) != len(dstPages) {
		return nil, PlanStats{}, fmt.Errorf("%w: %d source pages, %d destination pages", ErrBadPages, len(srcPages), len(dstPages))
	}
	if err := checkPages("source", srcPages, src.PageCount, len(srcPages)); err != nil {
		return nil, PlanStats{}, err
	}
	if err := checkPages("destination", dstPages, dst.PageCount, len(dstPages)); err != nil {
		return nil, PlanStats{}, err
	}
	ps := make([]piece, 0, len(srcPages))
	for i := range srcPages {
		ps = append(ps, piece{uint64(srcPages[i]) * src.ItemLen, uint64(dstPages[i]) * dst.ItemLen, src.ItemLen})
	}
	return buildRequests(op, src, dst, ps, target)
}

// PlanTokens plans the token range [from, to) of a session: srcPages and dstPages are each
// side's pages in token order (page i holds tokens [i×PageSize, (i+1)×PageSize)) covering at
// least to tokens. Offsets are token-granular within pages (TokenBytes per token per buffer), so
// an incremental snapshot push moves exactly the new tokens. src/dst and op are as in PlanPages.
func PlanTokens(op Opcode, src, dst Layout, srcPages, dstPages []int64, from, to int64, target SegmentID) ([]Request, error) {
	reqs, _, err := PlanTokensStats(op, src, dst, srcPages, dstPages, from, to, target)
	return reqs, err
}

// PlanTokensStats is PlanTokens that also returns the request counts before and after merging.
func PlanTokensStats(op Opcode, src, dst Layout, srcPages, dstPages []int64, from, to int64, target SegmentID) ([]Request, PlanStats, error) {
	if err := checkPlan(op, src, dst); err != nil {
		return nil, PlanStats{}, err
	}
	if from < 0 || to <= from {
		return nil, PlanStats{}, fmt.Errorf("%w: token range [%d, %d)", ErrBadPages, from, to)
	}
	ps64 := int64(src.PageSize)
	first, last := from/ps64, (to-1)/ps64 // page indices (in token order) touched
	if int64(len(srcPages)) <= last || int64(len(dstPages)) <= last {
		return nil, PlanStats{}, fmt.Errorf("%w: %d source and %d destination pages do not cover %d tokens", ErrBadPages, len(srcPages), len(dstPages), to)
	}
	if err := checkPages("source", srcPages[first:last+1], src.PageCount, int(last-first+1)); err != nil {
		return nil, PlanStats{}, err
	}
	if err := checkPages("destination", dstPages[first:last+1], dst.PageCount, int(last-first+1)); err != nil {
		return nil, PlanStats{}, err
	}
	tb := src.TokenBytes()
	ps := make([]piece, 0, last-first+1)
	for i := first; i <= last; i++ {
		t0, t1 := max(from, i*ps64), min(to, (i+1)*ps64)
		in := uint64(t0-i*ps64) * tb
		ps = append(ps, piece{uint64(srcPages[i])*src.ItemLen + in, uint64(dstPages[i])*dst.ItemLen + in, uint64(t1-t0) * tb})
	}
	return buildRequests(op, src, dst, ps, target)
}

func checkPlan(op Opcode, src, dst Layout) error {
	if op != OpRead && op != OpWrite {
		return fmt.Errorf("%w: opcode %v", ErrInvalidRequest, op)
	}
	if err := src.Validate(); err != nil {
		return fmt.Errorf("source layout: %w", err)
	}
	if err := dst.Validate(); err != nil {
		return fmt.Errorf("destination layout: %w", err)
	}
	return src.Compatible(dst)
}

// checkPages rejects out-of-range and repeated pages.
func checkPages(side string, pages []int64, count int64, n int) error {
	seen := make(map[int64]struct{}, n)
	for i, p := range pages {
		if p < 0 || p >= count {
			return fmt.Errorf("%w: %s page %d (position %d) outside [0, %d)", ErrBadPages, side, p, i, count)
		}
		if _, dup := seen[p]; dup {
			return fmt.Errorf("%w: %s page %d repeats (position %d)", ErrBadPages, side, p, i)
		}
		seen[p] = struct{}{}
	}
	return nil
}

// buildRequests merges pieces contiguous on both sides and emits one request per run per buffer.
func buildRequests(op Opcode, src, dst Layout, ps []piece, target SegmentID) ([]Request, PlanStats, error) {
	runs := ps[:0:0]
	for _, p := range ps {
		if n := len(runs); n > 0 {
			last := &runs[n-1]
			if last.src+last.n == p.src && last.dst+last.n == p.dst {
				last.n += p.n
				continue
			}
		}
		runs = append(runs, p)
	}
	nb := src.NumBuffers()
	if len(runs) > math.MaxInt/nb {
		return nil, PlanStats{}, fmt.Errorf("%w: too many runs", ErrBadPages)
	}
	reqs := make([]Request, 0, len(runs)*nb)
	var total uint64
	for b := 0; b < nb; b++ {
		for _, r := range runs {
			s, d := src.BufferAddrs[b]+r.src, dst.BufferAddrs[b]+r.dst
			req := Request{Op: op, Target: target, Length: r.n}
			if op == OpWrite {
				req.Source, req.TargetAddr = s, d
			} else {
				req.Source, req.TargetAddr = d, s
			}
			reqs = append(reqs, req)
			total += r.n
		}
	}
	return reqs, PlanStats{Unmerged: len(ps) * nb, Merged: len(reqs), Runs: len(runs), Bytes: total}, nil
}
