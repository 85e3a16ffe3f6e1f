package router

import (
	"iter"
	"math"
	"time"
	"unsafe"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus"
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
	store    bool // a reseed from a prefill store (RESEED_SNAPSHOT): holds a store-transfer slot
	seed     bool
	// landed: the decode sidecar reported the transfer done (TRANSFER_DONE of the decision's
	// room): its store-transfer slot was given back then and it counts in Reserved.Landed; its
	// tokens, transfer and seed counts stay until the outcome.
	landed   bool
	prefills bool
	plain    bool // a plain P/D request (PD_FALLBACK) with a decode worker: counted in Reserved.Plain
	newSess  bool // opens a new session on decode (policy.Decision.NewSession): tokens counted in Reserved.NewSession
	input    int64
	maxOut   int64
	snapGen  uint64
	snapLen  int64  // tokens a RESEED_SNAPSHOT writes from the snapshot ([0, snapLen))
	sessGen  uint64 // the session's generation at the decision (SESSION_NOT_RESIDENT outcomes)
	keep     bool   // the decision's D keeps the session (policy.Execution.KeepSession)
	opens    bool   // the decision makes the session resident on its D (OpenSession)
	truncate int64  // the decision's truncate_to (PREFIX_TRUNCATED)
	storeGen uint64 // ≠ 0: a seed through the prefill store, as the snapshot of this generation
	// pageSize and prompt: the query's content address (content.go); pageSize 0 = none.
	pageSize int64
	prompt   []uint64
	// Agent hints of the query (hints.go): the pin asked for and whether the session's
	// low-priority hint changed with it.
	pinMs      int64
	lowChanged bool
	// trace: the decision span's W3C traceparent (trace.go), on the commands sent for the
	// decision after its outcome; "" when none.
	trace    string
	deadline time.Time
	// pos: its positions in the ledger's expiry heap (pos[byDeadline]) and in its decode
	// worker's batch heap (pos[byMaxOut], decodes: r.decodes()).
	pos [2]int
	// dacct, pacct: the accounts of its decode and prefill workers that it holds resources of
	// while pending (ledger.add; nil: none held there).
	dacct, pacct *workerAccount
	// ack: where its outcome's acknowledgement goes when Handle asked (in the decision's answer
	// block, decisionMsg.ack); nil: allocated or pooled by the outcome.
	ack *ackMsg
	// out: its outcome's session edit (updateSession), kept across the pool's reuse (a pointer:
	// a new decision's reservation is written whole without it).
	out *outcomeCtx
	// nextFree links the reservations handed back for reuse (Service.freed, Service.spare).
	nextFree *reservation
}

// ledger is the control plane's own account of what it has committed per worker. Guarded by
// Service.mu.
type ledger struct {
	// workers: each worker's account (its reservations and settling tokens), one map lookup
	// per worker touched. An entry stays when it falls to zero (a worker's reservations come
	// and go with every decision and its outcome: no delete and re-insert per reservation);
	// zero entries are swept when the table outgrows twice the worker snapshot (sweep).
	workers map[string]*workerAccount
	// byID caches accounts of workers by the identity of their id's string (acctSlot): the
	// policy asks Reserved with the worker snapshot's ids and a reservation names its workers by
	// the same strings, so most lookups are a pointer compare instead of a string hash and probe.
	byID [acctSlots]acctSlot
	// found caches FindWorker's answers on the worker snapshot foundIn (findSlot), cleared when
	// a decision comes with another snapshot.
	found    [acctSlots]findSlot
	foundIn  []*kvcv1.Worker
	pending  pendingTable
	sessions map[string]uint64 // session -> seq of its in-flight seed/reseed
	expiry   resHeap           // by deadline
	// nSettling counts the accounts whose settling list is not empty.
	nSettling int
	// minFront is a lower bound on the first entry's atMs of every settling list (meaningful
	// while nSettling > 0): prune skips the per-worker lookups when no first entry can be old
	// enough for any worker's heartbeat.
	minFront int64
	// view is the worker snapshot prune last ran on, viewMaxHb its newest heartbeat; clean:
	// no settling entry is old enough for view's heartbeats, except perhaps those added since
	// (newMin: the oldest of them; none when !added). A decision on the same snapshot then
	// skips prune's per-worker work (a snapshot is immutable: a load report publishes a new one).
	view      []*kvcv1.Worker
	viewMaxHb int64
	clean     bool
	added     bool
	newMin    int64
	// totals for metrics
	heldTokens int64
	// prefix: per prefill worker, the prompts routed there (prefixview.go).
	prefix map[string]*prefixView
}

