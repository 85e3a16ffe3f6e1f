package decode

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"sort"
	"sync"
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
)

// Reporter sends session events to the control plane (sidecar.ControlPlane), and a load
// report at once when asked (KickLoad).
type Reporter interface {
	Report(ev *kvcv1.SessionEvent)
	KickLoad()
}

type nopReporter struct{}

func (nopReporter) Report(*kvcv1.SessionEvent) {}
func (nopReporter) KickLoad()                  {}

// Config configures the sidecar.
type Config struct {
	WorkerID    string
	Node        string
	GPUIndex    int32
	WorkerURL   string
	TPGroup     string // tensor-parallel group (--tp-group; empty: WorkerURL), sent in the hello
	Transport   string
	PeerAddr    string // advertised TransferPeerService address
	KVCapacity  int64  // override of what the pool implies (0 = pool)
	DeltaTokens int64  // push when committed − last pushed ≥ this (DefaultDeltaTokens; the policy overrides)
	PushWorkers int    // concurrent pushes (2)
	PushTimeout time.Duration
	RoomTimeout time.Duration
	// SnapshotCreditPages is the store credit a push keeps at each snapshot store (push.go,
	// credit.go): free store pages the next full push copies its first tokens into while its
	// reservation is on the way. 0 disables credits.
	SnapshotCreditPages int64
	Version             string
	// PeerDial are extra dial options of connections to peer sidecars (mTLS credentials).
	PeerDial []grpc.DialOption
	// Release configures the capacity release of idle sessions (release.go); zero: off.
	Release ReleaseConfig
	// IdleFlush: a session with no commit for this long gets its unpushed tail pushed whatever
	// DeltaTokens says (idle.go); 0 disables.
	IdleFlush time.Duration
}

// errReleased cancels the push of a released session.
var errReleased = errors.New("session released")

// Sidecar is the decode sidecar; build it with New.
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

	att *sidecar.Attach // the worker's command watcher and the readiness gate (attach.go)

	mu       sync.Mutex
	pool     *kvxfer.Pool
	sessions map[string]*session
	targets  map[string]*kvcv1.SetSnapshotTargetCommand // targets named before the first commit
	hints    map[string]hints                           // agent hints named before the first commit (hints.go)
	// dropped: sessions the control plane told us to stop tracking while the worker may still
	// hold them; the worker's later ReleaseSession of one is answered OK, not NOT_FOUND.
	dropped  map[string]struct{}
	rooms    map[int64]*recvRoom
	delta    int64
	enabled  bool
	queue    []string
	wake     chan struct{}
	inflight int

	aborts  pendingAborts // AbortSnapshot calls still running, by session (push.go)
	credits creditBook    // store credits by store peer (credit.go)

	rel    releaser // capacity release of idle sessions (release.go)
	demand demand   // the worker's prealloc-queue demand, as last reported (release.go)

	relKick     chan struct{} // runs a release pass now (a demand report)
	after       afterFunc     // idle-flush timers (idle.go)
	idleFlushes int64         // idle flushes that queued a push

	loadsDone, loadsFailed int64                  // LoadSessionCommands that ended (load.go)
	loadIDs                *prometheus.CounterVec // loads by where their token ids came from (load.go)
}

type session struct {
	id         string
	committed  int64
	pages      []int64
	ids        []int32 // the token ids of [0, committed) from its last commit, or nil (never written in place: a push reads it unlocked)
	idsPushed  bool    // the target store's entry holds this session's ids of [0, lastPushed): a push sends only its range's
	gen        uint64
	target     *kvcv1.SetSnapshotTargetCommand
	hints      hints // the agent's pin and priority (SetSessionHintsCommand, hints.go)
	lastPushed int64
	retagFrom  uint64 // ≠ 0: [0, lastPushed) is the target store's snapshot of this generation (a reseed's valid base): the next push re-tags it
	failedLen  int64  // committed length whose push failed (retried once); wait for a newer commit
	queued     bool
	push       *pushRun
	gone       bool
	lastCommit time.Time // when the worker last committed it (its idle time starts here)
	loadedAt   time.Time // when a LoadSessionCommand last ended with it loaded here (load.go); its idle time starts here too
	forcePush  bool      // push even below delta: the capacity release or the idle flush waits for a current snapshot
	commits    uint64    // commits seen: an idle-flush timer fires only for the newest (idle.go)
	idle       idleTimer // the idle-flush timer armed by the last commit
	releasing  bool      // a capacity release command is out for it
	// inUseAt: when the worker last refused a capacity release of it (a request uses it: a
	// turn waiting in the worker's prealloc queue or running); zero when never. Until its next
	// commit (or releaseInUseRetry) it is neither released again nor reported evictable.
	inUseAt time.Time
}

