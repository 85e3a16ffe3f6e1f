package worker

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Config configures one simulated worker.
type Config struct {
	Role     kvcv1.WorkerRole
	WorkerID string
	Geometry Geometry
	Timing   Timing
	// Model is reported by /get_model_info and RegisterKVPool.
	Model string
	// TransferTimeout bounds one WaitReceive (and a SendKV).
	TransferTimeout time.Duration
	// BridgeTimeout bounds the quick bridge calls (commit, release, prepare).
	BridgeTimeout time.Duration
	// PreallocWait (decode) is how long a request that cannot get pages even by eviction waits
	// for running requests to free some before it is rejected with no_capacity (0: at once).
	PreallocWait time.Duration
	// Baseline models the peers' cache features (baseline.go; nil: none).
	Baseline *Baseline
	// Tensor parallelism: this process is rank TPRank of TPSize (0/0: none), as one scheduler
	// process of an SGLang server with --tp-size; registered with the pool. Its KV is its own
	// shard (the content pattern is keyed by the rank, so a shard received from another rank
	// fails verification) and it receives from the prefill rank of its own index (kv_hints
	// prefill_peer_addrs).
	TPRank, TPSize int32
	// EvictOnlyByRelease (decode): the engine never evicts a session for capacity, as SGLang
	// never evicts a streaming session; only the sidecar's capacity release
	// (WorkerReleaseCommand, sidecar-decode --release-high-watermark) or close_session frees
	// one. A request that does not fit waits in the prealloc queue (PreallocWait) for that.
	EvictOnlyByRelease bool
	// TierEgressGbps is the egress of a KV tier (the L3 store, a decode host's CPU tier) that
	// the flows out of it share (0: Timing.LinkGbps, one NIC; a store striped over N nodes has N).
	TierEgressGbps float64
	// LinkDir is where the flows out of each sender are counted across processes, for the
	// shared-link model (link.go); "" counts only this node's own NIC.
	LinkDir string
}

// Bridge is the part of the sidecar's WorkerBridgeService the worker calls.
type Bridge = kvcv1.WorkerBridgeServiceClient

// apiError is an error answer of the worker HTTP API.
type apiError struct {
	status int
	code   string
	msg    string
}

func (e *apiError) Error() string { return e.code + ": " + e.msg }

func errf(status int, code, format string, a ...any) *apiError {
	return &apiError{status: status, code: code, msg: fmt.Sprintf(format, a...)}
}

type session struct {
	id         string
	pages      []int64 // token order; covers at least kvLen tokens
	kvLen      int64
	lastUsed   uint64 // LRU clock
	lastUsedAt time.Time
	pinned     int // requests using the session's pages
	// waiting: of pinned, direct turns still waiting in the prealloc queue for their new pages:
	// a capacity release may take the session from them (attach.go), as the SGLang plugin's
	// release_for_capacity frees a slot whose turn is only queued.
	waiting   int
	committed bool // the sidecar knows it (CommitSession succeeded once)
	// base is the KV the session held when its running request took it (pinLocked; 0 for a
	// session a request creates): what the unevictable tokens count of it, the request's own
	// new pages being the control plane's reservation.
	base int64
}

// pinLocked marks s as used by one more request (unpin ends it); the first one fixes base.
// w.mu is held.
func (w *Worker) pinLocked(s *session) {
	s.pinned++
	if s.pinned == 1 {
		s.base = s.kvLen
	}
}

type turnLock struct {
	ch   chan struct{}
	refs int
}

// Worker is one simulated SGLang worker.
type Worker struct {
	cfg    Config
	log    zerolog.Logger
	mem    *kvpool.Pool
	bridge Bridge
	m      *metrics

	// allocMu serializes allocations (including their eviction calls), so that pages freed by an
	// eviction go to the allocation that caused it.
	allocMu sync.Mutex

	mu          sync.Mutex // guards everything below
	alloc       *allocator
	sessions    map[string]*session
	clock       uint64
	freed       chan struct{} // closed and replaced whenever pages are freed or a session becomes evictable
	quarantined int64         // pages not returned because their release failed
	prad        *poolRadix    // decode radix in the pool (baseline DecodeRadix; poolradix.go), nil: none

	turnMu sync.Mutex
	turns  map[string]*turnLock

	prefillGPU chan struct{} // one prefill pass at a time (the GPU)
	inbound    nic           // this node's NIC, inbound: the modeled flows into it (link.go)
	gpu        decodeGPU     // a decode worker's GPU: decode batch and its own prefills (decodegpu.go)
	allocQ     fifoQueue     // allocations waiting for room, first come first served (fifo.go)
	demand     demandBook    // the prealloc queue's demand, reported to the sidecar (demand.go)

	att attacher // the command watcher: re-attach after a sidecar restart, release commands (attach.go)

	// stepWork, when set, runs after each decode step's real work (a test's stand-in for a
	// slow stream: real work the model must not charge on top of the modeled step).
	stepWork func()
}