// workerAccount is one worker's part of the ledger.
type workerAccount struct {
	// res: what the worker's pending reservations hold; res.Settling is the sum of settling.
	res policy.Reserved
	// admitted: the worker's kvc_router_worker_admitted_total counter once a decision looked
	// it up (metrics.admitted), kept with the account.
	admitted prometheus.Counter
	// batch: the pending reservations that decode on this worker (reservation.decodes), a
	// min-heap by max_output: DecodeBatch reads its size and front.
	batch resHeap
	// settling: tokens that successful outcomes added to a decode worker and that its load
	// report does not show yet (admitted after its last heartbeat). Without them a D looks
	// emptier than it is for up to one heartbeat after every success, and consecutive new
	// sessions all land on it. Its array is kept when it empties (appends reuse it).
	settling []settle
}

// held is what the worker's pending reservations hold (res without the settling tokens).
func (w *workerAccount) held() policy.Reserved {
	r := w.res
	r.Settling = 0
	return r
}

// idle: the account holds nothing (a sweep may drop it; its admitted counter is looked up
// again by the next decision that needs it).
func (w *workerAccount) idle() bool {
	return w.res == (policy.Reserved{}) && len(w.settling) == 0 && w.batch.len() == 0
}

// settle is one success's tokens, admitted at atMs.
type settle struct {
	tokens int64
	atMs   int64
}

// settleMarginMs: a heartbeat must be this much newer than a success to be trusted to include
// it (the sidecar computes its load a moment before the control plane receives it).
const settleMarginMs = 50

func newLedger() *ledger {
	return &ledger{
		workers:  make(map[string]*workerAccount),
		sessions: make(map[string]uint64),
		expiry:   resHeap{key: byDeadline},
	}
}

// settle records tokens a successful outcome added to decode worker id at nowMs.
func (l *ledger) settle(id string, tokens, nowMs int64) {
	if id == "" || tokens <= 0 {
		return
	}
	l.settleOn(l.worker(id), tokens, nowMs)
}

// settleOn is settle on the worker's account w (an outcome has it from its reservation).
func (l *ledger) settleOn(w *workerAccount, tokens, nowMs int64) {
	if tokens <= 0 {
		return
	}
	if l.nSettling == 0 || nowMs < l.minFront {
		l.minFront = nowMs
	}
	if !l.added || nowMs < l.newMin {
		l.newMin = nowMs
	}
	l.added = true
	if len(w.settling) == 0 {
		l.nSettling++
	}
	w.settling = append(w.settling, settle{tokens: tokens, atMs: nowMs})
	w.res.Settling += tokens
}

