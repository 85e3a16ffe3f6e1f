package prefill

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

// Reporter sends session events to the control plane (sidecar.ControlPlane).
type Reporter interface {
	Report(ev *kvcv1.SessionEvent)
}

type nopReporter struct{}

func (nopReporter) Report(*kvcv1.SessionEvent) {}

// Config configures the sidecar.
type Config struct {
	WorkerID      string
	Node          string
	GPUIndex      int32
	WorkerURL     string
	TPGroup       string // tensor-parallel group (--tp-group; empty: WorkerURL), sent in the hello
	Transport     string
	PeerAddr      string // advertised TransferPeerService address
	StoreBytes    int64
	StoreMemory   string // store.MemoryHost (default) or store.MemoryCUDA
	KVCapacity    int64  // override of what the pool implies (0 = pool)
	RoomTimeout   time.Duration
	TransferLimit time.Duration // budget of one reseed write
	// CreditTimeout frees a decode writer's store credit left unused this long (5m).
	CreditTimeout time.Duration
	// ReserveTimeout frees a store reservation left without commit or abort (30s).
	ReserveTimeout time.Duration
	// Now is the clock of the store and the expiry loop (tests; nil: time.Now).
	Now     func() time.Time
	Version string
	// PeerDial are extra dial options of connections to peer sidecars (mTLS credentials).
	PeerDial []grpc.DialOption
}

// Sidecar is the prefill sidecar. Its zero value is not usable; call New.
type Sidecar struct {
	kvcv1.UnimplementedWorkerBridgeServiceServer
	kvcv1.UnimplementedTransferPeerServiceServer

	cfg   Config
	log   zerolog.Logger
	ev    *sidecar.EventLog
	eng   rdma.Engine
	segs  *kvxfer.Segments
	peers *kvxfer.Peers
	rep   Reporter

	att *sidecar.Attach // the worker's command watcher and the readiness gate

	mu       sync.Mutex
	pool     *kvxfer.Pool // the worker's pool
	arena    *kvxfer.Pool // the store's memory
	st       *store.Store
	rooms    map[int64]*room
	finished map[int64]time.Time  // rooms already served (kept RoomTimeout): a late other half is recognised
	seeds    map[int64]*storeSeed // seeds written into the own store (SendKV to_store), by room
	policy   *kvcv1.Policy

	wg sync.WaitGroup // background writes

	// poolRanges are the worker pool's buffers in memory, for the write guard (load.go).
	poolRanges atomic.Pointer[[]memRange]

	tokenAnswers *prometheus.CounterVec // SnapshotTokens answers by outcome (Collectors)
}

// room is one transfer room seen by this sidecar: a seed (SendKV chunks) or a reseed
// (PushSnapshotCommand and/or the decode side's offer).
type room struct {
	id      int64
	created time.Time
	offer   *kvcv1.OfferReceiveRequest
	offerCh chan struct{} // closed when the offer arrives
	push    *kvcv1.PushSnapshotCommand
	pinned  bool
	mu      sync.Mutex // serialises the chunks of a seed
	bytes   int64
	started time.Time
	closed  bool
	aux     [][]byte // the last chunk's aux rows, carried in TransferDone
}

// New builds a sidecar around an engine; the event log may be nil.
func New(cfg Config, eng rdma.Engine, ev *sidecar.EventLog, log zerolog.Logger) *Sidecar {
	if cfg.RoomTimeout <= 0 {
		cfg.RoomTimeout = 60 * time.Second
	}
	if cfg.TransferLimit <= 0 {
		cfg.TransferLimit = 120 * time.Second
	}
	s := &Sidecar{cfg: cfg, log: log, ev: ev, eng: eng, segs: kvxfer.NewSegments(eng), peers: kvxfer.NewPeers(cfg.PeerDial...),
		rep: nopReporter{}, rooms: map[int64]*room{}, finished: map[int64]time.Time{}, seeds: map[int64]*storeSeed{},
		tokenAnswers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_snapshot_token_ids_answers_total",
			Help: "SnapshotTokens answers to loading decode sidecars by outcome: ids (the snapshot's token ids), none (pushed without ids), refused (no entry, another generation, fewer tokens)."},
			[]string{"outcome"})}
	s.att = sidecar.NewAttach(func() (bool, int32) {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.pool != nil, 0
	}, log.With().Str("part", "attach").Logger())
	return s
}

func (s *Sidecar) now() time.Time {
	if s.cfg.Now != nil {
		return s.cfg.Now()
	}
	return time.Now()
}

// SetReporter sets where session events go (the control-plane loop).
func (s *Sidecar) SetReporter(r Reporter) { s.rep = r }

// Registered is closed once the worker registered its KV pool (sidecar.Attach).
func (s *Sidecar) Registered() <-chan struct{} { return s.att.Registered() }