type pushRun struct {
	cancel   context.CancelCauseFunc
	readDone chan struct{} // closed when no transfer of the push touches the pages any more
}

type recvRoom struct {
	req     *kvcv1.PrepareReceiveRequest
	created time.Time
	done    chan struct{}
	res     *kvcv1.TransferDoneRequest
}

// DefaultDeltaTokens is the push threshold without a policy's snapshot_delta_tokens: 64 tokens,
// so that every turn's commit (an agent's turn adds its append and its answer, hundreds of
// tokens) is pushed at once and the snapshot is current while the session thinks. At 1024 (the
// default until issue 20's recovery work, p42) a session's last turns stayed unpushed until the
// idle flush, and a decode worker's death in that window left each lost session a tail of up
// to 1023 committed tokens that its reseed re-prefilled on the new decode worker after the
// snapshot's transfer (0.1 model-s of its TTFT at 1,849 uncached tokens), and left the capacity
// release's victims behind too, so a reseed's pages waited for their pushes. The bytes pushed
// are the same (pushes are incremental); only their number grows, to one per turn.
const DefaultDeltaTokens = 64

// New builds the sidecar; the event log may be nil.
func New(cfg Config, eng rdma.Engine, ev *sidecar.EventLog, log zerolog.Logger) *Sidecar {
	if cfg.DeltaTokens <= 0 {
		cfg.DeltaTokens = DefaultDeltaTokens
	}
	if cfg.PushWorkers <= 0 {
		cfg.PushWorkers = 2
	}
	if cfg.PushTimeout <= 0 {
		cfg.PushTimeout = 120 * time.Second
	}
	if cfg.RoomTimeout <= 0 {
		cfg.RoomTimeout = 120 * time.Second
	}
	s := &Sidecar{cfg: cfg, log: log, ev: ev, eng: eng, segs: kvxfer.NewSegments(eng), peers: kvxfer.NewPeers(cfg.PeerDial...), rep: nopReporter{},
		sessions: map[string]*session{}, targets: map[string]*kvcv1.SetSnapshotTargetCommand{}, hints: map[string]hints{},
		rooms: map[int64]*recvRoom{}, dropped: map[string]struct{}{}, delta: cfg.DeltaTokens, enabled: true, wake: make(chan struct{}, 1)}
	s.att = sidecar.NewAttach(s.attachState, log.With().Str("part", "attach").Logger())
	s.rel = newReleaser(cfg.Release)
	s.relKick = make(chan struct{}, 1)
	s.after = realAfterFunc
	s.loadIDs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_sidecar_load_token_ids_total",
		Help: "LoadSessionCommands by their token ids: ids (the prefill store's, sent to the worker as input_ids), none (the snapshot has none, or the peer holds no such snapshot or predates the call: loaded without), error (the peer could not be asked: loaded without), invalid (the peer's answer did not fit the load: failed)."},
		[]string{"source"})
	return s
}

func (s *Sidecar) attachState() (bool, int32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pool != nil, int32(len(s.sessions))
}

// SetReporter sets where session events go.
func (s *Sidecar) SetReporter(r Reporter) { s.rep = r }

// Registered is closed once the worker registered its KV pool (and, after this sidecar
// restarted under a live worker, re-committed its sessions: sidecar.Attach).
func (s *Sidecar) Registered() <-chan struct{} { return s.att.Registered() }

// WaitingFor says what the sidecar waits for before it is ready ("" when ready).
func (s *Sidecar) WaitingFor() string { return s.att.WaitingFor() }

// Instance is this sidecar process's random attach id.
func (s *Sidecar) Instance() string { return s.att.Instance() }

// WatchCommands is the worker's standing command stream (sidecar.Attach).
func (s *Sidecar) WatchCommands(req *kvcv1.WatchCommandsRequest, stream grpc.ServerStreamingServer[kvcv1.WatchCommandsResponse]) error {
	return s.att.Watch(req, stream)
}