// prune drops settling tokens that the workers' latest load reports already include.
func (l *ledger) prune(workers []*kvcv1.Worker) {
	if len(l.workers) > 2*len(workers)+16 {
		l.sweep()
	}
	if l.nSettling == 0 {
		return
	}
	// Exact shortcuts: an entry is dropped only when atMs+margin < its worker's heartbeat, and
	// only from the front of its list; every front is >= minFront. On the snapshot of the last
	// prune only entries added since can be old enough.
	if len(workers) == 0 || len(workers) != len(l.view) || &workers[0] != &l.view[0] {
		maxHb := int64(math.MinInt64)
		for _, w := range workers {
			maxHb = max(maxHb, w.GetLastHeartbeatUnixMs())
		}
		l.view, l.viewMaxHb, l.clean = workers, maxHb, false
	}
	maxHb := l.viewMaxHb
	if l.clean && (!l.added || l.newMin+settleMarginMs >= maxHb) {
		return
	}
	l.clean, l.added = true, false
	if l.minFront+settleMarginMs >= maxHb {
		return
	}
	defer l.resetMinFront()
	for _, wk := range workers {
		w := l.account(wk.WorkerId)
		if w == nil || len(w.settling) == 0 {
			continue
		}
		list := w.settling
		hb := wk.GetLastHeartbeatUnixMs()
		n := 0
		for n < len(list) && list[n].atMs+settleMarginMs < hb {
			w.res.Settling -= list[n].tokens
			n++
		}
		if n > 0 {
			// Kept at the front of its array: appends reuse it instead of growing a slice whose
			// front was cut off (an allocation every few successes).
			w.settling = list[:copy(list, list[n:])]
			if len(w.settling) == 0 {
				l.nSettling--
			}
		}
	}
}

// resetMinFront recomputes minFront from the settling lists' first entries.
func (l *ledger) resetMinFront() {
	first := true
	for _, w := range l.workers {
		if len(w.settling) > 0 && (first || w.settling[0].atMs < l.minFront) {
			l.minFront = w.settling[0].atMs
			first = false
		}
	}
}

// sweep drops the accounts that hold nothing (workers that left keep none for long).
func (l *ledger) sweep() {
	for id, w := range l.workers {
		if w.idle() {
			delete(l.workers, id)
		}
	}
	l.byID = [acctSlots]acctSlot{} // it may name an account dropped here
}

// acctSlots is the size of the ledger's account cache (a power of two, above the worker counts
// of one control plane's clusters; a collision only costs a map lookup).
const acctSlots = 128

// acctSlot caches w, the account of worker id: a lookup by a string with the same bytes in
// memory as id (the same string, not only equal) hits it. The slot holds id, so its memory is
// not reused for another string while cached.
type acctSlot struct {
	id string
	w  *workerAccount
}

// account is id's account (nil: none), through the cache when id is a string it has seen.
func (l *ledger) account(id string) *workerAccount {
	if id == "" {
		return l.workers[id]
	}
	p := unsafe.StringData(id)
	u := uintptr(unsafe.Pointer(p))
	slot := &l.byID[(u^u>>7)&(acctSlots-1)]
	if unsafe.StringData(slot.id) == p && len(slot.id) == len(id) {
		return slot.w
	}
	w := l.workers[id]
	if w != nil {
		*slot = acctSlot{id: id, w: w}
	}
	return w
}

// findSlot caches w, the worker of the snapshot with id (the same string in memory) and role.
type findSlot struct {
	id   string
	role kvcv1.WorkerRole
	w    *kvcv1.Worker
}

// FindWorker implements policy.WorkerFinder: policy.FindWorker's answer on ws (an immutable
// snapshot: a load report publishes a new one), cached by the identity of id's string.
func (l *ledger) FindWorker(ws []*kvcv1.Worker, id string, role kvcv1.WorkerRole) *kvcv1.Worker {
	if id == "" || len(ws) == 0 {
		return policy.FindWorker(ws, id, role)
	}
	if len(ws) != len(l.foundIn) || &ws[0] != &l.foundIn[0] {
		l.found, l.foundIn = [acctSlots]findSlot{}, ws
	}
	p := unsafe.StringData(id)
	u := uintptr(unsafe.Pointer(p))
	slot := &l.found[(u^u>>7)&(acctSlots-1)]
	if unsafe.StringData(slot.id) == p && len(slot.id) == len(id) && slot.role == role {
		return slot.w
	}
	w := policy.FindWorker(ws, id, role)
	*slot = findSlot{id: id, role: role, w: w}
	return w
}