// WaitingFor says what the sidecar waits for before it is ready ("" when ready).
func (s *Sidecar) WaitingFor() string { return s.att.WaitingFor() }

// Instance is this sidecar process's random attach id.
func (s *Sidecar) Instance() string { return s.att.Instance() }

// WatchCommands is the worker's standing command stream (sidecar.Attach). A prefill sidecar
// sends no commands today; the attach status tells a worker whether to register again.
func (s *Sidecar) WatchCommands(req *kvcv1.WatchCommandsRequest, stream grpc.ServerStreamingServer[kvcv1.WatchCommandsResponse]) error {
	return s.att.Watch(req, stream)
}

// AckCommand is the worker's acknowledgement of its attach status.
func (s *Sidecar) AckCommand(_ context.Context, req *kvcv1.AckCommandRequest) (*kvcv1.AckCommandResponse, error) {
	return s.att.Ack(req)
}

// Status is GET /v1/status: attach state, pool shape (layout, tensor parallelism, aux rows).
func (s *Sidecar) Status() sidecar.Status {
	s.mu.Lock()
	p := s.pool
	s.mu.Unlock()
	return s.att.Status(s.cfg.WorkerID, p)
}

// Store returns the snapshot store (nil before registration).
func (s *Sidecar) Store() *store.Store {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.st
}

// Close stops background work and releases memory.
func (s *Sidecar) Close() {
	s.wg.Wait()
	s.peers.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pool != nil {
		s.pool.Close()
	}
	if s.arena != nil {
		s.arena.Close()
	}
}

// Run expires rooms and reservations until ctx is done.
func (s *Sidecar) Run(ctx context.Context) error {
	defer s.att.Close() // the worker's command stream must not hold up the bridge's graceful stop
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.expire(s.now())
		}
	}
}

func (s *Sidecar) expire(now time.Time) {
	if st := s.Store(); st != nil {
		st.Expire()
		s.expireSeeds(now, st)
	}
	var stale []*room
	s.mu.Lock()
	for id, at := range s.finished {
		if now.Sub(at) > s.cfg.RoomTimeout {
			delete(s.finished, id)
		}
	}
	for id, r := range s.rooms {
		if now.Sub(r.created) > s.cfg.RoomTimeout {
			delete(s.rooms, id)
			stale = append(stale, r)
		}
	}
	s.mu.Unlock()
	for _, r := range stale {
		if r.pinned {
			s.Store().Unpin(r.push.GetSessionId())
		}
		if r.offer != nil && !r.closed {
			s.done(r.offer, false, 0, "timeout: the prefill side never sent this room")
		}
	}
}

// ---- WorkerBridge ----

// RegisterKVPool maps the worker's pool, registers it with the engine and, the first time,
// allocates the snapshot store with the same geometry.
func (s *Sidecar) RegisterKVPool(_ context.Context, req *kvcv1.RegisterKVPoolRequest) (*kvcv1.RegisterKVPoolResponse, error) {
	p, err := kvxfer.OpenWorkerPool(req, s.eng) // shared memory, or GPU memory by CUDA IPC (--transport cuda)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	if err := kvxfer.CheckTPUnchanged(s.pool, p); err != nil {
		s.mu.Unlock()
		p.Close()
		return nil, err
	}
	if s.arena != nil && (s.arena.PageSize != p.PageSize || s.arena.ItemLen != p.ItemLen || s.arena.NumLayers != p.NumLayers || s.arena.MLA != p.MLA) {
		s.mu.Unlock()
		p.Close()
		return nil, status.Errorf(codes.FailedPrecondition, "pool geometry differs from the snapshot store's (%s, page_size %d, item_len %d, layers %d)", s.arena.LayoutName(), s.arena.PageSize, s.arena.ItemLen, s.arena.NumLayers)
	}
	if s.arena == nil {
		pageBytes := p.ItemLen * int64(p.Buffers())
		pages := s.cfg.StoreBytes / pageBytes
		if pages < 1 {
			s.mu.Unlock()
			p.Close()
			return nil, status.Errorf(codes.FailedPrecondition, "store capacity %d bytes is below one page (%d bytes)", s.cfg.StoreBytes, pageBytes)
		}
		// Host memory (pinned with --transport cuda) or GPU memory of this sidecar's device
		// (--store-memory cuda), shaped like the worker's pool (MHA or MLA).
		shape := p.Shape()
		shape.PageCount = pages
		arena, err := store.NewArena(s.eng, s.cfg.StoreMemory, shape)
		if err != nil {
			s.mu.Unlock()
			p.Close()
			return nil, status.Errorf(codes.ResourceExhausted, "snapshot store of %d pages: %v", pages, err)
		}
		scfg := store.Config{PageSize: int64(p.PageSize), PageBytes: pageBytes, PageCount: pages, OnEvict: s.onEvict,
			OnExpire: s.onExpire, OnCut: s.onCut, ReserveTimeout: s.cfg.ReserveTimeout, Now: s.cfg.Now, CreditTimeout: s.cfg.CreditTimeout}
		// The decode sidecars WRITE into the store; an engine whose owner side sees every write
		// (tcp) refuses, through the store's guard, every byte outside the token span of an
		// ingest in flight. One-sided backends (cuda) copy without the owner: bounds only.
		guarded, canGuard := s.eng.(rdma.WriteGuarded)
		if canGuard {
			scfg.Buffers = arena.Layout().GetBufferAddrs()
		}
		st, err := store.New(scfg)
		if err != nil {
			s.mu.Unlock()
			arena.Close()
			p.Close()
			return nil, status.Error(codes.Internal, err.Error())
		}
		s.arena, s.st = arena, st
		if canGuard {
			guarded.SetWriteGuard(s.writeGuard(st))
		} else {
			s.log.Info().Str("backend", s.eng.Backend()).Msg("store write guard not applicable: peers copy one-sided; only the engine's bounds against the registered regions apply")
		}
	}
	old := s.pool
	s.pool = p
	s.poolRanges.Store(poolRangesOf(p))
	s.mu.Unlock()
	if old != nil {
		old.Close()
	}
	s.att.PoolRegistered()
	s.log.Info().Int32("page_size", p.PageSize).Int64("item_len", p.ItemLen).Int64("pages", p.PageCount).
		Int32("layers", p.NumLayers).Str("layout", p.LayoutName()).Str("tp", p.TPString()).Ints64("aux_item_lens", p.AuxItemLens).Int64("store_bytes", s.st.CapacityBytes()).Bool("store_on_gpu", !s.arena.HostVisible()).Msg("worker KV pool registered")
	return &kvcv1.RegisterKVPoolResponse{KvBytesPerToken: p.BytesPerToken(), TransferEndpoint: s.eng.SegmentName()}, nil
}