// New builds a worker over mem (its KV pool) talking to its sidecar through bridge.
func New(cfg Config, mem *kvpool.Pool, bridge Bridge, reg prometheus.Registerer, log zerolog.Logger) (*Worker, error) {
	if err := cfg.Geometry.Validate(); err != nil {
		return nil, err
	}
	if err := cfg.Timing.Validate(); err != nil {
		return nil, err
	}
	if cfg.Role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL && cfg.Role != kvcv1.WorkerRole_WORKER_ROLE_DECODE {
		return nil, fmt.Errorf("role must be prefill or decode, got %v", cfg.Role)
	}
	if err := kvcv1.ValidateID("worker id", cfg.WorkerID); err != nil {
		return nil, err
	}
	if cfg.TransferTimeout <= 0 {
		cfg.TransferTimeout = 60 * time.Second
	}
	if cfg.BridgeTimeout <= 0 {
		cfg.BridgeTimeout = 30 * time.Second
	}
	if cfg.Model == "" {
		cfg.Model = "Qwen/Qwen3-30B-A3B (kvc-sim)"
	}
	if cfg.TPSize < 0 || cfg.TPRank < 0 || cfg.TPRank >= max(cfg.TPSize, 1) {
		return nil, fmt.Errorf("tensor-parallel rank %d of %d", cfg.TPRank, cfg.TPSize)
	}
	w := &Worker{
		cfg:        cfg,
		log:        log,
		mem:        mem,
		bridge:     bridge,
		alloc:      newAllocator(cfg.Geometry.PageCount, kvpool.SessionSeed(cfg.WorkerID)),
		sessions:   map[string]*session{},
		freed:      make(chan struct{}),
		turns:      map[string]*turnLock{},
		prefillGPU: make(chan struct{}, 1),
	}
	if b := cfg.Baseline; b != nil && b.cfg.DecodeRadix && cfg.Role == kvcv1.WorkerRole_WORKER_ROLE_DECODE {
		capPages := cfg.Geometry.PageCount
		if b.cfg.RadixTokens > 0 {
			capPages = min(capPages, b.cfg.RadixTokens/int64(cfg.Geometry.PageSize))
		}
		w.prad = newPoolRadix(capPages)
	}
	w.m = newMetrics(reg, w)
	if err := w.initAttach(); err != nil {
		return nil, err
	}
	return w, nil
}

// CapacityTokens is the pool's capacity in tokens.
func (w *Worker) CapacityTokens() int64 {
	return w.cfg.Geometry.PageCount * int64(w.cfg.Geometry.PageSize)
}

// RegisterPool hands the KV pool to the sidecar (RegisterKVPool), retrying until ctx is done
// (the sidecar may still be starting).
func (w *Worker) RegisterPool(ctx context.Context) (*kvcv1.RegisterKVPoolResponse, error) {
	g := w.cfg.Geometry
	req := &kvcv1.RegisterKVPoolRequest{
		PageSize:  int32(g.PageSize),
		ItemLen:   g.ItemLen(),
		PageCount: g.PageCount,
		NumLayers: int32(g.Layers),
		Buffers:   poolRefs(w.mem, g),
		Model:     w.cfg.Model,
		TpRank:    w.cfg.TPRank,
		TpSize:    w.cfg.TPSize,
	}
	var lastErr error
	for attempt, backoff := 1, 50*time.Millisecond; ; attempt, backoff = attempt+1, min(2*backoff, time.Second) {
		cctx, cancel := context.WithTimeout(ctx, w.cfg.BridgeTimeout)
		resp, err := w.bridge.RegisterKVPool(cctx, req)
		cancel()
		if err == nil {
			w.startAttach()
			return resp, nil
		}
		lastErr = err
		ev := w.log.Debug()
		if attempt%5 == 1 {
			ev = w.log.Warn() // visible in the log tail a supervisor shows
		}
		ev.Err(err).Int("attempt", attempt).Msg("RegisterKVPool failed; retrying")
		if sleepCtx(ctx, backoff) != nil {
			return nil, fmt.Errorf("register kv pool with the sidecar: %w (last error: %v)", ctx.Err(), lastErr)
		}
	}
}