// Reserved implements policy.Ledger.
func (l *ledger) Reserved(workerID string) policy.Reserved {
	if w := l.account(workerID); w != nil {
		return w.res
	}
	return policy.Reserved{}
}

// DecodeBatch implements policy.DecodeBatcher: the decisions in flight on workerID that decode
// there (max_output > 1: a background re-home decodes nothing), how many and the smallest
// max_output among them — the worker's batch account, kept on add and remove (O(1) here; the
// policy asks per large-append candidate).
func (l *ledger) DecodeBatch(workerID string) (int32, int64) {
	w := l.account(workerID)
	if w == nil || w.batch.len() == 0 {
		return 0, 0
	}
	return int32(w.batch.len()), w.batch.front().maxOut
}

// decodes: r decodes on its decode worker (counted in that worker's batch).
func (r *reservation) decodes() bool { return r.decode != "" && r.maxOut > 1 }

// TransferPending implements policy.Ledger.
func (l *ledger) TransferPending(sessionID string) bool {
	_, ok := l.sessions[sessionID]
	return ok
}

// worker is id's account, made when missing.
func (l *ledger) worker(id string) *workerAccount {
	w := l.account(id)
	if w == nil {
		w = &workerAccount{batch: resHeap{key: byMaxOut}}
		l.workers[id] = w
	}
	return w
}

// holdsDecode: r takes something on its decode worker (a plain P/D fallback names a D but
// reserves nothing there).
func (r *reservation) holdsDecode() bool {
	return r.decode != "" && (r.tokens != 0 || r.transfer || r.store || r.seed)
}

// add records r and takes its resources; it returns the account of r's decode worker when r
// holds something there (nil otherwise). r keeps the accounts it takes from (r.dacct,
// r.pacct): its removal and its outcome's settling look none up again.
func (l *ledger) add(r *reservation) (decode *workerAccount) {
	holds := r.holdsDecode()
	var d *workerAccount
	if holds || r.plain || r.decodes() {
		d = l.worker(r.decode)
	}
	r.dacct, r.pacct = d, nil
	if holds {
		decode = d
		w := &d.res
		w.Tokens += r.tokens
		if r.newSess {
			w.NewSession += r.tokens
		}
		if r.transfer {
			w.Transfers++
		}
		if r.store {
			w.StoreTransfers++
		}
		if r.seed {
			w.Seeds++
		}
	}
	if r.prefills && r.prefill != "" {
		r.pacct = l.worker(r.prefill)
		r.pacct.res.Prefills++
		l.routedPrompt(r.prefill, r.prompt)
	}
	if r.plain {
		d.res.Plain++
	}
	if r.decodes() {
		d.batch.push(r)
	}
	if r.transfer {
		l.sessions[r.session] = r.seq
	}
	l.heldTokens += r.tokens
	l.pending.put(r)
	l.expiry.push(r)
	return decode
}

// remove releases r's resources; it reports false when r was not pending (no double release).
func (l *ledger) remove(seq uint64) (*reservation, bool) {
	r := l.pending.take(seq)
	if r == nil {
		return nil, false
	}
	l.expiry.remove(r)
	// The accounts a pending reservation took from are its own (r.dacct, r.pacct): they exist
	// (only idle ones are swept, and r's hold keeps them from idling).
	if r.holdsDecode() {
		w := &r.dacct.res
		w.Tokens -= r.tokens
		if r.newSess {
			w.NewSession -= r.tokens
		}
		if r.transfer {
			w.Transfers--
		}
		if r.seed {
			w.Seeds--
		}
		switch {
		case r.landed && r.transfer:
			w.Landed--
		case !r.landed && r.store:
			w.StoreTransfers--
		}
	}
	if r.pacct != nil {
		r.pacct.res.Prefills--
	}
	if r.plain {
		r.dacct.res.Plain--
	}
	if r.decodes() {
		r.dacct.batch.remove(r)
	}
	if r.transfer && l.sessions[r.session] == r.seq {
		delete(l.sessions, r.session)
	}
	l.heldTokens -= r.tokens
	return r, true
}

