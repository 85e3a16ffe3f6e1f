package state

import (
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Errors returned to the sidecar and admin services (they map them to gRPC codes).
var (
	ErrNotLeader     = errors.New("state: not the leader")
	ErrNoStream      = errors.New("state: worker has no live stream")
	ErrQueueFull     = errors.New("state: worker's command queue is full")
	ErrDuplicate     = errors.New("state: worker already has a live stream")
	ErrStaleLeader   = errors.New("state: a sidecar has seen a newer epoch; this leader is stale")
	ErrUnknownWorker = errors.New("state: unknown worker")
)

// Config configures a State.
type Config struct {
	NodeID string
	Store  *kvstore.Store
	Log    zerolog.Logger
	Reg    prometheus.Registerer
	// Defaults for session_ttl_ms and unreachable_grace_ms (0 = built-in defaults).
	SessionTTL       time.Duration
	UnreachableGrace time.Duration
	// Write-behind delay (0 = kvstore.DefaultMaxDelay).
	FlushDelay time.Duration
	// CommandQueue is the per-stream command queue length (default 256).
	CommandQueue int
	// VolatileFlush is how often changes to an existing session's volatile fields only (turn,
	// last_seen_unix_ms, kv_committed_len, epoch, d_rejects) are persisted; they wait in a
	// dirty set until then (or Flush / EndTerm) and are then written to the volatile journal
	// (many sessions per etcd key, see journal.go), not as full records. Creations and
	// changes of residency, snapshot, generation, migrations or previous_decode_worker are
	// written behind at once as full records. 0 = DefaultVolatileFlush; negative = persist
	// every change at once as a full record (no journal).
	VolatileFlush time.Duration

	// DrainSnapshotWait bounds how long a drain waits for a session's snapshot to become
	// usable before it releases the session without one (0 = DefaultDrainSnapshotWait).
	DrainSnapshotWait time.Duration

	// journalMax is the sessions per journal key (0: journalMaxEntries); tests lower it.
	journalMax int
}

// DefaultVolatileFlush is the default Config.VolatileFlush.
const DefaultVolatileFlush = 2 * time.Second

// State is the leader's tables. The zero value is not usable; call New.
type State struct {
	cfg      Config
	rehome   atomic.Pointer[rehomeHook] // the router's re-homing (SetRehomeHook)
	landed   atomic.Pointer[landedHook] // the router's transfer slots (SetTransferHook)
	log      zerolog.Logger
	m        *metrics
	defaults *kvcv1.Policy

	policy atomic.Pointer[kvcv1.Policy] // filled
	stored atomic.Pointer[kvcv1.Policy] // operator overrides as stored (may be nil)
	// policyKnown: stored holds a version read from etcd (or written), nil meaning none stored;
	// false until then (a corrupt record then has no last good version: LeadTerm)
	policyKnown atomic.Bool
	policyMu    sync.Mutex // serialises UpdatePolicy
	epoch       atomic.Int64
	genTerm     atomic.Uint64                   // the term's generation term (policy.NextGeneration)
	issued      atomic.Uint64                   // the highest generation issued in this term (claims.go)
	cur         atomic.Pointer[Term]            // the term, for lock-free Epoch/Leading
	snapshot    atomic.Pointer[[]*kvcv1.Worker] // the router's view (tp.go: one record per tensor-parallel group)
	listing     atomic.Pointer[[]*kvcv1.Worker] // ListWorkers' view: the router's plus every other rank
	nextCmdID   atomic.Uint64
	nSessions   atomic.Int64

	mu       sync.Mutex
	term     *Term // nil when not leading
	sessions map[string]sessEntry
	recs     recSlab // the records of sessions (recSlab)
	workers  map[string]*workerEntry
	byDecode map[string]map[string]struct{} // decode worker -> session ids resident there
	bySnap   map[string]map[string]struct{} // prefill worker -> session ids with a snapshot there
	drains   map[string]*drainOp            // worker -> its drain under this term (drain.go)
	// view is the tensor-parallel grouping of the workers as last published (tp.go).
	view *tpView
	// tpSnap: what each rank of a tensor-parallel prefill group holds of a session's snapshot
	// (session id -> rank worker id -> shard); tpSnapBy indexes it by rank (tp.go). Empty
	// without tensor parallelism.
	tpSnap   map[string]map[string]tpShard
	tpSnapBy map[string]map[string]struct{}
	// resyncPending: decode workers loaded from etcd when this term began whose sidecars have
	// not attached yet; resyncUntil (unix ms, 0: none pending) bounds the window (resync.go).
	resyncPending map[string]struct{}
	resyncUntil   atomic.Int64
	// commitsAway: decode workers' commits of sessions the record did not name them for yet
	// (commits.go).
	commitsAway map[string]commitAway
	// idsGen counts session creations and deletions (the admin pager's snapshot is current
	// while it is unchanged); idSnap is that snapshot (ListSessions).
	idsGen uint64
	idSnap atomic.Pointer[idSnapshot]
	// dirty lists the sessions whose volatile changes wait for the next journal flush (the
	// entry's dirty flag is the truth; an id may appear more than once or be stale).
	dirty []string
	// flushing is the list a journal flush is working through (flushing[fpos:] is left).
	flushing []string
	fpos     int
	jr       journal
}

// sessEntry is a session in the leader's table (16 bytes: a million of them sit in a map).
// Its record comes from recSlab (records created here) or from kvstore.LoadAll's chunks
// (records loaded): many records per heap object, not one each.
type sessEntry struct {
	rec *kvcv1.SessionRecord
	// js is jseq | dirtyBit when dirty.
	js uint64
}

const dirtyBit = 1 << 63

// jseq is the journal key holding the session's latest persisted volatile fields; 0 when the
// record in sessions/ holds them.
func (e sessEntry) jseq() uint64 { return e.js &^ dirtyBit }

// dirty: volatile changes not yet handed to the batcher (the id is in State.dirty or
// State.flushing).
func (e sessEntry) dirty() bool { return e.js&dirtyBit != 0 }

// recChunk is how many session records one allocation of recSlab holds: as many as fit in
// 64 KiB (315 of 208 bytes), so that a chunk fills its pages (an allocation this large takes
// whole 8 KiB pages; 256 records would leave half a page empty).
const recChunk = int(64 << 10 / unsafe.Sizeof(kvcv1.SessionRecord{}))

// recSlab hands out the records of created sessions from chunks of recChunk and takes back
// those of deleted ones for the next sessions created: the table's records are one heap
// object per chunk instead of one per session, so a GC cycle marks and sweeps a few hundred
// objects for them instead of one per session (docs/routing.md §10). A record handed back is
// reset and may be handed out again at once: nothing outside the state lock holds a live
// record (UpdateSession's fn must not keep it; Session and ListSessions return copies). A
// table that shrank keeps its peak's records (208 bytes per session) in the free list until
// the term ends (resetLocked starts a new slab).
type recSlab struct {
	chunk []kvcv1.SessionRecord
	free  []*kvcv1.SessionRecord
}

// get returns a zero record.
func (a *recSlab) get() *kvcv1.SessionRecord {
	if n := len(a.free); n > 0 {
		r := a.free[n-1]
		a.free[n-1] = nil
		a.free = a.free[:n-1]
		return r
	}
	if len(a.chunk) == 0 {
		a.chunk = make([]kvcv1.SessionRecord, recChunk)
	}
	r := &a.chunk[0]
	a.chunk = a.chunk[1:]
	return r
}

// put takes back the record of a deleted session.
func (a *recSlab) put(r *kvcv1.SessionRecord) {
	r.Reset()
	a.free = append(a.free, r)
}

type workerEntry struct {
	w      *kvcv1.Worker // immutable once published; replaced on change
	stream *Stream
	gen    uint64 // bumped on every attach and detach
	grace  *time.Timer
	saved  time.Time // last time the record was written to etcd
}

// loadPersistEvery bounds how often a worker's live load is written to etcd (load reports
// arrive every second or so; standbys and a new leader only need a recent value).
const loadPersistEvery = 5 * time.Second

// New returns a State that is not leading.
func New(cfg Config) *State {
	if cfg.CommandQueue <= 0 {
		cfg.CommandQueue = 256
	}
	if cfg.VolatileFlush == 0 {
		cfg.VolatileFlush = DefaultVolatileFlush
	}
	if cfg.DrainSnapshotWait <= 0 {
		cfg.DrainSnapshotWait = DefaultDrainSnapshotWait
	}
	if cfg.journalMax <= 0 {
		cfg.journalMax = journalMaxEntries
	}
	s := &State{cfg: cfg, log: cfg.Log, defaults: DefaultPolicy(cfg.SessionTTL, cfg.UnreachableGrace)}
	s.m = newMetrics(cfg.Reg, func() float64 { return float64(s.nSessions.Load()) })
	s.policy.Store(FillPolicy(s.defaults, nil))
	empty := []*kvcv1.Worker{}
	s.snapshot.Store(&empty)
	s.listing.Store(&empty)
	s.resetLocked()
	return s
}

func (s *State) resetLocked() {
	s.sessions = make(map[string]sessEntry)
	s.recs = recSlab{}
	s.workers = make(map[string]*workerEntry)
	s.byDecode = make(map[string]map[string]struct{})
	s.bySnap = make(map[string]map[string]struct{})
	s.drains = make(map[string]*drainOp)
	s.view = &tpView{}
	s.tpSnap = make(map[string]map[string]tpShard)
	s.tpSnapBy = make(map[string]map[string]struct{})
	s.resyncPending = make(map[string]struct{})
	s.resyncUntil.Store(0)
	s.commitsAway = make(map[string]commitAway)
	s.dirty, s.flushing, s.fpos = nil, nil, 0
	s.jr.reset()
	s.publishJournalLocked()
	s.nSessions.Store(0)
	s.idsGen++
	s.idSnap.Store(nil)
}

// Defaults returns the default policy (with the configured TTL and grace).
func (s *State) Defaults() *kvcv1.Policy { return proto.Clone(s.defaults).(*kvcv1.Policy) }

// RehomeHook is told when sessions lose their residency because their decode worker left
// READY (its worker died, it drains, or it stayed unreachable past its grace), and when a
// decode sidecar reports how a LoadSessionCommand ended (router.Service re-homes the sessions:
// docs/routing.md §3). Both are called under the state lock: they must be quick and must not
// call the State.
type RehomeHook interface {
	SessionsLost(from string, sessions []string)
	SessionLoaded(worker string, ev *kvcv1.SessionEvent)
}

type rehomeHook struct{ h RehomeHook }

// SetRehomeHook sets (nil: clears) the re-homing hook.
func (s *State) SetRehomeHook(h RehomeHook) {
	if h == nil {
		s.rehome.Store(nil)
		return
	}
	s.rehome.Store(&rehomeHook{h})
}

// TransferHook is told when a decode sidecar reports a transfer into its worker done
// (SESSION_EVENT_KIND_TRANSFER_DONE: the KV of the seed or reseed whose bootstrap room the
// event names has landed; router.Service ends the decision's transfer slot). Called outside
// the state lock, on the reporting sidecar's stream; not for a rank of a tensor-parallel group.
type TransferHook interface {
	TransferLanded(worker string, ev *kvcv1.SessionEvent)
}

type landedHook struct{ h TransferHook }

// SetTransferHook sets (nil: clears) the transfer hook.
func (s *State) SetTransferHook(h TransferHook) {
	if h == nil {
		s.landed.Store(nil)
		return
	}
	s.landed.Store(&landedHook{h})
}

// lostLocked tells the re-homing hook that sessions left decode worker from.
func (s *State) lostLocked(from string, sessions []string) {
	if hk := s.rehome.Load(); hk != nil && len(sessions) > 0 {
		hk.h.SessionsLost(from, sessions)
	}
}

// Policy returns the current policy with every default filled in. Read-only.
func (s *State) Policy() *kvcv1.Policy { return s.policy.Load() }

// StoredPolicy returns the operator's overrides as last seen in etcd (nil when none).
func (s *State) StoredPolicy() *kvcv1.Policy { return s.stored.Load() }

// Epoch is the leader epoch (create revision of the leader key); 0 when not leading, the
// term's leadership context included (past the renew deadline the router decides as
// control-plane-unavailable).
func (s *State) Epoch() int64 {
	if t := s.cur.Load(); !t.acting() {
		return 0
	}
	return s.epoch.Load()
}

// GenerationTerm is the term's generation term, the range of the KV generations this leader
// gives sessions (policy.NextGeneration; advanced in etcd by LeadTerm); 0 when not leading,
// like Epoch.
func (s *State) GenerationTerm() uint64 {
	if t := s.cur.Load(); !t.acting() {
		return 0
	}
	return s.genTerm.Load()
}

// Leading reports whether this replica holds a term whose leadership has not ended.
func (s *State) Leading() bool { return s.cur.Load().acting() }

// Workers returns an immutable snapshot of the routable workers with state and last load: every
// worker, except that a tensor-parallel group is one record, its rank 0's (tp.go), and its other
// ranks are left out.
func (s *State) Workers() []*kvcv1.Worker { return *s.snapshot.Load() }

// ListedWorkers returns what ListWorkers lists: Workers() plus the ranks of tensor-parallel
// groups it leaves out, each as itself. Immutable.
func (s *State) ListedWorkers() []*kvcv1.Worker { return *s.listing.Load() }

// Worker returns the worker as ListWorkers lists it (immutable; do not modify).
func (s *State) Worker(id string) (*kvcv1.Worker, bool) {
	ws := s.ListedWorkers()
	i, ok := slices.BinarySearchFunc(ws, id, func(w *kvcv1.Worker, id string) int { return strings.Compare(w.GetWorkerId(), id) })
	if !ok {
		return nil, false
	}
	return ws[i], true
}

// Session returns a copy of the session record.
func (s *State) Session(id string) (*kvcv1.SessionRecord, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.sessions[id]
	if !ok {
		return nil, false
	}
	return proto.Clone(e.rec).(*kvcv1.SessionRecord), true
}

// SessionCount returns the number of session records in memory.
func (s *State) SessionCount() int { return int(s.nSessions.Load()) }

// UpdateSession applies fn to the live record (created with session_id set if missing) under
// the state lock, then persists it write-behind. fn must be quick and must not call State.
// To change the snapshot, fn replaces rec.Snapshot (or sets it to nil); it must not modify
// the SnapshotInfo in place (the change would be taken for a volatile one). On a replica that
// is not leading (or whose leadership context ended) it does nothing. When fn makes another
// worker the session's decode worker without setting kv_committed_len (the router's outcomes
// never set it: the decode sidecar's commit is its one writer), it becomes that worker's last
// commit of the session, 0 when none was seen (its next COMMITTED sets it; commits.go).
func (s *State) UpdateSession(id string, fn func(rec *kvcv1.SessionRecord)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.term.acting() {
		return
	}
	e, existed := s.sessions[id]
	if !existed {
		e = s.createLocked(id)
	}
	rec := e.rec
	before, kv := durableOf(rec), rec.GetKvCommittedLen()
	fn(rec)
	rec.SessionId = id
	if d := rec.GetDecodeWorker(); d != before.decode && d != "" && rec.GetKvCommittedLen() == kv {
		// A residency the router made (a seed's or reseed's outcome, which never names a
		// length): its committed length is the new decode worker's commit (commits.go).
		rec.KvCommittedLen = s.committedOnLocked(id, d, rec.GetGeneration())
	}
	s.IssueGeneration(rec.GetGeneration()) // the router numbers new residencies here (policy.NextGeneration)
	s.updatedLocked(e, &before, !existed)
}

// ListSessions pages through the in-memory records in id order: up to limit records with
// id > after (resident on worker, when worker is set). next is "" on the last page.
//
// The routing lock is never held to sort. Without a worker filter, pages are cut from a sorted
// snapshot of every session id: taken (ids copied under the lock, sorted outside it) for a
// first page (after == "") unless no session was created or deleted since the last one, and
// reused by the pages that continue a listing for up to listSnapshotTTL, so a whole listing
// copies the ids about once instead of once per page; a session created during a listing may
// be missed by it. With a worker filter the worker's ids are copied under the lock and the
// page chosen outside it (a bounded heap). Records are cloned under the lock; one deleted in
// between is left out, so a page may hold fewer than limit records while next continues.
func (s *State) ListSessions(after string, limit int, worker string) (recs []*kvcv1.SessionRecord, next string) {
	if limit <= 0 {
		limit = 100
	}
	var page []string
	var more bool
	if worker == "" {
		ids := s.sortedIDs(after != "")
		i, _ := slices.BinarySearch(ids, after)
		if i < len(ids) && ids[i] == after {
			i++
		}
		page = ids[i:min(i+limit, len(ids))]
		more = i+limit < len(ids)
	} else {
		s.mu.Lock()
		ids := make([]string, 0, len(s.byDecode[worker]))
		for id := range s.byDecode[worker] {
			if id > after {
				ids = append(ids, id)
			}
		}
		s.mu.Unlock()
		page, more = smallest(ids, limit)
	}
	s.mu.Lock()
	for _, id := range page {
		e, ok := s.sessions[id]
		if !ok || (worker != "" && e.rec.GetDecodeWorker() != worker) {
			continue
		}
		recs = append(recs, proto.Clone(e.rec).(*kvcv1.SessionRecord))
	}
	s.mu.Unlock()
	if more && len(page) > 0 {
		next = page[len(page)-1]
	}
	return recs, next
}

// listSnapshotTTL bounds how long the pages continuing a listing reuse one sorted id snapshot.
const listSnapshotTTL = time.Second

// idSnapshot is every session id, sorted, as of gen (State.idsGen).
type idSnapshot struct {
	ids []string
	gen uint64
	at  time.Time
}

// sortedIDs returns a sorted snapshot of every session id (read-only): the cached one when no
// session was created or deleted since, or, for a continuing listing, when it is younger than
// listSnapshotTTL; else a new one (ids copied under the lock, sorted outside it).
func (s *State) sortedIDs(continuing bool) []string {
	snap := s.idSnap.Load()
	s.mu.Lock()
	if snap != nil && (snap.gen == s.idsGen || (continuing && time.Since(snap.at) < listSnapshotTTL)) {
		s.mu.Unlock()
		return snap.ids
	}
	ids := make([]string, 0, len(s.sessions))
	for id := range s.sessions {
		ids = append(ids, id)
	}
	gen := s.idsGen
	s.mu.Unlock()
	slices.Sort(ids)
	s.idSnap.Store(&idSnapshot{ids: ids, gen: gen, at: time.Now()})
	return ids
}

// smallest returns the k smallest of ids in order, and whether ids held more than k. ids is
// reordered.
func smallest(ids []string, k int) ([]string, bool) {
	if len(ids) <= k {
		slices.Sort(ids)
		return ids, false
	}
	// Max-heap of the k smallest seen so far in ids[:k].
	h := ids[:k]
	down := func(i int) {
		for {
			l, big := 2*i+1, i
			if l < k && h[l] > h[big] {
				big = l
			}
			if r := l + 1; r < k && h[r] > h[big] {
				big = r
			}
			if big == i {
				return
			}
			h[i], h[big] = h[big], h[i]
			i = big
		}
	}
	for i := k/2 - 1; i >= 0; i-- {
		down(i)
	}
	for _, id := range ids[k:] {
		if id < h[0] {
			h[0] = id
			down(0)
		}
	}
	out := slices.Clone(h)
	slices.Sort(out)
	return out, true
}

func (s *State) getOrCreateLocked(id string) *kvcv1.SessionRecord {
	e, ok := s.sessions[id]
	if !ok {
		e = s.createLocked(id)
	}
	return e.rec
}

// createLocked adds a new session (not persisted yet: the caller's update writes it).
func (s *State) createLocked(id string) sessEntry {
	// last_seen stays 0 until a request is routed (idle expiry falls back to created): the
	// router reads a record never seen as turn 0.
	rec := s.recs.get()
	rec.SessionId, rec.CreatedUnixMs = id, time.Now().UnixMilli()
	e := sessEntry{rec: rec}
	s.sessions[id] = e
	s.nSessions.Add(1)
	s.idsGen++
	return e
}

// durable is what of a session record must reach etcd at once when it changes: residency,
// snapshot, generation, migrations, creation. Everything else (turn, last_seen,
// kv_committed_len, epoch, d_rejects) is volatile: the sidecars' full resync restores
// kv_committed_len, and turn / last_seen are advisory.
//
// The snapshot is compared by identity: a change of it replaces rec.Snapshot (UpdateSession's
// contract), so the check does not read the SnapshotInfo (a cache miss per decision, since a
// resident session's decision never looks at it).
type durable struct {
	decode, previous string
	snap             *kvcv1.SnapshotInfo
	generation       uint64
	migrations       int32
	created          int64
	// The agent hints (router/hints.go) are not in the volatile journal: a change writes the
	// whole record, so a new leader keeps a granted pin and the priority.
	pinnedUntil int64
	low         bool
}

func durableOf(r *kvcv1.SessionRecord) durable {
	return durable{decode: r.GetDecodeWorker(), previous: r.GetPreviousDecodeWorker(), snap: r.GetSnapshot(),
		generation: r.GetGeneration(), migrations: r.GetMigrations(), created: r.GetCreatedUnixMs(),
		pinnedUntil: r.GetPinnedUntilUnixMs(), low: r.GetLowPriority()}
}

// same reports whether r (not nil) still has d's durable fields (durableOf(r) == *d, read in
// place: no copy of r's and no generated comparison of two structs per session update).
func (d *durable) same(r *kvcv1.SessionRecord) bool {
	return r.Generation == d.generation && r.Snapshot == d.snap && r.CreatedUnixMs == d.created &&
		r.PinnedUntilUnixMs == d.pinnedUntil && r.Migrations == d.migrations && r.LowPriority == d.low &&
		r.DecodeWorker == d.decode && r.PreviousDecodeWorker == d.previous
}

// updatedLocked re-indexes e's record after a change and persists it: at once (a full
// record) when it was just created or a durable field changed, else in the volatile journal
// at the next flush.
func (s *State) updatedLocked(e sessEntry, before *durable, created bool) {
	rec := e.rec
	if created || s.cfg.VolatileFlush < 0 || !before.same(rec) {
		s.changedLocked(rec, before.decode, before.snap.GetPrefillWorker())
		return
	}
	rec.Epoch = s.epoch.Load()
	if s.term != nil {
		s.markDirtyLocked(rec.SessionId, e)
	}
}

// changedLocked re-indexes rec after a change and persists it (write-behind, not deferred).
func (s *State) changedLocked(rec *kvcv1.SessionRecord, oldD, oldP string) {
	id := rec.GetSessionId()
	if d := rec.GetDecodeWorker(); d != oldD {
		unindex(s.byDecode, oldD, id)
		index(s.byDecode, d, id)
	}
	if p := rec.GetSnapshot().GetPrefillWorker(); p != oldP {
		unindex(s.bySnap, oldP, id)
		index(s.bySnap, p, id)
	}
	rec.Epoch = s.epoch.Load()
	s.persistSessionLocked(rec)
}

// persistSessionLocked writes the whole record behind, volatile fields included: it is no
// longer dirty, and its journal entry (if any) is dead from now on.
func (s *State) persistSessionLocked(rec *kvcv1.SessionRecord) {
	if s.term == nil {
		return
	}
	id := rec.GetSessionId()
	rec.VolatileSeq = s.jr.seq // journal keys up to this one are older than this record
	if err := s.term.batcher.PutSession(rec); err != nil {
		s.m.writeFailures.Inc()
	}
	if e, ok := s.sessions[id]; ok && e.js != 0 {
		old := e.jseq()
		e.js = 0
		s.sessions[id] = e
		s.dropJournalLocked(old) // queued after the record's put
	}
}

func (s *State) deleteSessionLocked(id string) {
	e, ok := s.sessions[id]
	if !ok {
		return
	}
	rec := e.rec
	unindex(s.byDecode, rec.GetDecodeWorker(), id)
	unindex(s.bySnap, rec.GetSnapshot().GetPrefillWorker(), id)
	for w := range s.tpSnap[id] {
		unindex(s.tpSnapBy, w, id)
	}
	delete(s.tpSnap, id)
	delete(s.commitsAway, id)
	delete(s.sessions, id)
	s.recs.put(rec)
	s.nSessions.Add(-1)
	s.idsGen++
	if s.term != nil {
		if err := s.term.batcher.DeleteSession(id); err != nil {
			s.m.writeFailures.Inc()
		}
		s.dropJournalLocked(e.jseq())
	}
}

func index(ix map[string]map[string]struct{}, w, id string) {
	if w == "" {
		return
	}
	set, ok := ix[w]
	if !ok {
		set = make(map[string]struct{})
		ix[w] = set
	}
	set[id] = struct{}{}
}

func unindex(ix map[string]map[string]struct{}, w, id string) {
	if w == "" {
		return
	}
	if set, ok := ix[w]; ok {
		delete(set, id)
		if len(set) == 0 {
			delete(ix, w)
		}
	}
}

// publishWorkersLocked swaps in new immutable worker snapshots (the router's and the listing,
// tp.go) and updates the gauges.
func (s *State) publishWorkersLocked() {
	out := make([]*kvcv1.Worker, 0, len(s.workers))
	type roleState struct {
		role  kvcv1.WorkerRole
		state kvcv1.WorkerState
	}
	counts := map[roleState]int{}
	for _, e := range s.workers {
		out = append(out, e.w)
		counts[roleState{e.w.GetRole(), e.w.GetState()}]++
	}
	slices.SortFunc(out, func(a, b *kvcv1.Worker) int { return strings.Compare(a.GetWorkerId(), b.GetWorkerId()) })
	old := s.view
	s.view = groupWorkers(out)
	s.snapshot.Store(&s.view.routing)
	s.listing.Store(&s.view.listing)
	if len(s.view.problems) > 0 || len(old.problems) > 0 {
		s.tpProblemsChangedLocked(old.problems, s.view.problems)
	}
	for role, rl := range map[kvcv1.WorkerRole]string{kvcv1.WorkerRole_WORKER_ROLE_PREFILL: "prefill", kvcv1.WorkerRole_WORKER_ROLE_DECODE: "decode"} {
		for st, sl := range map[kvcv1.WorkerState]string{kvcv1.WorkerState_WORKER_STATE_READY: "ready", kvcv1.WorkerState_WORKER_STATE_DRAINING: "draining",
			kvcv1.WorkerState_WORKER_STATE_UNREACHABLE: "unreachable", kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN: "worker_down"} {
			s.m.workers.WithLabelValues(rl, sl).Set(float64(counts[roleState{role, st}]))
		}
	}
}

// setWorkerLocked replaces a worker's record (cloned and modified by fn), publishes the new
// snapshot and, when persist is set, writes it behind.
func (s *State) setWorkerLocked(e *workerEntry, persist bool, fn func(w *kvcv1.Worker)) {
	nw := proto.Clone(e.w).(*kvcv1.Worker)
	fn(nw)
	e.w = nw
	s.publishWorkersLocked()
	if persist && s.term != nil {
		e.saved = time.Now()
		if err := s.term.batcher.PutWorker(nw); err != nil {
			s.m.writeFailures.Inc()
		}
	}
}