// Stats is a snapshot of the pool.
type Stats struct {
	PageCount   int64 `json:"page_count"`
	FreePages   int64 `json:"free_pages"`
	RadixPages  int64 `json:"radix_pages,omitempty"`
	Quarantined int64 `json:"quarantined_pages"`
	Sessions    int   `json:"sessions"`
}

func (w *Worker) stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	st := Stats{PageCount: w.cfg.Geometry.PageCount, FreePages: w.alloc.available(), Quarantined: w.quarantined, Sessions: len(w.sessions)}
	if w.prad != nil {
		st.RadixPages = w.prad.size()
	}
	return st
}

// SessionInfo describes one resident session (GET /kvc/sessions).
type SessionInfo struct {
	SessionID      string `json:"session_id"`
	KVLen          int64  `json:"kv_len"`
	Pages          int    `json:"pages"`
	Pinned         int    `json:"running_requests"`
	Committed      bool   `json:"committed"`
	LastUsedUnixMS int64  `json:"last_used_unix_ms"`
}

// Sessions lists the resident sessions, most recently used first.
func (w *Worker) Sessions() []SessionInfo {
	w.mu.Lock()
	ss := make([]*session, 0, len(w.sessions))
	for _, s := range w.sessions {
		ss = append(ss, s)
	}
	slices.SortFunc(ss, func(a, b *session) int { return cmp.Compare(b.lastUsed, a.lastUsed) })
	out := make([]SessionInfo, 0, len(ss))
	for _, s := range ss {
		out = append(out, SessionInfo{SessionID: s.id, KVLen: s.kvLen, Pages: len(s.pages), Pinned: s.pinned,
			Committed: s.committed, LastUsedUnixMS: s.lastUsedAt.UnixMilli()})
	}
	w.mu.Unlock()
	return out
}

func (w *Worker) touch(s *session) {
	w.clock++
	s.lastUsed = w.clock
	s.lastUsedAt = time.Now()
	if s.pinned > 0 {
		w.kickReport() // a request took it, or its KV grew: the unevictable tokens may have changed
	}
}

// lockTurn serializes the turns of one session (SGLang streaming sessions are sequential).
func (w *Worker) lockTurn(ctx context.Context, id string) (func(), error) {
	w.turnMu.Lock()
	tl := w.turns[id]
	if tl == nil {
		tl = &turnLock{ch: make(chan struct{}, 1)}
		w.turns[id] = tl
	}
	tl.refs++
	w.turnMu.Unlock()
	drop := func() {
		w.turnMu.Lock()
		tl.refs--
		if tl.refs == 0 {
			delete(w.turns, id)
		}
		w.turnMu.Unlock()
	}
	select {
	case tl.ch <- struct{}{}:
		return func() { <-tl.ch; drop() }, nil
	case <-ctx.Done():
		drop()
		return nil, ctx.Err()
	}
}

// freePages returns pages to the free list and wakes waiting allocations.
func (w *Worker) freePages(pages []int64) {
	if len(pages) == 0 {
		return
	}
	w.mu.Lock()
	w.alloc.put(pages)
	w.wakeLocked()
	w.mu.Unlock()
}

// wakeLocked wakes the allocations waiting for room (w.mu held): pages were freed, or a session
// was unpinned and can now be evicted.
func (w *Worker) wakeLocked() {
	close(w.freed)
	w.freed = make(chan struct{})
}

// bridgeCtx is a context for a cleanup call that must run even when the request is gone.
func (w *Worker) bridgeCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), w.cfg.BridgeTimeout)
}