// CommitSession is a decode-side call.
func (s *Sidecar) CommitSession(context.Context, *kvcv1.CommitSessionRequest) (*kvcv1.CommitSessionResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "CommitSession is a decode-worker call; this is a prefill sidecar")
}

// ReleaseSession is a decode-side call.
func (s *Sidecar) ReleaseSession(context.Context, *kvcv1.ReleaseSessionRequest) (*kvcv1.ReleaseSessionResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "ReleaseSession is a decode-worker call; this is a prefill sidecar")
}

// PrepareReceive is a decode-side call.
func (s *Sidecar) PrepareReceive(context.Context, *kvcv1.PrepareReceiveRequest) (*kvcv1.PrepareReceiveResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "PrepareReceive is a decode-worker call; this is a prefill sidecar")
}

// WaitReceive is a decode-side call.
func (s *Sidecar) WaitReceive(context.Context, *kvcv1.WaitReceiveRequest) (*kvcv1.WaitReceiveResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "WaitReceive is a decode-worker call; this is a prefill sidecar")
}

// SnapshotStatus reports the store's snapshot of a session.
func (s *Sidecar) SnapshotStatus(_ context.Context, req *kvcv1.SnapshotStatusRequest) (*kvcv1.SnapshotStatusResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	st := s.Store()
	if st == nil {
		return &kvcv1.SnapshotStatusResponse{}, nil
	}
	v, ok := st.Get(req.GetSessionId())
	if !ok {
		return &kvcv1.SnapshotStatusResponse{PrefillWorker: s.cfg.WorkerID}, nil
	}
	return &kvcv1.SnapshotStatusResponse{Exists: true, Seqlen: v.Seqlen, Generation: v.Generation,
		FreshnessS: time.Since(v.Updated).Seconds(), PrefillWorker: s.cfg.WorkerID}, nil
}