// AckCommand is the worker's result of a command (or its acknowledgement of the attach status).
func (s *Sidecar) AckCommand(_ context.Context, req *kvcv1.AckCommandRequest) (*kvcv1.AckCommandResponse, error) {
	return s.att.Ack(req)
}

// Close releases the pool mapping and peer connections (after Run returned).
func (s *Sidecar) Close() {
	s.peers.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pool != nil {
		s.pool.Close()
	}
}

// Run runs the push workers and the room janitor until ctx is done; in-flight pushes are
// aborted (and their transfers settled) before it returns.
func (s *Sidecar) Run(ctx context.Context) error {
	defer s.att.Close() // the worker's command stream must not hold up the bridge's graceful stop
	var wg sync.WaitGroup
	for i := 0; i < s.cfg.PushWorkers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				id, ok := s.next(ctx)
				if !ok {
					return
				}
				s.pushSession(ctx, id)
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.runRelease(ctx)
	}()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return nil
		case now := <-t.C:
			s.expireRooms(now)
		}
	}
}

func (s *Sidecar) next(ctx context.Context) (string, bool) {
	for {
		s.mu.Lock()
		if len(s.queue) > 0 {
			id := s.queue[0]
			s.queue = s.queue[1:]
			if len(s.queue) > 0 {
				select {
				case s.wake <- struct{}{}:
				default:
				}
			}
			s.mu.Unlock()
			return id, true
		}
		s.mu.Unlock()
		select {
		case <-ctx.Done():
			return "", false
		case <-s.wake:
		}
	}
}

// maybeEnqueueLocked queues a push of ss when its unpushed tail reached delta (or at once when
// the store's entry waits for its re-tag: until then the control plane sees a snapshot of the
// older generation, which it does not reseed from; the re-tagging append is only the tail). It
// reports whether a push (queued or about to be re-queued) will carry the current commit.
func (s *Sidecar) maybeEnqueueLocked(ss *session) bool {
	if ss.gone || ss.target == nil || !s.enabled || (ss.committed-ss.lastPushed < s.delta && !ss.forcePush && ss.retagFrom == 0) || ss.committed <= ss.lastPushed || ss.committed == ss.failedLen {
		return false
	}
	if ss.queued || ss.push != nil { // the queued push reads the newest commit; a running one re-queues
		return true
	}
	ss.queued = true
	s.queue = append(s.queue, ss.id)
	select {
	case s.wake <- struct{}{}:
	default:
	}
	s.ev.Emit(sidecar.Event{Event: sidecar.EvPushEnqueued, Session: ss.id, Generation: ss.target.GetGeneration(), BaseLen: ss.lastPushed,
		Tokens: ss.committed - ss.lastPushed, Peer: ss.target.GetPrefillWorkerId()})
	return true
}

func (s *Sidecar) expireRooms(now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, r := range s.rooms {
		if now.Sub(r.created) > s.cfg.RoomTimeout {
			if r.res == nil {
				r.res = &kvcv1.TransferDoneRequest{Room: id, Error: "timeout: no TransferDone from the prefill side"}
				close(r.done)
			}
			delete(s.rooms, id)
		}
	}
}

// ---- WorkerBridge ----

