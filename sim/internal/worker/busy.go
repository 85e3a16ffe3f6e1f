package worker

import (
	"sync"
	"time"
)

// busyClock accumulates the time a worker's GPU has at least one piece of work running (a
// prefill pass, an append-prefill, a request's decode steps): overlapping work counts once, as
// one batched GPU would be busy. kvc-bench reads it per worker (kvc_sim_busy_seconds_total).
type busyClock struct {
	mu    sync.Mutex
	now   func() time.Time
	n     int
	since time.Time
	total time.Duration
}

func newBusyClock(now func() time.Time) *busyClock {
	if now == nil {
		now = time.Now
	}
	return &busyClock{now: now}
}

// begin marks one piece of work started; every begin needs its end.
func (b *busyClock) begin() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.n == 0 {
		b.since = b.now()
	}
	b.n++
}

// end marks one piece of work done.
func (b *busyClock) end() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.n == 0 {
		return
	}
	b.n--
	if b.n == 0 {
		b.total += b.now().Sub(b.since)
	}
}

// seconds is the busy time so far, the running stretch included (wall seconds: kvc-bench divides
// by the time scale).
func (b *busyClock) seconds() float64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	t := b.total
	if b.n > 0 {
		t += b.now().Sub(b.since)
	}
	return t.Seconds()
}