// SendKV writes a chunk of a seed transfer (the worker's pages) into the decode side's pages,
// waiting for the decode side's offer if it has not arrived yet. With last, TransferDone is sent.
// With to_store the chunk goes into this sidecar's own snapshot store instead (seed.go).
func (s *Sidecar) SendKV(ctx context.Context, req *kvcv1.SendKVRequest) (*kvcv1.SendKVResponse, error) {
	if req.GetRoom() == 0 {
		return nil, status.Error(codes.InvalidArgument, "room is required")
	}
	if req.GetFirstPage() < 0 || len(req.GetPages()) == 0 && !req.GetLast() {
		return nil, status.Errorf(codes.InvalidArgument, "bad chunk: first_page %d, %d pages", req.GetFirstPage(), len(req.GetPages()))
	}
	if len(req.GetAux()) > 0 && !req.GetLast() {
		return nil, status.Error(codes.InvalidArgument, "aux rows go with the last chunk only")
	}
	s.mu.Lock()
	pool := s.pool
	s.mu.Unlock()
	if pool == nil {
		return nil, status.Error(codes.FailedPrecondition, "no KV pool registered")
	}
	if err := pool.CheckAux(req.GetAux()); err != nil {
		return nil, err
	}
	if err := pool.CheckPages(req.GetPages()); err != nil {
		return nil, err
	}
	if req.GetToStore() {
		return s.sendToStore(ctx, req, pool)
	}
	r := s.room(req.GetRoom())
	if r == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "room %d is already finished", req.GetRoom())
	}
	wait := s.cfg.RoomTimeout
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-r.offerCh:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	case <-t.C:
		return nil, status.Errorf(codes.DeadlineExceeded, "room %d: no offer from the decode side within %v", req.GetRoom(), wait)
	}
	off := r.offer
	if off.GetKind() != kvcv1.TransferKind_TRANSFER_KIND_SEED {
		return nil, status.Errorf(codes.FailedPrecondition, "room %d is a %s transfer, not a seed", req.GetRoom(), off.GetKind())
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, status.Errorf(codes.FailedPrecondition, "room %d is already finished", req.GetRoom())
	}
	if r.started.IsZero() {
		r.started = time.Now()
	}
	ps := int64(pool.PageSize)
	from := req.GetFirstPage() * ps
	to := min((req.GetFirstPage()+int64(len(req.GetPages())))*ps, off.GetTokens())
	if req.GetLast() && req.GetTokens() > 0 && req.GetTokens() != off.GetTokens() {
		err := fmt.Sprintf("seed of %d tokens, but the decode side prepared %d", req.GetTokens(), off.GetTokens())
		r.closed = true
		s.finish(r, false, err)
		return nil, status.Error(codes.FailedPrecondition, err)
	}
	var moved uint64
	if to > from {
		seg, err := s.segs.Open(ctx, off.GetDecodeTransferEndpoint())
		if err == nil {
			var plan *kvxfer.TokenPlan
			plan, err = kvxfer.PlanRuns(kvxfer.PageMap{Layout: pool.Layout(), Pages: req.GetPages(), First: req.GetFirstPage()},
				kvxfer.PageMap{Layout: off.GetDecodeLayout(), Pages: off.GetPages()}, from, to)
			if err == nil {
				moved, err = plan.Transfer(ctx, s.eng, seg)
			}
			if err != nil && !errors.Is(err, kvxfer.ErrAborted) {
				s.segs.Forget(off.GetDecodeTransferEndpoint())
			}
		}
		if err != nil {
			r.closed = true
			reason := err.Error()
			if ctx.Err() != nil {
				reason = "prefill worker went away mid-transfer: " + reason
			}
			s.finish(r, false, reason)
			return nil, status.Errorf(codes.Aborted, "room %d: %s", req.GetRoom(), reason)
		}
	}
	r.bytes += int64(moved)
	if req.GetLast() {
		r.closed = true
		r.aux = req.GetAux()
		s.finish(r, true, "")
	}
	return &kvcv1.SendKVResponse{Bytes: int64(moved)}, nil
}

// room returns (creating) the room; nil when the room was already served.
func (s *Sidecar) room(id int64) *room {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, done := s.finished[id]; done {
		return nil
	}
	r, ok := s.rooms[id]
	if !ok {
		r = &room{id: id, created: time.Now(), offerCh: make(chan struct{})}
		s.rooms[id] = r
	}
	return r
}

// finish sends TransferDone for a room and forgets it.
func (s *Sidecar) finish(r *room, ok bool, reason string) {
	s.mu.Lock()
	if s.rooms[r.id] == r {
		delete(s.rooms, r.id)
	}
	s.finished[r.id] = time.Now()
	s.mu.Unlock()
	var aux [][]byte
	if ok {
		aux = r.aux
	}
	s.done(r.offer, ok, r.bytes, reason, aux...)
}

// done sends TransferDone for a room; aux are the sender's aux rows (a seed's last chunk).
func (s *Sidecar) done(off *kvcv1.OfferReceiveRequest, ok bool, bytes int64, reason string, aux ...[]byte) {
	c, err := s.peers.Client(off.GetDecodePeerAddr())
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err = c.TransferDone(ctx, &kvcv1.TransferDoneRequest{Room: off.GetRoom(), Ok: ok, Bytes: bytes, Tokens: off.GetTokens(), Error: reason, Aux: aux})
		cancel()
	}
	if err != nil {
		s.log.Warn().Err(err).Int64("room", off.GetRoom()).Str("peer", off.GetDecodePeerAddr()).Msg("TransferDone not delivered")
	}
}