// RegisterKVPool maps the worker's pool and registers it with the engine.
func (s *Sidecar) RegisterKVPool(_ context.Context, req *kvcv1.RegisterKVPoolRequest) (*kvcv1.RegisterKVPoolResponse, error) {
	p, err := kvxfer.OpenWorkerPool(req, s.eng) // shared memory, or GPU memory by CUDA IPC (--transport cuda)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	old := s.pool
	if err := kvxfer.CheckTPUnchanged(old, p); err != nil {
		s.mu.Unlock()
		p.Close()
		return nil, err
	}
	var lost []*session
	if old != nil {
		// The worker restarted: everything it held is gone. Stop every push and fail every
		// room before the old mapping goes away.
		for _, ss := range s.sessions {
			lost = append(lost, ss)
		}
	}
	s.mu.Unlock()
	for _, ss := range lost {
		if dropped, _, ok := s.drop(ss.id); ok {
			s.ev.Emit(sidecar.Event{Event: sidecar.EvSessionRelease, Session: dropped.id, Generation: dropped.gen, Seqlen: dropped.committed, Reason: "worker re-registered its pool"})
			s.rep.Report(&kvcv1.SessionEvent{SessionId: dropped.id, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED,
				KvLen: dropped.committed, Generation: dropped.gen, Detail: "worker restarted"})
		}
	}
	s.mu.Lock()
	for id, r := range s.rooms {
		if r.res == nil {
			r.res = &kvcv1.TransferDoneRequest{Room: id, Error: "the worker re-registered its KV pool"}
			close(r.done)
		}
		delete(s.rooms, id)
	}
	s.pool = p
	s.mu.Unlock()
	if old != nil {
		old.Close() // unregistering waits for in-flight engine requests on the old pool
		s.log.Warn().Int("sessions_dropped", len(lost)).Msg("worker re-registered its KV pool")
	}
	s.att.PoolRegistered()
	s.log.Info().Int32("page_size", p.PageSize).Int64("item_len", p.ItemLen).Int64("pages", p.PageCount).Int32("layers", p.NumLayers).
		Str("layout", p.LayoutName()).Str("tp", p.TPString()).Ints64("aux_item_lens", p.AuxItemLens).Msg("worker KV pool registered")
	return &kvcv1.RegisterKVPoolResponse{KvBytesPerToken: p.BytesPerToken(), TransferEndpoint: s.eng.SegmentName()}, nil
}

func (s *Sidecar) registeredPool() (*kvxfer.Pool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pool == nil {
		return nil, status.Error(codes.FailedPrecondition, "no KV pool registered")
	}
	return s.pool, nil
}

// CommitSession records a committed step: pages cover [0, committed_len).
func (s *Sidecar) CommitSession(_ context.Context, req *kvcv1.CommitSessionRequest) (*kvcv1.CommitSessionResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	pool, err := s.registeredPool()
	if err != nil {
		return nil, err
	}
	n := req.GetCommittedLen()
	if n <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "committed_len %d must be positive", n)
	}
	if want := (n + int64(pool.PageSize) - 1) / int64(pool.PageSize); int64(len(req.GetPages())) != want {
		return nil, status.Errorf(codes.InvalidArgument, "%d pages for %d tokens; want %d", len(req.GetPages()), n, want)
	}
	if err := pool.CheckPages(req.GetPages()); err != nil {
		return nil, err
	}
	if err := kvcv1.ValidateTokenIDs("token_ids", req.GetTokenIds(), n); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	var ids []int32 // nil: a commit without ids leaves the session's range without them
	if len(req.GetTokenIds()) > 0 {
		ids = append(ids, req.GetTokenIds()...)
	}
	s.mu.Lock()
	ss, ok := s.sessions[req.GetSessionId()]
	if ok && n < ss.committed {
		s.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "committed_len of %s shrinks from %d to %d", ss.id, ss.committed, n)
	}
	if !ok {
		delete(s.dropped, req.GetSessionId())
		ss = &session{id: req.GetSessionId()}
		s.sessions[ss.id] = ss
	}
	ss.committed = n
	if t := s.targets[ss.id]; t != nil && !ok { // a target that came before the first commit
		delete(s.targets, ss.id)
		ss.target, ss.gen = t, t.GetGeneration()
		ss.validBaseLocked(t)
	}
	if h, pending := s.hints[ss.id]; pending && !ok { // hints that came before the first commit
		delete(s.hints, ss.id)
		ss.hints = h
	}
	ss.pages = append(ss.pages[:0:0], req.GetPages()...)
	ss.ids = ids
	ss.lastCommit = time.Now()
	enq := s.maybeEnqueueLocked(ss)
	s.armIdleLocked(ss)
	gen := ss.gen
	s.kickIfShortLocked() // its turn ended: while requests wait for pages it may go now
	s.mu.Unlock()
	s.rep.Report(&kvcv1.SessionEvent{SessionId: req.GetSessionId(), Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: n, Generation: gen})
	return &kvcv1.CommitSessionResponse{PushEnqueued: enq}, nil
}

