package bench

import (
	"sync"

	"github.com/kvcentric/kvcentric/sim/internal/report"
)

// afterRequests fires once n requests have completed ok: the kill of --kill-after-requests,
// which (unlike a time on the workload clock) cannot come while the requests it waits for are
// still open, however slow the workers are.
type afterRequests struct {
	mu    sync.Mutex
	n, ok int
	fired chan struct{}
}

func newAfterRequests(n int) *afterRequests {
	return &afterRequests{n: n, fired: make(chan struct{})}
}

// observe counts r (a completed request); the n-th ok one closes fired.
func (a *afterRequests) observe(r *report.Record) {
	if r == nil || !r.OK {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.ok++
	if a.ok == a.n {
		close(a.fired)
	}
}

// wrap returns a Progress callback that observes each record and then calls next (may be nil).
func (a *afterRequests) wrap(next func(done, total int, last *report.Record)) func(done, total int, last *report.Record) {
	return func(done, total int, last *report.Record) {
		a.observe(last)
		if next != nil {
			next(done, total, last)
		}
	}
}
