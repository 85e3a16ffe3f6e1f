package decode

import (
	"slices"
	"sync"
	"time"

	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// creditMaxAge: a credit granted longer ago than this is not used (dropped): the store frees a
// credit left unused for its --snapshot-credit-timeout (5m by default), and a push must never
// copy into pages the store may already have given to someone else.
const creditMaxAge = time.Minute

// peerCredit is the store credit this sidecar holds at one snapshot store: free store pages it
// may write into before it has a reservation (the store's write guard lets it, and only it).
type peerCredit struct {
	endpoint string          // the store's transfer endpoint
	seg      rdma.SegmentID  // the segment opened for it when the credit came: a re-opened one drops it
	layout   *kvcv1.KVLayout // the store's layout
	id       uint64
	pages    []int64
	granted  time.Time
	busy     bool // a push is copying into it (claimed)
}

// creditBook holds the credits by store peer (its TransferPeerService address). At most one push
// at a time uses a store's credit: it claims it, and settles it with the answer of its reserve.
// Answers to other pushes replace the credit only while nobody holds the claim, and only with a
// newer id (the store's ids increase), so that an answer produced before a use of the credit
// never brings back pages the use took. The zero value is ready.
type creditBook struct {
	mu sync.Mutex
	m  map[string]*peerCredit
}

// claim takes addr's credit for one push (nil: none, in use, or too old).
func (b *creditBook) claim(addr string, now time.Time) *peerCredit {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.m[addr]
	switch {
	case c == nil || c.busy:
		return nil
	case now.Sub(c.granted) > creditMaxAge || len(c.pages) == 0:
		delete(b.m, addr)
		return nil
	}
	c.busy = true
	cp := *c
	cp.pages = slices.Clone(c.pages)
	return &cp
}

// settle ends a claim: next (nil: drop the credit) is the credit after the claimer's reserve.
func (b *creditBook) settle(addr string, next *peerCredit) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if next == nil {
		delete(b.m, addr)
		return
	}
	if b.m == nil {
		b.m = map[string]*peerCredit{}
	}
	b.m[addr] = next
}

// offer records the credit in the answer of a reserve that did not use one.
func (b *creditBook) offer(addr string, next *peerCredit) {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.m[addr]
	switch {
	case c != nil && c.busy:
		return
	case next == nil:
		delete(b.m, addr) // the store holds no credit for us (dropping one is always safe)
		return
	case c != nil && c.seg == next.seg && c.endpoint == next.endpoint && next.id <= c.id:
		return // older than (or the same as) what we have
	}
	if b.m == nil {
		b.m = map[string]*peerCredit{}
	}
	b.m[addr] = next
}

// creditFrom is the credit in a reserve's answer (nil when it holds none).
func creditFrom(res *kvcv1.ReserveSnapshotResponse, endpoint string, seg rdma.SegmentID, now time.Time) *peerCredit {
	if res.GetCreditId() == 0 || len(res.GetCreditPages()) == 0 {
		return nil
	}
	return &peerCredit{endpoint: endpoint, seg: seg, layout: res.GetStoreLayout(), id: res.GetCreditId(),
		pages: slices.Clone(res.GetCreditPages()), granted: now}
}