// landed records that seq's transfer into decode worker id for session has landed there (the
// decode sidecar's TRANSFER_DONE of the decision's room): the transfer counts in Landed (no
// transfer is running into the worker for it any more) and gives back its store-transfer slot
// (max_concurrent_transfers). The reservation stays pending — its tokens, its transfer and seed
// counts (the work its turn brings: it decodes there), its decode batch entry and its
// session's pending transfer (TransferPending: the session is not resident until the outcome)
// — and the outcome releases the rest. It reports whether it changed anything (false: not
// pending, another session's or worker's, no transfer, or landed already).
func (l *ledger) landed(seq uint64, id, session string) bool {
	r := l.pending.get(seq)
	if r == nil || r.landed || r.decode != id || r.session != session || !r.transfer {
		return false
	}
	r.landed = true
	w := &r.dacct.res
	w.Landed++
	if r.store {
		w.StoreTransfers--
	}
	return true
}

// shorten moves seq's deadline to at when that is earlier; it reports whether seq is pending.
func (l *ledger) shorten(seq uint64, at time.Time) bool {
	r := l.pending.get(seq)
	if r == nil {
		return false
	}
	if at.Before(r.deadline) {
		r.deadline = at
		l.expiry.fix(r)
	}
	return true
}

// expired removes and returns every reservation whose deadline is not after now.
func (l *ledger) expired(now time.Time) []*reservation {
	var out []*reservation
	for l.expiry.len() > 0 && !l.expiry.front().deadline.After(now) {
		r, _ := l.remove(l.expiry.front().seq)
		out = append(out, r)
	}
	return out
}

// heapKey is what a resHeap orders its reservations by, and which of a reservation's positions
// (reservation.pos) it keeps.
type heapKey uint8

const (
	// byDeadline: the ledger's pending reservations, earliest deadline first (ledger.expiry).
	byDeadline heapKey = iota
	// byMaxOut: a decode worker's batch, its decoding reservations, smallest max_output first
	// (workerAccount.batch).
	byMaxOut
)

// resHeap is a binary min-heap of reservations by its key, ties by lower sequence number
// first. Its operations are container/heap's, written for the type: no interface call per
// comparison and swap (250 instructions per query and outcome with container/heap); each
// reservation keeps its position in each heap it is in (pos[key]), for remove and fix.
type resHeap struct {
	key   heapKey
	items []*reservation
}

func (h *resHeap) len() int { return len(h.items) }

// front is the first reservation in the order (the heap must not be empty).
func (h *resHeap) front() *reservation { return h.items[0] }

func (h *resHeap) less(i, j int) bool {
	a, b := h.items[i], h.items[j]
	if h.key == byMaxOut {
		if a.maxOut != b.maxOut {
			return a.maxOut < b.maxOut
		}
	} else if !a.deadline.Equal(b.deadline) {
		return a.deadline.Before(b.deadline)
	}
	return a.seq < b.seq
}

func (h *resHeap) swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.items[i].pos[h.key] = i
	h.items[j].pos[h.key] = j
}

func (h *resHeap) up(j int) {
	for j > 0 {
		i := (j - 1) / 2 // parent
		if !h.less(j, i) {
			break
		}
		h.swap(i, j)
		j = i
	}
}

func (h *resHeap) down(i0, n int) bool {
	i := i0
	for {
		j1 := 2*i + 1
		if j1 >= n || j1 < 0 { // j1 < 0 after int overflow
			break
		}
		j := j1 // left child
		if j2 := j1 + 1; j2 < n && h.less(j2, j1) {
			j = j2 // = 2*i + 2  // right child
		}
		if !h.less(j, i) {
			break
		}
		h.swap(i, j)
		i = j
	}
	return i > i0
}