// release tells the sidecar a session is gone; it returns after any push of it was aborted, so
// the pages may be freed afterwards. Tried twice.
//
// A sidecar that is gone (the call fails Unavailable: nothing listens on the bridge socket, or
// the sidecar is shutting down) reads no pages any more — a restarted one maps the pool afresh
// and knows only what the worker re-commits (attach.go) — so release reports success and the
// pages are freed: the worker evicts on its own (issue 23 item 1). Its residency is corrected
// when the sidecar is back: the evicted session is not re-committed, so the sidecar's resync
// does not list it; a snapshot of it stays valid for what it covers. Any other failure (a
// sidecar that is up but does not answer in time) leaves the pages quarantined by the caller.
// A sidecar that answers NotFound does not know the session — a restarted one before this
// worker re-committed to it (attach.go), or one that already let it go — so it reads none of
// its pages either: they are freed the same way (an eviction racing the re-attach had left them
// quarantined and its request 503 "release failed", and the session's drop unlogged).
func (w *Worker) release(id string, reason kvcv1.ReleaseReason) error {
	var err error
	for attempt := 0; attempt < 2; attempt++ {
		ctx, cancel := w.bridgeCtx()
		_, err = w.bridge.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: id, Reason: reason})
		cancel()
		if err == nil {
			return nil
		}
	}
	w.m.bridgeErrors.WithLabelValues("ReleaseSession").Inc()
	if c := status.Code(err); c == codes.Unavailable || c == codes.NotFound {
		w.m.sidecarlessReleases.Inc()
		// The faults harness reads this line (message and unix_ms) as a legitimate drop.
		w.log.Warn().Err(err).Str("session", id).Stringer("reason", reason).Int64("unix_ms", time.Now().UnixMilli()).
			Msg(msgReleasedWithoutSidecar)
		return nil
	}
	w.log.Error().Err(err).Str("session", id).Stringer("reason", reason).Msg("ReleaseSession failed")
	return err
}

// msgReleasedWithoutSidecar is the log message of a session freed while the sidecar is gone.
const msgReleasedWithoutSidecar = "sidecar gone: session released without it"

// dropSession removes a resident session and frees its pages (after ReleaseSession when the
// sidecar knows it). Pages whose release failed are quarantined, never reused: the sidecar may
// still be reading them.
func (w *Worker) dropSession(s *session, reason kvcv1.ReleaseReason) {
	w.mu.Lock()
	if w.sessions[s.id] == s {
		delete(w.sessions, s.id)
	}
	w.mu.Unlock()
	if s.committed {
		if err := w.release(s.id, reason); err != nil {
			w.mu.Lock()
			w.quarantined += int64(len(s.pages))
			w.mu.Unlock()
			return
		}
	}
	w.freePages(s.pages)
}

// allocate takes n pages. On a decode worker it evicts least-recently-used sessions that no
// request is using (never exclude) when the free list is short, and rejects with no_capacity when
// even that cannot make room. On a prefill worker it waits for running prefills to free pages.
func (w *Worker) allocate(ctx context.Context, n int64, exclude string) ([]int64, int, *apiError) {
	// First come first served: a request allocates only at the head of the queue (fifo.go), so
	// one that waits for room is not overtaken by later ones that happen to fit.
	tk := w.allocQ.join()
	defer w.allocQ.leave(tk)
	var deadline <-chan time.Time
	if w.cfg.PreallocWait > 0 && w.cfg.Role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
		tm := time.NewTimer(w.cfg.PreallocWait)
		defer tm.Stop()
		deadline = tm.C
	}
	// A decode allocation that waits (behind earlier ones, or for pages) is demand the sidecar's
	// capacity release must see (demand.go); the deferred call runs before leave.
	wt := w.demandWaiter(n)
	defer wt.done()
	if w.cfg.Role == kvcv1.WorkerRole_WORKER_ROLE_DECODE {
		defer w.queue()() // not running until it holds its pages (running_requests)
	}
	t0 := time.Now()
	select {
	case <-tk.head:
	default:
		wt.waiting()
	}
	select {
	case <-tk.head:
	case <-deadline:
		w.m.capacityRejects.Inc()
		return nil, 0, errf(http.StatusServiceUnavailable, "no_capacity", "need %d pages: waited %s in the prealloc queue behind %d earlier requests", n, w.cfg.PreallocWait, w.allocQ.len()-1)
	case <-ctx.Done():
		if w.cfg.Role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
			w.m.capacityRejects.Inc()
			return nil, 0, errf(http.StatusServiceUnavailable, "no_capacity", "waited for %d free pages until the request ended: %v", n, ctx.Err())
		}
		return nil, 0, ctxError(ctx, "in the prealloc queue")
	}
	if w.cfg.Role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
		for {
			w.mu.Lock()
			pages := w.alloc.take(n)
			ch := w.freed
			w.mu.Unlock()
			if pages != nil {
				return pages, 0, nil
			}
			select {
			case <-ch:
			case <-ctx.Done():
				w.m.capacityRejects.Inc()
				return nil, 0, errf(http.StatusServiceUnavailable, "no_capacity", "waited for %d free pages until the request ended: %v", n, ctx.Err())
			}
		}
	}
	// A request that cannot get room even by eviction (pages pinned by running requests) waits up
	// to PreallocWait in all (queue included) for running requests to free pages (SGLang's decode
	// prealloc queue), then is rejected with no_capacity.
	for {
		w.mu.Lock()
		ch := w.freed
		w.mu.Unlock()
		pages, ev, e := w.allocateOnce(n, exclude)
		if e == nil || e.code != "no_capacity" || deadline == nil || ev > 0 {
			if e != nil {
				w.m.capacityRejects.Inc()
			}
			return pages, ev, e
		}
		w.m.preallocWaits.Inc()
		wt.waiting()
		select {
		case <-ch:
		case <-deadline:
			w.m.capacityRejects.Inc()
			return nil, 0, errf(e.status, e.code, "%s; waited %s in the prealloc queue", e.msg, time.Since(t0).Round(time.Millisecond))
		case <-ctx.Done():
			return nil, 0, ctxError(ctx, "waiting for KV pages")
		}
	}
}

