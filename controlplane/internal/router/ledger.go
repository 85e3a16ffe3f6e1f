package router

import (
	"container/heap"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// reservation is one decision awaiting its outcome.
type reservation struct {
	seq      uint64
	session  string
	mode     kvcv1.RouteMode
	reason   kvcv1.RouteReason
	decode   string
	prefill  string
	from     string // D the session was resident on (reseeds), for migration counting
	tokens   int64
	transfer bool
	seed     bool
	prefills bool
	input    int64
	maxOut   int64
	snapGen  uint64
	deadline time.Time
	idx      int // position in the expiry heap
}

// ledger is the control plane's own account of what it has committed per worker. Guarded by
// Service.mu.
type ledger struct {
	workers  map[string]*policy.Reserved
	pending  map[uint64]*reservation
	sessions map[string]uint64 // session -> seq of its in-flight seed/reseed
	expiry   expiryHeap
	// totals for metrics
	heldTokens int64
}

func newLedger() *ledger {
	return &ledger{
		workers:  make(map[string]*policy.Reserved),
		pending:  make(map[uint64]*reservation),
		sessions: make(map[string]uint64),
	}
}

// Reserved implements policy.Ledger.
func (l *ledger) Reserved(workerID string) policy.Reserved {
	if r := l.workers[workerID]; r != nil {
		return *r
	}
	return policy.Reserved{}
}

// TransferPending implements policy.Ledger.
func (l *ledger) TransferPending(sessionID string) bool {
	_, ok := l.sessions[sessionID]
	return ok
}

func (l *ledger) worker(id string) *policy.Reserved {
	r := l.workers[id]
	if r == nil {
		r = &policy.Reserved{}
		l.workers[id] = r
	}
	return r
}

// holdsDecode: r takes something on its decode worker (a plain P/D fallback names a D but
// reserves nothing there).
func (r *reservation) holdsDecode() bool {
	return r.decode != "" && (r.tokens != 0 || r.transfer || r.seed)
}

// add records r and takes its resources.
func (l *ledger) add(r *reservation) {
	if r.holdsDecode() {
		w := l.worker(r.decode)
		w.Tokens += r.tokens
		if r.transfer {
			w.Transfers++
		}
		if r.seed {
			w.Seeds++
		}
	}
	if r.prefills && r.prefill != "" {
		l.worker(r.prefill).Prefills++
	}
	if r.transfer {
		l.sessions[r.session] = r.seq
	}
	l.heldTokens += r.tokens
	l.pending[r.seq] = r
	heap.Push(&l.expiry, r)
}

// remove releases r's resources; it reports false when r was not pending (no double release).
func (l *ledger) remove(seq uint64) (*reservation, bool) {
	r, ok := l.pending[seq]
	if !ok {
		return nil, false
	}
	delete(l.pending, seq)
	heap.Remove(&l.expiry, r.idx)
	if r.holdsDecode() {
		w := l.workers[r.decode]
		w.Tokens -= r.tokens
		if r.transfer {
			w.Transfers--
		}
		if r.seed {
			w.Seeds--
		}
		if *w == (policy.Reserved{}) {
			delete(l.workers, r.decode)
		}
	}
	if r.prefills && r.prefill != "" {
		w := l.workers[r.prefill]
		w.Prefills--
		if *w == (policy.Reserved{}) {
			delete(l.workers, r.prefill)
		}
	}
	if r.transfer && l.sessions[r.session] == r.seq {
		delete(l.sessions, r.session)
	}
	l.heldTokens -= r.tokens
	return r, true
}

// expired removes and returns every reservation whose deadline is not after now.
func (l *ledger) expired(now time.Time) []*reservation {
	var out []*reservation
	for len(l.expiry) > 0 && !l.expiry[0].deadline.After(now) {
		r, _ := l.remove(l.expiry[0].seq)
		out = append(out, r)
	}
	return out
}

type expiryHeap []*reservation

func (h expiryHeap) Len() int { return len(h) }
func (h expiryHeap) Less(i, j int) bool {
	if h[i].deadline.Equal(h[j].deadline) {
		return h[i].seq < h[j].seq
	}
	return h[i].deadline.Before(h[j].deadline)
}
func (h expiryHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].idx = i
	h[j].idx = j
}
func (h *expiryHeap) Push(x any) {
	r := x.(*reservation)
	r.idx = len(*h)
	*h = append(*h, r)
}
func (h *expiryHeap) Pop() any {
	old := *h
	n := len(old)
	r := old[n-1]
	old[n-1] = nil
	*h = old[:n-1]
	r.idx = -1
	return r
}
