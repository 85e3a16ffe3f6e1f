package rdma

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestBatchBlocks: tasks added in several blocks are indexed in order, finish once, and the
// batch's count, Wait and cancel see all of them.
func TestBatchBlocks(t *testing.T) {
	for _, c := range []struct {
		name  string
		sizes []int
	}{
		{"one block", []int{5}},
		{"three blocks", []int{3, 1, 4}},
		{"empty add between", []int{2, 0, 3}},
	} {
		t.Run(c.name, func(t *testing.T) {
			total := 0
			for _, n := range c.sizes {
				total += n
			}
			b := &batch{capacity: total, done: make(chan struct{})}
			var all []*task
			for _, n := range c.sizes {
				ts, err := b.add(n)
				if err != nil || len(ts) != n {
					t.Fatalf("add(%d) = %d tasks, %v", n, len(ts), err)
				}
				for i := range ts {
					all = append(all, &ts[i])
				}
			}
			if _, err := b.add(1); !errors.Is(err, ErrBatchFull) {
				t.Fatalf("add past capacity = %v", err)
			}
			if _, err := b.status(total); !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("status(%d) = %v", total, err)
			}
			// Task i records i bytes; completing all but the last leaves the batch pending.
			for i, tk := range all {
				tk.bytes.Store(uint64(i))
				if i < total-1 && !tk.finish(b, TaskCompleted, nil) {
					t.Fatalf("task %d: first finish refused", i)
				}
			}
			if all[0].finish(b, TaskFailed, errors.New("late")) {
				t.Fatal("second finish accepted")
			}
			for i := 0; i < total; i++ {
				st, err := b.status(i)
				if err != nil || st.BytesDone != uint64(i) {
					t.Fatalf("status(%d) = %+v, %v", i, st, err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
			defer cancel()
			if _, err := b.wait(ctx); !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("wait with a task pending = %v", err)
			}
			b.cancel(TaskCanceled, context.Canceled)
			sts, err := b.wait(context.Background())
			if err != nil || len(sts) != total {
				t.Fatalf("wait = %d statuses, %v", len(sts), err)
			}
			for i, st := range sts {
				want := TaskCompleted
				if i == total-1 {
					want = TaskCanceled
				}
				if st.State != want || st.BytesDone != uint64(i) {
					t.Fatalf("task %d: %+v, want %v", i, st, want)
				}
			}
		})
	}
}