// ReleaseSession forgets a session; it returns only after an in-flight push of the session has
// been aborted and no longer reads its pages.
func (s *Sidecar) ReleaseSession(_ context.Context, req *kvcv1.ReleaseSessionRequest) (*kvcv1.ReleaseSessionResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	ss, aborted, ok := s.drop(req.GetSessionId())
	if !ok {
		s.mu.Lock()
		_, wasDropped := s.dropped[req.GetSessionId()]
		delete(s.dropped, req.GetSessionId())
		s.mu.Unlock()
		if wasDropped {
			return &kvcv1.ReleaseSessionResponse{}, nil
		}
		return nil, status.Errorf(codes.NotFound, "session %s unknown", req.GetSessionId())
	}
	if ss.releasing { // the worker carries out this sidecar's capacity release
		s.mu.Lock()
		s.demand.released += ss.committed // free once the worker's next report comes
		s.mu.Unlock()
		s.reportCapacityRelease(ss)
		return &kvcv1.ReleaseSessionResponse{PushAborted: aborted}, nil
	}
	kind, reason := kvcv1.SessionEventKind_SESSION_EVENT_KIND_RELEASED, "released"
	if req.GetReason() == kvcv1.ReleaseReason_RELEASE_REASON_EVICTED {
		kind, reason = kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED, "evicted"
	}
	s.ev.Emit(sidecar.Event{Event: sidecar.EvSessionRelease, Session: ss.id, Generation: ss.gen, Seqlen: ss.committed, Reason: reason})
	s.rep.Report(&kvcv1.SessionEvent{SessionId: ss.id, Kind: kind, KvLen: ss.committed, Generation: ss.gen, Detail: reason})
	return &kvcv1.ReleaseSessionResponse{PushAborted: aborted}, nil
}

// drop removes a session, aborting and waiting out its push.
func (s *Sidecar) drop(id string) (*session, bool, bool) {
	s.mu.Lock()
	delete(s.targets, id)
	delete(s.hints, id)
	ss, ok := s.sessions[id]
	if !ok {
		s.mu.Unlock()
		return nil, false, false
	}
	ss.gone = true
	s.stopIdleLocked(ss)
	delete(s.sessions, id)
	run := ss.push
	s.mu.Unlock()
	if run == nil {
		return ss, false, true
	}
	run.cancel(errReleased)
	<-run.readDone
	return ss, true, true
}

// PrepareReceive registers the worker's pages for a room and offers them to the sending
// prefill sidecar.
func (s *Sidecar) PrepareReceive(ctx context.Context, req *kvcv1.PrepareReceiveRequest) (*kvcv1.PrepareReceiveResponse, error) {
	pool, err := s.registeredPool()
	if err != nil {
		return nil, err
	}
	switch {
	case req.GetRoom() == 0:
		return nil, status.Error(codes.InvalidArgument, "room is required")
	case req.GetTokens() <= 0:
		return nil, status.Errorf(codes.InvalidArgument, "tokens %d must be positive", req.GetTokens())
	case req.GetKind() != kvcv1.TransferKind_TRANSFER_KIND_SEED && req.GetKind() != kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT:
		return nil, status.Errorf(codes.InvalidArgument, "unknown transfer kind %v", req.GetKind())
	case req.GetSourcePeerAddr() == "":
		return nil, status.Error(codes.InvalidArgument, "source_peer_addr is required")
	}
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if want := (req.GetTokens() + int64(pool.PageSize) - 1) / int64(pool.PageSize); int64(len(req.GetPages())) != want {
		return nil, status.Errorf(codes.InvalidArgument, "%d pages for %d tokens; want %d", len(req.GetPages()), req.GetTokens(), want)
	}
	if err := pool.CheckPages(req.GetPages()); err != nil {
		return nil, err
	}
	r := &recvRoom{req: req, created: time.Now(), done: make(chan struct{})}
	s.mu.Lock()
	if _, dup := s.rooms[req.GetRoom()]; dup {
		s.mu.Unlock()
		return nil, status.Errorf(codes.AlreadyExists, "room %d is already prepared", req.GetRoom())
	}
	s.rooms[req.GetRoom()] = r
	s.mu.Unlock()
	c, err := s.peers.Client(req.GetSourcePeerAddr())
	if err == nil {
		octx, cancel := context.WithTimeout(kvxfer.WithTP(ctx, pool), 10*time.Second)
		_, err = c.OfferReceive(octx, &kvcv1.OfferReceiveRequest{Room: req.GetRoom(), SessionId: req.GetSessionId(), Kind: req.GetKind(),
			DecodeWorkerId: s.cfg.WorkerID, DecodeTransferEndpoint: s.eng.SegmentName(), DecodeLayout: pool.Layout(),
			Pages: req.GetPages(), Tokens: req.GetTokens(), DecodePeerAddr: s.cfg.PeerAddr})
		cancel()
	}
	if err != nil {
		s.mu.Lock()
		delete(s.rooms, req.GetRoom())
		s.mu.Unlock()
		// A refusal (bad layout, unequal tensor parallelism, ...) keeps its code and message.
		if st, ok := status.FromError(err); ok && (st.Code() == codes.FailedPrecondition || st.Code() == codes.InvalidArgument) {
			return nil, status.Errorf(st.Code(), "prefill sidecar %s refused the offer: %s", req.GetSourcePeerAddr(), st.Message())
		}
		return nil, status.Errorf(codes.Unavailable, "offer to prefill sidecar %s: %v", req.GetSourcePeerAddr(), err)
	}
	return &kvcv1.PrepareReceiveResponse{}, nil
}