// push adds r (heap.Push).
func (h *resHeap) push(r *reservation) {
	r.pos[h.key] = len(h.items)
	h.items = append(h.items, r)
	h.up(len(h.items) - 1)
}

// remove takes r out (heap.Remove at its position).
func (h *resHeap) remove(r *reservation) {
	i, n := r.pos[h.key], len(h.items)-1
	if n != i {
		h.swap(i, n)
		if !h.down(i, n) {
			h.up(i)
		}
	}
	h.items[n] = nil
	h.items = h.items[:n]
	r.pos[h.key] = -1
}

// fix restores the order after r's key changed (heap.Fix at its position).
func (h *resHeap) fix(r *reservation) {
	if i := r.pos[h.key]; !h.down(i, len(h.items)) {
		h.up(i)
	}
}

// pendingTable holds the reservations awaiting their outcome by sequence number: one slot per
// sequence number modulo the table's size, and a map for a reservation whose slot an older one
// still holds. Sequence numbers are issued in order and outcomes come back within a window of
// decisions far smaller than the table, so an add, a lookup and a removal are one slot's
// compare instead of a map's hash, probe and deletion mark each (a map of uint64 keys was
// about 500 instructions per query and outcome, most of them the delete).
type pendingTable struct {
	slots []*reservation // len a power of two (or 0)
	over  map[uint64]*reservation
	n     int
}

// minPendingSlots is a new table's size (it doubles while over half full).
const minPendingSlots = 1024

// len is the number of reservations held.
func (t *pendingTable) len() int { return t.n }

// get returns seq's reservation (nil: not pending).
func (t *pendingTable) get(seq uint64) *reservation {
	if len(t.slots) > 0 {
		if r := t.slots[seq&uint64(len(t.slots)-1)]; r != nil && r.seq == seq {
			return r
		}
	}
	if len(t.over) == 0 {
		return nil
	}
	return t.over[seq]
}

// put holds r under r.seq (replacing a reservation of the same sequence number).
func (t *pendingTable) put(r *reservation) {
	if 2*(t.n+1) > len(t.slots) {
		t.grow()
	}
	i := r.seq & uint64(len(t.slots)-1)
	switch cur := t.slots[i]; {
	case cur == nil:
		if _, ok := t.over[r.seq]; ok {
			t.over[r.seq] = r
			return
		}
		t.slots[i] = r
	case cur.seq == r.seq:
		t.slots[i] = r
		return
	default:
		if t.over == nil {
			t.over = make(map[uint64]*reservation)
		}
		if _, ok := t.over[r.seq]; !ok {
			t.n++
		}
		t.over[r.seq] = r
		return
	}
	t.n++
}

// take removes and returns seq's reservation (nil: not pending).
func (t *pendingTable) take(seq uint64) *reservation {
	if len(t.slots) > 0 {
		i := seq & uint64(len(t.slots)-1)
		if r := t.slots[i]; r != nil && r.seq == seq {
			t.slots[i] = nil
			t.n--
			return r
		}
	}
	r, ok := t.over[seq]
	if !ok {
		return nil
	}
	delete(t.over, seq)
	t.n--
	return r
}

// grow doubles the table (minPendingSlots at first) and places every reservation again.
func (t *pendingTable) grow() {
	old, over := t.slots, t.over
	t.slots, t.over, t.n = make([]*reservation, max(minPendingSlots, 2*len(old))), nil, 0
	for _, r := range old {
		if r != nil {
			t.put(r)
		}
	}
	for _, r := range over {
		t.put(r)
	}
}

// all yields every reservation held, in no particular order (t must not change meanwhile).
func (t *pendingTable) all() iter.Seq[*reservation] {
	return func(yield func(*reservation) bool) {
		for _, r := range t.slots {
			if r != nil && !yield(r) {
				return
			}
		}
		for _, r := range t.over {
			if !yield(r) {
				return
			}
		}
	}
}