// allocateOnce is one allocation attempt with LRU eviction on a decode worker.
func (w *Worker) allocateOnce(n int64, exclude string) ([]int64, int, *apiError) {
	w.allocMu.Lock()
	defer w.allocMu.Unlock()
	w.mu.Lock()
	if pages := w.alloc.take(n); pages != nil {
		w.mu.Unlock()
		return pages, 0, nil
	}
	// The decode radix is part of the budget (free + evictable): its unlocked pages go first.
	if w.prad != nil && w.alloc.available()+w.prad.evictable() >= n {
		w.alloc.put(w.prad.evict(n - w.alloc.available()))
		pages := w.alloc.take(n)
		w.mu.Unlock()
		return pages, 0, nil
	}
	var cands []*session
	for _, s := range w.sessions {
		if s.pinned == 0 && s.id != exclude && !w.cfg.EvictOnlyByRelease {
			cands = append(cands, s)
		}
	}
	slices.SortFunc(cands, func(a, b *session) int { return cmp.Compare(a.lastUsed, b.lastUsed) })
	have := w.alloc.available()
	var victims []*session
	for _, s := range cands {
		if have >= n {
			break
		}
		victims = append(victims, s)
		have += int64(len(s.pages))
	}
	if have < n {
		free := w.alloc.available()
		w.mu.Unlock()
		if w.cfg.EvictOnlyByRelease {
			return nil, 0, errf(http.StatusServiceUnavailable, "no_capacity",
				"need %d pages, %d free (sessions are freed only by the sidecar's capacity release)", n, free)
		}
		return nil, 0, errf(http.StatusServiceUnavailable, "no_capacity",
			"need %d pages, %d free and %d more evictable (the rest is used by running requests)", n, free, have-free)
	}
	for _, v := range victims {
		delete(w.sessions, v.id)
	}
	w.mu.Unlock()
	for _, v := range victims {
		w.log.Info().Str("session", v.id).Int64("kv_len", v.kvLen).Msg("evicting session (LRU)")
		w.m.evictions.Inc()
		w.dropSession(v, kvcv1.ReleaseReason_RELEASE_REASON_EVICTED)
	}
	w.mu.Lock()
	pages := w.alloc.take(n)
	w.mu.Unlock()
	if pages == nil {
		return nil, len(victims), errf(http.StatusServiceUnavailable, "no_capacity",
			"need %d pages: evicted %d sessions but their release failed", n, len(victims))
	}
	return pages, len(victims), nil
}

// Close stops the command watcher, frees nothing on the sidecar (it notices the worker is
// gone) and unmaps the pool.
func (w *Worker) Close() error {
	w.stopAttach()
	w.stopReports()
	return w.mem.Close()
}