// WaitReceive blocks until the room's transfer is done or failed (or timeout_ms passes).
func (s *Sidecar) WaitReceive(ctx context.Context, req *kvcv1.WaitReceiveRequest) (*kvcv1.WaitReceiveResponse, error) {
	s.mu.Lock()
	r, ok := s.rooms[req.GetRoom()]
	s.mu.Unlock()
	if !ok {
		return nil, status.Errorf(codes.NotFound, "room %d unknown (never prepared, or already waited for)", req.GetRoom())
	}
	wait := time.Duration(req.GetTimeoutMs()) * time.Millisecond
	if wait <= 0 {
		wait = s.cfg.RoomTimeout
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-r.done:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	case <-t.C:
		return nil, status.Errorf(codes.DeadlineExceeded, "room %d not done within %v", req.GetRoom(), wait)
	}
	s.mu.Lock()
	if s.rooms[req.GetRoom()] == r {
		delete(s.rooms, req.GetRoom())
	}
	s.mu.Unlock()
	resp := &kvcv1.WaitReceiveResponse{Ok: r.res.GetOk(), Bytes: r.res.GetBytes(), Tokens: r.res.GetTokens(), Error: r.res.GetError(),
		DurationUs: time.Since(r.created).Microseconds()}
	if resp.Ok {
		resp.Aux = r.res.GetAux() // the sender's aux rows arrive with success, never after it
	}
	return resp, nil
}

// SendKV is a prefill-side call.
func (s *Sidecar) SendKV(context.Context, *kvcv1.SendKVRequest) (*kvcv1.SendKVResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "SendKV is a prefill-worker call; this is a decode sidecar")
}

// SnapshotStatus reports what this sidecar pushed of a session.
func (s *Sidecar) SnapshotStatus(_ context.Context, req *kvcv1.SnapshotStatusRequest) (*kvcv1.SnapshotStatusResponse, error) {
	if err := kvcv1.ValidateID("session_id", req.GetSessionId()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	ss, ok := s.sessions[req.GetSessionId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "session %s unknown", req.GetSessionId())
	}
	return &kvcv1.SnapshotStatusResponse{Exists: ss.lastPushed > 0, Seqlen: ss.lastPushed, Generation: ss.gen,
		PrefillWorker: ss.target.GetPrefillWorkerId(), LastPushedLen: ss.lastPushed}, nil
}

// ---- peer service ----

// waitingRoomsLocked counts the rooms waiting for their transfer (the load report's
// transfer_queue_depth).
func (s *Sidecar) waitingRoomsLocked() (n int32) {
	for _, r := range s.rooms {
		if r.res == nil {
			n++
		}
	}
	return n
}

