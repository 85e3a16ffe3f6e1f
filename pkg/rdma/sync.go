package rdma

import (
	"context"
	"errors"
	"fmt"
	"time"
)

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