// TransferDone completes a room.
func (s *Sidecar) TransferDone(_ context.Context, req *kvcv1.TransferDoneRequest) (*kvcv1.TransferDoneResponse, error) {
	s.mu.Lock()
	r, ok := s.rooms[req.GetRoom()]
	if !ok || r.res != nil {
		s.mu.Unlock()
		return nil, status.Errorf(codes.NotFound, "room %d unknown or already done", req.GetRoom())
	}
	if len(req.GetAux()) > 0 && r.req.GetKind() == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
		req.Ok, req.Error, req.Aux = false, "aux rows on a snapshot transfer (snapshots carry none)", nil
	} else if err := s.pool.CheckAux(req.GetAux()); err != nil && req.GetOk() {
		// The receiving worker could not place them in its metadata rows: fail the room.
		req.Ok, req.Error, req.Aux = false, "aux rows refused by the receiver: "+status.Convert(err).Message(), nil
	}
	r.res = req
	close(r.done)
	idle := s.waitingRoomsLocked() == 0
	s.mu.Unlock()
	if idle {
		// The load report's transfer_queue_depth is back to 0: the control plane's local
		// large append waits for an empty queue (policy.localAppend), so it hears it now,
		// not up to a heartbeat later.
		s.rep.KickLoad()
	}
	kind := "seed"
	if r.req.GetKind() == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
		kind = "snapshot"
	}
	e := sidecar.Event{Event: sidecar.EvTransferDone, Kind: kind, Session: r.req.GetSessionId(), Room: req.GetRoom(), Tokens: req.GetTokens(),
		Bytes: req.GetBytes(), DurationMs: sidecar.Ms(time.Since(r.created)), Reason: req.GetError()}
	ev := &kvcv1.SessionEvent{SessionId: r.req.GetSessionId(), Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_DONE,
		KvLen: req.GetTokens(), Bytes: req.GetBytes(), Room: req.GetRoom(), Detail: kind}
	if !req.GetOk() {
		e.Event = sidecar.EvTransferFailed
		ev.Kind = kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_FAILED
		ev.Detail = kind + ": " + req.GetError()
	}
	s.ev.Emit(e)
	s.rep.Report(ev)
	return &kvcv1.TransferDoneResponse{}, nil
}

// OfferReceive goes to prefill sidecars.
func (s *Sidecar) OfferReceive(context.Context, *kvcv1.OfferReceiveRequest) (*kvcv1.OfferReceiveResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "OfferReceive goes to a prefill sidecar; this is a decode sidecar")
}

// ---- HTTP ----

// SessionInfo is one line of GET /v1/sessions.
type SessionInfo struct {
	SessionID     string `json:"session_id"`
	CommittedLen  int64  `json:"committed_len"`
	Generation    uint64 `json:"generation"`
	PrefillWorker string `json:"prefill_worker,omitempty"`
	LastPushedLen int64  `json:"last_pushed_len"`
	Pushing       bool   `json:"pushing"`
}

// Sessions lists the sessions the worker holds (the residency truth).
func (s *Sidecar) Sessions() []SessionInfo {
	s.mu.Lock()
	out := make([]SessionInfo, 0, len(s.sessions))
	for _, ss := range s.sessions {
		out = append(out, SessionInfo{SessionID: ss.id, CommittedLen: ss.committed, Generation: ss.gen,
			PrefillWorker: ss.target.GetPrefillWorkerId(), LastPushedLen: ss.lastPushed, Pushing: ss.push != nil})
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].SessionID < out[j].SessionID })
	return out
}

// Status is GET /v1/status: attach state, pool shape (layout, tensor parallelism, aux rows).
func (s *Sidecar) Status() sidecar.Status {
	s.mu.Lock()
	p := s.pool
	s.mu.Unlock()
	return s.att.Status(s.cfg.WorkerID, p)
}

// Mount adds GET /v1/sessions, GET /v1/credits and GET /v1/status.
func (s *Sidecar) Mount(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.Status())
	})
	mux.HandleFunc("GET /v1/sessions", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.Sessions())
	})
	mux.HandleFunc("GET /v1/credits", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.Credits())
	})
}

// CreditInfo is the store credit this sidecar holds at one snapshot store (GET /v1/credits).
type CreditInfo struct {
	// Peer is the store's TransferPeerService address (the snapshot target's peer_addr).
	Peer     string `json:"peer"`
	Endpoint string `json:"endpoint"`
	ID       uint64 `json:"credit_id"`
	Pages    int    `json:"pages"`
	AgeMs    int64  `json:"age_ms"`
	InUse    bool   `json:"in_use"`
}

// Credits lists the store credits held, by store peer address.
func (s *Sidecar) Credits() []CreditInfo {
	now := time.Now()
	s.credits.mu.Lock()
	out := make([]CreditInfo, 0, len(s.credits.m))
	for addr, c := range s.credits.m {
		out = append(out, CreditInfo{Peer: addr, Endpoint: c.endpoint, ID: c.id, Pages: len(c.pages),
			AgeMs: now.Sub(c.granted).Milliseconds(), InUse: c.busy})
	}
	s.credits.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Peer < out[j].Peer })
	return out
}
