package router

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// expiryTick is how often Run releases timed-out reservations.
const expiryTick = 250 * time.Millisecond

// Service implements kvcv1.RouterServiceServer.
type Service struct {
	kvcv1.UnimplementedRouterServiceServer

	c   Cluster
	log zerolog.Logger
	m   *metrics
	now func() time.Time // the clock; nil: time.Now (tests set it)

	prefix   string // decision ids are prefix + decimal sequence number
	roomBase uint64

	knobs atomic.Pointer[compiledPolicy]
	// newShare is the new-session bound (policy.Knobs.NewSessionShare), set before serving.
	newShare float64
	// rehomeFill is the share of a decode worker's capacity a re-home may fill (rehome.go).
	rehomeFill float64

	content *contentStore // the sessions' content addresses (content.go)

	mu  sync.Mutex
	led *ledger
	// spare and freed: reservations handed back by outcomes, for record (newReservation);
	// spare is guarded by mu, freed is pushed to without it.
	spare   *reservation
	freed   atomic.Pointer[reservation]
	late    lateBook             // expired reservations, for their late outcomes (late.go)
	nextSeq uint64               // last sequence number issued
	pins    map[string]pinEntry  // agent pins granted, by session (hints.go)
	rehomes map[string]*rehomeOp // re-homes in flight, by session (rehome.go)
	// nRehomes is len(rehomes), stored under mu whenever it changes: a turn looks for its
	// session's re-home (rehomeWait) without the lock while there is none.
	nRehomes atomic.Int64

	rqMu     sync.Mutex
	rq       rehomeQueue
	rehomeWG sync.WaitGroup // finishRehome goroutines
}

type compiledPolicy struct {
	src *kvcv1.Policy
	k   *policy.Knobs
}

var _ kvcv1.RouterServiceServer = (*Service)(nil)

// New returns the router over c. Metrics register on reg (nil: not registered). Call Run to
// expire reservations that never get an outcome.
func New(c Cluster, log zerolog.Logger, reg prometheus.Registerer) *Service {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		binary.LittleEndian.PutUint64(b[:8], uint64(time.Now().UnixNano()))
	}
	s := &Service{
		c:        c,
		log:      log.With().Str("part", "router").Logger(),
		prefix:   "d" + hex.EncodeToString(b[:4]) + "-",
		roomBase: binary.LittleEndian.Uint64(b[4:]) & maxRoom,
		led:      newLedger(),
		content:  newContentStore(),
		pins:     map[string]pinEntry{},
		rehomes:  map[string]*rehomeOp{},
		rq:       rehomeQueue{kick: make(chan struct{}, 1)},
		newShare: policy.DefaultNewSessionShare,

		rehomeFill: DefaultRehomeFill,
	}
	s.m = newMetrics(reg, s)
	return s
}

// SetNewSessionShare sets the share of a decode worker's kv_capacity_tokens that reservations
// of new sessions may take beyond its free room (policy/newsession.go; kvc-controlplane
// --new-session-share; 0: no bound). Call it before serving.
func (s *Service) SetNewSessionShare(share float64) {
	s.newShare = share
	s.knobs.Store(nil)
}

// SetRehomeFill sets the share of a decode worker's kv_capacity_tokens that a re-home may fill
// it to, idle sessions counted as used (rehome.go; kvc-controlplane --rehome-fill; 0: no
// re-homes). Call it before serving.
func (s *Service) SetRehomeFill(fill float64) { s.rehomeFill = fill }

// Register registers the service on a gRPC server.
func (s *Service) Register(r grpc.ServiceRegistrar) { kvcv1.RegisterRouterServiceServer(r, s) }

// Run releases reservations whose outcome did not come within reservation_timeout_ms and
// re-homes the sessions of decode workers that left READY (rehome.go), until ctx is done. It
// returns nil on cancellation.
func (s *Service) Run(ctx context.Context) error {
	t := time.NewTicker(expiryTick)
	defer t.Stop()
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		s.runRehome(rctx)
	}()
	defer func() {
		stop()
		wg.Wait()
		s.rehomeWG.Wait()
	}()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			s.expire(s.clock())
		}
	}
}

// OnLeadershipChange drops every reservation when this replica starts or stops leading: a
// reservation belongs to the term that made it (its streams are cancelled on step-down, and a
// new term starts from the sidecars' live load). Outcomes for dropped decisions get
// FAILED_PRECONDITION.
func (s *Service) OnLeadershipChange(leading bool) {
	s.mu.Lock()
	n := s.led.pending.len()
	s.led = newLedger()
	s.late.reset()
	clear(s.pins) // a new term counts pins again from its own grants (hints.go)
	ops := s.resetRehomesLocked()
	s.mu.Unlock()
	for _, op := range ops {
		close(op.done)
	}
	s.rqMu.Lock()
	s.rq.items = nil // a new term starts from what the sidecars report
	s.rqMu.Unlock()
	s.log.Info().Bool("leading", leading).Int("dropped_reservations", n).Msg("router ledger reset")
}

func (s *Service) expire(now time.Time) int {
	s.mu.Lock()
	rs := s.led.expired(now)
	for _, r := range rs {
		s.late.add(r)
	}
	s.mu.Unlock()
	for _, r := range rs {
		s.expiredRehome(r)
		s.log.Info().Str("decision_id", s.id(r.seq)).Str("session", r.session).Str("mode", ModeName(r.mode)).
			Str("decode", r.decode).Msg("reservation expired without an outcome")
	}
	s.m.expired.Add(float64(len(rs)))
	return len(rs)
}

// Route serves one gateway stream: every query gets a decision or a RouteError naming it,
// every outcome an OutcomeAck or a RouteError; bad messages never end the stream. The stream
// ends with UNAVAILABLE when its context does (the leadership gate cancels it when the term
// ends), even while the gateway sends nothing, so the gateway re-homes to the new leader.
//
// The decisions a stream got and has not reported are its own: when the client closes the
// stream (EOF) their reservations are released at once (it will report none of them: issue 23
// item 6, a stream closed after one query held its reservation for the 30 s timeout); when the
// stream breaks they are released after StreamEndGrace, within which an outcome the gateway
// sends on its next stream still applies.
func (s *Service) Route(stream grpc.BidiStreamingServer[kvcv1.RouteRequest, kvcv1.RouteResponse]) (err error) {
	ctx := stream.Context()
	mine := map[uint64]struct{}{}
	closed := false
	defer func() { s.streamEnded(mine, closed) }()
	type recvd struct {
		req *kvcv1.RouteRequest
		err error
	}
	// Unbuffered on purpose: while the handler is busy the receiving goroutine waits here with
	// its message, and the messages behind it gather in grpc-go's receive buffer without waking
	// anyone; the handler's take then readies the receiver, which finds the next message there
	// without waiting. With a buffer of 16 (the receiver going on to the next Recv, to be woken
	// by the next frame) the benchmark's stream lost 6-23 % of its decisions/s on the device
	// and its p99 rose (docs/routing.md §10).
	in := make(chan recvd)
	var sendMu sync.Mutex
	send := func(req *kvcv1.RouteRequest, resp *kvcv1.RouteResponse, m recyclable) error {
		sendMu.Lock() // mine is the stream's: tracked under the send lock (turns answered off the loop)
		s.track(mine, req, resp, m)
		err := stream.Send(resp)
		sendMu.Unlock()
		return err
	}
	var wg sync.WaitGroup // turns waiting for their session's re-home
	defer wg.Wait()
	// Cancelled before wg.Wait runs: a stream that ends stops its turns' waits.
	wctx, stopWaits := context.WithCancel(ctx)
	defer stopWaits()
	go func() { // ends when the handler returns (Recv fails then)
		for {
			req, err := stream.Recv()
			select {
			case in <- recvd{req, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	for {
		var r recvd
		select {
		case r = <-in:
		case <-ctx.Done():
			return status.Error(codes.Unavailable, "route stream ended (leadership ended or server stopping); reconnect to the leader")
		}
		if errors.Is(r.err, io.EOF) {
			closed = true
			return nil
		}
		if r.err != nil {
			return r.err
		}
		if q := r.req.GetQuery(); q != nil && s.rehomeWait(q.GetSessionId()) != nil {
			// The session is being re-homed (rehome.go): its turn waits for that, off this loop,
			// so the stream's other sessions are not held up.
			wg.Add(1)
			go func(req *kvcv1.RouteRequest) {
				defer wg.Done()
				s.waitRehome(wctx, q.GetSessionId())
				_ = send(req, s.Handle(req), nil) // a failed send ends the stream's Recv too
			}(r.req)
			continue
		}
		resp, m := s.handle(r.req, true)
		var err error
		if r.req.GetOutcome().GetNoAck() && resp.GetOutcomeAck() != nil {
			// Applied, and its sender reads no acknowledgement (the gateway): nothing to send.
			sendMu.Lock()
			s.track(mine, r.req, resp, m)
			sendMu.Unlock()
		} else {
			err = send(r.req, resp, m)
		}
		if m != nil {
			m.recycle() // sent: its memory serves the next answer
		}
		if err != nil {
			return err
		}
	}
}

// StreamEndGrace is how long the reservations of a broken Route stream are kept for an outcome
// on the gateway's next stream (it reconnects within its backoff ceiling).
const StreamEndGrace = 2 * time.Second

// track records the decisions a stream got (mine) and forgets those it reported; m is the
// answer's pooled block when it has one (its sequence number is known: no id to parse).
func (s *Service) track(mine map[uint64]struct{}, req *kvcv1.RouteRequest, resp *kvcv1.RouteResponse, m recyclable) {
	switch m := m.(type) {
	case *decisionMsg:
		mine[m.seq] = struct{}{}
		return
	case *ackMsg:
		delete(mine, m.seq)
		return
	}
	if d := resp.GetDecision(); d != nil {
		if seq, ok := s.parseID(d.GetDecisionId()); ok {
			mine[seq] = struct{}{}
		}
	}
	if o := req.GetOutcome(); o != nil {
		if seq, ok := s.parseID(o.GetDecisionId()); ok {
			delete(mine, seq)
		}
	}
}

// streamEnded releases the reservations of a stream's unreported decisions: at once when the
// client closed it, after StreamEndGrace when it broke.
func (s *Service) streamEnded(mine map[uint64]struct{}, closed bool) {
	if len(mine) == 0 {
		return
	}
	n := 0
	at := s.clock().Add(StreamEndGrace)
	s.mu.Lock()
	for seq := range mine {
		var ok bool
		if closed {
			_, ok = s.led.remove(seq)
		} else {
			ok = s.led.shorten(seq, at)
		}
		if ok {
			n++
		}
	}
	s.mu.Unlock()
	how := "broken"
	if closed {
		how = "closed"
	}
	s.m.streamEnd.WithLabelValues(how).Add(float64(n))
	if n > 0 {
		s.log.Info().Int("reservations", n).Str("how", how).Msg("route stream ended with decisions not reported")
	}
}

// Handle answers one message of the Route stream.
func (s *Service) Handle(req *kvcv1.RouteRequest) *kvcv1.RouteResponse {
	resp, _ := s.handle(req, false)
	return resp
}

// recyclable is an answer's memory that its sender may hand back once the answer is sent
// (decisionMsg, ackMsg); Handle's callers keep theirs.
type recyclable interface{ recycle() }

// handle is Handle; with pooled, the answer's memory comes from a pool and is returned for
// recycling (nil for an answer that cannot be: an error). Without pooled the answer is a new
// allocation (a pool that is never refilled costs more to ask than to allocate).
func (s *Service) handle(req *kvcv1.RouteRequest, pooled bool) (*kvcv1.RouteResponse, recyclable) {
	switch k := req.GetKind().(type) {
	case *kvcv1.RouteRequest_Query:
		if k.Query == nil {
			return s.errResp("", "", codes.InvalidArgument, "empty query"), nil
		}
		resp, m := s.query(k.Query, pooled)
		if m == nil {
			return resp, nil
		}
		return resp, m
	case *kvcv1.RouteRequest_Outcome:
		if k.Outcome == nil {
			return s.errResp("", "", codes.InvalidArgument, "empty outcome"), nil
		}
		resp, m := s.outcome(k.Outcome, pooled)
		if m == nil {
			return resp, nil
		}
		return resp, m
	default:
		return s.errResp("", "", codes.InvalidArgument, "request carries neither a query nor an outcome"), nil
	}
}

func (s *Service) errResp(requestID, decisionID string, code codes.Code, msg string) *kvcv1.RouteResponse {
	s.m.errors.WithLabelValues(code.String()).Inc()
	return &kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Error{Error: &kvcv1.RouteError{
		RequestId: requestID, DecisionId: decisionID, Code: int32(code), Message: msg,
	}}}
}

// policyKnobs compiles the cluster's policy when it changed (new pointer and new version).
func (s *Service) policyKnobs() *policy.Knobs {
	p := s.c.Policy()
	if cur := s.knobs.Load(); cur != nil &&
		(cur.src == p || (p != nil && p.Version != 0 && cur.src != nil && p.Version == cur.src.Version)) {
		return cur.k
	}
	k := policy.Compile(p)
	k.NewSessionShare = s.newShare
	s.knobs.Store(&compiledPolicy{src: p, k: k})
	return k
}

// id is decision seq's id: prefix + decimal sequence number (one allocation).
func (s *Service) id(seq uint64) string {
	var b [48]byte
	return string(strconv.AppendUint(append(b[:0], s.prefix...), seq, 10))
}

func (s *Service) parseID(id string) (uint64, bool) {
	rest, ok := strings.CutPrefix(id, s.prefix)
	if !ok || rest == "" {
		return 0, false
	}
	// strconv.ParseUint(rest, 10, 64) for the ids id builds, a third of its instructions: at
	// most 19 digits cannot overflow; more take the general path.
	if len(rest) > 19 {
		seq, err := strconv.ParseUint(rest, 10, 64)
		if err != nil || seq == 0 {
			return 0, false
		}
		return seq, true
	}
	var seq uint64
	for i := 0; i < len(rest); i++ {
		c := rest[i] - '0'
		if c > 9 {
			return 0, false
		}
		seq = seq*10 + uint64(c)
	}
	return seq, seq != 0 // 0 is no decision's
}

// maxRoom keeps bootstrap rooms exact in JSON (2^53): SGLang takes them from JSON bodies, and
// jq or JavaScript would round a 63-bit room.
const maxRoom = 1<<53 - 1

// room is the bootstrap room of decision seq: a random base per Service plus the sequence
// number, unique for 2^53 decisions and, across leaders, with overwhelming probability.
func (s *Service) room(seq uint64) int64 { return int64((s.roomBase+seq)&maxRoom) + 1 }

func validateQuery(q *kvcv1.RouteQuery) error {
	if len(q.RequestId) > kvcv1.MaxIDLen {
		return fmt.Errorf("request_id is %d bytes, longer than %d", len(q.RequestId), kvcv1.MaxIDLen)
	}
	if err := kvcv1.ValidateID("session_id", q.SessionId); err != nil {
		return err
	}
	if minIn := int64(1 - b2i(q.EndSession)); q.InputTokens < minIn || q.InputTokens > policy.MaxInputTokens {
		return fmt.Errorf("input_tokens %d out of range [%d, %d]", q.InputTokens, minIn, policy.MaxInputTokens)
	}
	if q.MaxOutputTokens < 0 || q.MaxOutputTokens > policy.MaxOutputTokens {
		return fmt.Errorf("max_output_tokens %d out of range [0, %d]", q.MaxOutputTokens, policy.MaxOutputTokens)
	}
	if q.Turn < 0 {
		return fmt.Errorf("turn %d is negative", q.Turn)
	}
	if len(q.ExcludeWorkers) > maxExclude {
		return fmt.Errorf("exclude_workers has %d entries, more than %d", len(q.ExcludeWorkers), maxExclude)
	}
	for i, id := range q.ExcludeWorkers {
		if err := kvcv1.ValidateID(fmt.Sprintf("exclude_workers[%d]", i), id); err != nil {
			return err
		}
	}
	if q.PageSize < 0 || q.PageSize > maxPageSize {
		return fmt.Errorf("page_size %d out of range [0, %d]", q.PageSize, maxPageSize)
	}
	if len(q.PromptPages) > 0 && q.PageSize == 0 {
		return errors.New("prompt_pages without a page_size")
	}
	if q.PageSize > 0 && int64(len(q.PromptPages)) > q.InputTokens/int64(q.PageSize) {
		return fmt.Errorf("%d prompt_pages for %d input tokens of pages of %d: more than the full pages", len(q.PromptPages), q.InputTokens, q.PageSize)
	}
	if len(q.PromptPages) > maxPromptPages {
		return fmt.Errorf("prompt_pages has %d entries, more than %d", len(q.PromptPages), maxPromptPages)
	}
	if q.PinMs < 0 || q.PinMs > policy.MaxPinMsLimit {
		return fmt.Errorf("pin_ms %d out of range [0, %d]", q.PinMs, policy.MaxPinMsLimit)
	}
	if q.PinMs > 0 && q.EndSession {
		return errors.New("pin_ms on a session end")
	}
	return nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// maxExclude bounds RouteQuery.exclude_workers (a retry excludes the one or two workers of the
// failed attempt).
const maxExclude = 16

const maxOutcomeUs = 24 * 3600 * 1_000_000

// enumSet is the values of a proto enum, for a check per outcome without a map lookup.
type enumSet []bool

func newEnumSet(names map[int32]string) enumSet {
	t := make(enumSet, enumLen(names))
	for v := range names {
		if v >= 0 {
			t[v] = true
		}
	}
	return t
}

// has reports whether v is one of the enum's values (none of ours is negative).
func (t enumSet) has(v int32) bool { return v >= 0 && int(v) < len(t) && t[v] }

var (
	knownErrorKinds = newEnumSet(kvcv1.RouteErrorKind_name)
	knownModes      = newEnumSet(kvcv1.RouteMode_name)
)

// validateOutcome checks o's fields; parsed: its decision id parsed as one of this leader's
// (its prefix and digits: printable ASCII without '/'), which ValidateID accepts when it is
// not too long (leading zeros can make it so), so it is not checked again.
func validateOutcome(o *kvcv1.RouteOutcome, parsed bool) error {
	if !parsed || len(o.DecisionId) > kvcv1.MaxIDLen {
		if err := kvcv1.ValidateID("decision_id", o.DecisionId); err != nil {
			return err
		}
	}
	if o.TtftUs < 0 || o.TtftUs > maxOutcomeUs {
		return fmt.Errorf("ttft_us %d out of range [0, %d]", o.TtftUs, int64(maxOutcomeUs))
	}
	if o.LatencyUs < 0 || o.LatencyUs > maxOutcomeUs {
		return fmt.Errorf("latency_us %d out of range [0, %d]", o.LatencyUs, int64(maxOutcomeUs))
	}
	if o.KvLenAfter < 0 || o.KvLenAfter > policy.MaxInputTokens+policy.MaxOutputTokens {
		return fmt.Errorf("kv_len_after %d out of range [0, %d]", o.KvLenAfter, policy.MaxInputTokens+policy.MaxOutputTokens)
	}
	if !knownErrorKinds.has(int32(o.ErrorKind)) {
		return fmt.Errorf("unknown error_kind %d", o.ErrorKind)
	}
	if !knownModes.has(int32(o.ExecutedMode)) {
		return fmt.Errorf("unknown executed_mode %d", o.ExecutedMode)
	}
	noErr := o.ErrorKind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_UNSPECIFIED || o.ErrorKind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE
	if o.Success && !noErr {
		return fmt.Errorf("success with error_kind %s", o.ErrorKind)
	}
	if !o.Success && noErr {
		return errors.New("a failed outcome needs an error_kind")
	}
	if len(o.KvPages) > maxPromptPages {
		return fmt.Errorf("kv_pages has %d entries, more than %d", len(o.KvPages), maxPromptPages)
	}
	if o.TruncatedTo < 0 || o.TruncatedTo > policy.MaxInputTokens {
		return fmt.Errorf("truncated_to %d out of range [0, %d]", o.TruncatedTo, policy.MaxInputTokens)
	}
	if len(o.Detail) > 4096 {
		return fmt.Errorf("detail is %d bytes, longer than 4096", len(o.Detail))
	}
	return nil
}

func ref(w *kvcv1.Worker) *kvcv1.WorkerRef {
	if w == nil {
		return nil
	}
	r := new(kvcv1.WorkerRef)
	fillRef(r, w)
	return r
}

// fillRef sets r (a zero WorkerRef) to w's addresses.
func fillRef(r *kvcv1.WorkerRef, w *kvcv1.Worker) {
	r.WorkerId, r.WorkerUrl, r.PeerAddr, r.TransferEndpoint = w.WorkerId, w.WorkerUrl, w.PeerAddr, w.TransferEndpoint
	if n := len(w.TpRanks); n > 0 {
		// A tensor-parallel group: every rank's addresses (rank r pairs with rank r).
		r.TpRanks = make([]*kvcv1.TPRank, n)
		for i, t := range w.TpRanks {
			r.TpRanks[i] = &kvcv1.TPRank{TpRank: t.GetTpRank(), WorkerId: t.GetWorkerId(), PeerAddr: t.GetPeerAddr(), TransferEndpoint: t.GetTransferEndpoint()}
		}
	}
}

func workerID(w *kvcv1.Worker) string {
	if w == nil {
		return ""
	}
	return w.WorkerId
}

// record assigns the decision its sequence number and takes its reservation; it returns the
// reservation and the account of its decode worker when it holds something there. Caller
// holds mu.
func (s *Service) record(in *policy.Input, d *policy.Decision, now time.Time) (*reservation, *workerAccount) {
	s.nextSeq++
	r := s.newReservation()
	out := r.out // its outcome's context, made once per pooled reservation (updateSession)
	*r = reservation{
		seq:      s.nextSeq,
		session:  in.Query.SessionID,
		mode:     d.Mode,
		reason:   d.Reason,
		decode:   workerID(d.Decode),
		prefill:  workerID(d.Prefill),
		from:     d.From,
		tokens:   d.ReservedTokens,
		transfer: d.Transfer,
		store:    d.Transfer && d.LoadsSnapshot(),
		seed:     d.Seed,
		prefills: d.UsesPrefill,
		plain:    d.PlainPD(),
		newSess:  d.NewSession,
		input:    in.Query.InputTokens,
		maxOut:   in.Query.MaxOutputTokens,
		snapGen:  d.SnapshotGeneration,
		snapLen:  d.SnapshotSeqlen,
		keep:     d.Exec.KeepSession,
		opens:    d.Exec.OpenSession,
		truncate: d.TruncateTo,
		storeGen: d.Exec.StoreGeneration,
		deadline: now.Add(in.Knobs.ReservationTimeout),
	}
	r.out = out
	if in.Session != nil {
		r.sessGen = in.Session.Generation
	}
	if g := d.Exec.StoreGeneration; g != 0 {
		if is, ok := s.c.(issuer); ok {
			is.IssueGeneration(g) // the prefill store may report this snapshot before the outcome
		}
	}
	if ct := in.Content; ct != nil && ct.PageSize > 0 {
		r.pageSize, r.prompt = ct.PageSize, ct.Prompt
	}
	return r, s.led.add(r)
}

// newReservation is a zero reservation (but for its outcome context) for record, from those
// outcomes handed back (freeReservation), else a new one. Caller holds mu.
//
// Outcomes hand theirs back without the lock, onto freed (a stack pushed by compare-and-swap);
// record takes the whole stack at once when its own list (spare, under mu) is empty. A sync.Pool
// did the same with a pin, a per-P lookup and an unpin each way, twice per query and outcome.
func (s *Service) newReservation() *reservation {
	if s.spare == nil {
		s.spare = s.freed.Swap(nil)
		if s.spare == nil {
			return new(reservation)
		}
	}
	r := s.spare
	s.spare, r.nextFree = r.nextFree, nil
	return r
}

// freeReservation hands r back for a later decision (an applied outcome's: removed from the
// ledger, never in the late book, nothing refers to it); one that expired, or whose stream
// ended, is left to the collector. r must be zero but for its outcome context.
func (s *Service) freeReservation(r *reservation) {
	for {
		top := s.freed.Load()
		r.nextFree = top
		if s.freed.CompareAndSwap(top, r) {
			return
		}
	}
}

// queryCtx is one query being decided (pooled: no allocation of its own per decision).
type queryCtx struct {
	s       *Service
	q       *kvcv1.RouteQuery
	in      policy.Input
	d       policy.Decision
	seq     uint64 // the decision's sequence number (its reservation's)
	decided bool
	ct      policy.Content
	entry   *contentEntry  // the session's content entry when the query carries hashes
	overlap map[string]int // a new session's prompt overlap per decode worker
	now     time.Time
	epoch   int64
	onRec   func(rec *kvcv1.SessionRecord) // x.onRecord, bound once per pooled queryCtx
	// lowChanged: the query's low-priority hint differs from the session's (hints.go).
	lowChanged bool
	// trace: the decision span's traceparent, for the commands sent for the decision (trace.go).
	trace string
	cyc   *policy.Cycle // the policy's (policy.DecideInto), made with x and kept across reuse
	// admitted: the decision's decode worker's admitted counter when it keeps the session and
	// holds a reservation there (its ledger account's); nil: looked up by name.
	admitted prometheus.Counter
	// ack: the acknowledgement block of the decision's outcome, in the answer's block (Handle:
	// decisionMsg.ack); nil for a Route stream's answer (recycled once sent).
	ack *ackMsg
}

// queryPool recycles queryCtx values (and their bound onRecord callback) across decisions;
// Cluster.UpdateSession calls fn synchronously and keeps no reference to it.
var queryPool = sync.Pool{New: func() any {
	x := new(queryCtx)
	x.onRec = x.onRecord
	x.cyc = new(policy.Cycle)
	return x
}}

// release resets x (dropping its references: records, workers, query) and hands it back to
// queryPool; x is zero afterwards but for its bound onRec and its Cycle (released: only its
// scratch), which the next query starts from.
func (x *queryCtx) release() {
	onRec, cyc := x.onRec, x.cyc
	cyc.Release()
	*x = queryCtx{}
	x.onRec, x.cyc = onRec, cyc
	queryPool.Put(x)
}

// decide runs the policy on rec (the live record; nil when not leading) and takes the
// reservation, under the ledger lock.
func (x *queryCtx) decide(rec *kvcv1.SessionRecord) {
	x.in.Session = rec
	if x.q.PageSize > 0 {
		view(x.entry, int64(x.q.PageSize), x.q.PromptPages, rec, &x.ct)
		x.ct.Overlap = x.overlap
		x.in.Content = &x.ct
	}
	x.s.mu.Lock()
	x.s.led.prune(x.in.Workers)
	x.in.Ledger = x.s.led
	policy.DecideInto(&x.d, x.cyc, &x.in)
	r, acct := x.s.record(&x.in, &x.d, x.now)
	r.pinMs, r.lowChanged = x.q.PinMs, x.lowChanged
	x.admitted = nil
	if x.d.Exec.KeepSession && acct != nil {
		// The decode worker's admitted counter, kept with its ledger account (counted by query
		// for the decision it answers).
		if acct.admitted == nil {
			acct.admitted = x.s.m.admittedOn(r.decode)
		}
		x.admitted = acct.admitted
	}
	r.trace = x.trace
	r.ack = x.ack
	x.seq = r.seq // r is the ledger's from here on (its outcome recycles it)
	x.s.mu.Unlock()
	x.decided = true
}

// onRecord is the UpdateSession callback: decide on the live record, then apply the
// decision's effects on it (turn, last seen, a local rejection) in the same step.
func (x *queryCtx) onRecord(rec *kvcv1.SessionRecord) {
	if x.entry == nil && x.q.PageSize > 0 && len(rec.ContentChain) > 0 {
		// A chain this leader does not hold in memory (a new leader): the record's, when it
		// describes the record's residency (contentrecord.go).
		if e := loadChain(rec); e != nil {
			x.s.content.store(x.q.SessionId, e, false)
			x.s.m.contentLoaded.Inc()
			x.entry, x.overlap = e, nil
		}
	}
	x.lowChanged = rec.LowPriority != x.q.LowPriority
	rec.LowPriority = x.q.LowPriority // the agent's hint, per turn (hints.go)
	x.decide(rec)
	nowMs := x.in.NowMs
	rec.Turn = max(rec.Turn, x.d.Turn)
	rec.LastSeenUnixMs = nowMs
	if rec.CreatedUnixMs == 0 {
		rec.CreatedUnixMs = nowMs
	}
	rec.Epoch = x.epoch
	if reject := x.d.LocalReject; reject != "" {
		if rec.DRejects == nil {
			rec.DRejects = make(map[string]int32, 1)
		}
		if rec.DRejects[reject] < 1<<30 {
			rec.DRejects[reject]++
		}
	}
}

// run decides: inside UpdateSession when leading (no record copy, no race with a concurrent
// decision of the same session), else without session state.
func (x *queryCtx) run() {
	x.decided = false
	if x.in.Query.EndSession {
		// Nothing to record on the session: decide on a copy (the sidecar's release event
		// changes the residency once the worker closed it).
		var rec *kvcv1.SessionRecord
		if !x.in.Unavailable {
			rec, _ = x.s.c.Session(x.q.SessionId)
		}
		x.decide(rec)
		return
	}
	if !x.in.Unavailable {
		x.s.c.UpdateSession(x.q.SessionId, x.onRec)
		if x.decided {
			return
		}
		x.in.Unavailable = true // the state refused the write: it is not leading after all
	}
	x.decide(nil)
}

// query decides q; the answer is in m (nil for a RouteError).
func (s *Service) query(q *kvcv1.RouteQuery, pooled bool) (_ *kvcv1.RouteResponse, m *decisionMsg) {
	start := time.Now()
	if err := validateQuery(q); err != nil {
		return s.errResp(q.RequestId, "", codes.InvalidArgument, err.Error()), nil
	}
	epoch := s.c.Epoch()
	now := start
	if s.now != nil {
		now = s.now()
	}
	span, tp := startDecision(q)
	x := queryPool.Get().(*queryCtx) // zero but for onRec and cyc (put back reset)
	defer x.release()
	x.s, x.q, x.now, x.epoch, x.trace = s, q, now, epoch, tp
	in := &x.in
	in.Knobs = s.policyKnobs()
	in.Query = policy.Query{SessionID: q.SessionId, Turn: q.Turn, InputTokens: q.InputTokens,
		MaxOutputTokens: q.MaxOutputTokens, MultiturnHint: q.MultiturnHint, EndSession: q.EndSession,
		LowPriority: q.LowPriority}
	in.Exclude = q.ExcludeWorkers
	in.Workers = s.c.Workers()
	in.NowMs = now.UnixMilli()
	in.Unavailable = epoch == 0
	in.Resyncing = epoch != 0 && s.resyncing()
	in.GenerationTerm = s.c.GenerationTerm()
	if q.PageSize > 0 && !x.in.Unavailable {
		x.entry = s.content.get(q.SessionId)
		if x.entry == nil && len(q.PromptPages) > 0 && !q.EndSession {
			// A session the leader knows no content of: where does its prompt's prefix live?
			x.overlap = map[string]int{}
			s.content.overlaps(q.PromptPages, x.overlap)
		}
	}
	if q.EndSession {
		s.content.forget(q.SessionId)
		s.mu.Lock()
		delete(s.pins, q.SessionId) // the session ends: its pin with it
		s.mu.Unlock()
	}
	if pooled {
		m = decisionPool.Get().(*decisionMsg) // the answer in one block
	} else {
		m = new(decisionMsg)
		x.ack = &m.ack // its outcome's acknowledgement too (decisionMsg.ack)
	}
	x.run()
	if x.d.Reason == kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT && !q.EndSession && s.rehomeWait(q.SessionId) != nil {
		// A re-home of the session started between Route's look and this decision (rehome.go):
		// wait for it instead of a plain fallback, then decide again.
		s.mu.Lock()
		s.led.remove(x.seq)
		s.mu.Unlock()
		s.waitRehome(context.Background(), q.SessionId)
		x.run()
	}
	if x.d.LoadsSnapshot() {
		if err := s.pushSnapshot(q.SessionId, &x.d, x.seq, tp); err != nil {
			// The holder cannot be commanded: decide again without the snapshot.
			s.log.Warn().Err(err).Str("session", q.SessionId).Str("prefill", workerID(x.d.Prefill)).
				Msg("push_snapshot not sent; reseeding by prefill")
			s.mu.Lock()
			s.led.remove(x.seq)
			s.mu.Unlock()
			x.in.NoSnapshot = true
			x.run()
		}
	}
	if x.d.Refused {
		if pooled {
			m.recycle() // never sent
		}
		return s.refuse(q, x, span), nil
	}
	d, seq, turn := &x.d, x.seq, x.d.Turn

	if d.LocalReject != "" {
		s.m.rejected.WithLabelValues(d.LocalReject, "local").Inc()
	}
	if d.Exec.KeepSession {
		if x.admitted != nil {
			x.admitted.Inc()
		} else {
			s.m.admit(d.Decode.WorkerId)
		}
	}
	s.m.decision(d.Mode, d.Reason)
	s.m.plan(d)
	s.m.admission(d)
	out := &m.dec
	m.dec = kvcv1.RouteDecision{
		RequestId:          q.RequestId,
		DecisionId:         m.setID(s.prefix, seq),
		Mode:               d.Mode,
		Reason:             d.Reason,
		Prefill:            m.ref(0, d.Prefill),
		Decode:             m.ref(1, d.Decode),
		ReservedTokens:     d.ReservedTokens,
		CachedTokens:       d.CachedTokens,
		PrefillPriority:    d.PrefillPriority,
		RecommendedPauseMs: d.PauseMs,
		SnapshotSeqlen:     d.SnapshotSeqlen,
		SnapshotGeneration: d.SnapshotGeneration,
		Epoch:              epoch,
		Turn:               turn,
		Execution:          &m.exec,
	}
	s.execution(&d.Exec, &m.exec)
	if d.Exec.Transfer != kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED {
		out.BootstrapRoom = s.room(seq) // the plan moves KV: the transfer's room
	}
	if out.Execution.StoreGeneration != 0 {
		out.Execution.StoreLoadRoom = s.room(seq + 1<<52) // D's load from P's store: a room of its own
	}
	if s.debugOn() {
		e := s.log.Debug()
		e.Str("decision_id", out.DecisionId).Str("session", q.SessionId).Str("mode", ModeName(d.Mode)).
			Str("reason", ReasonName(d.Reason)).Str("cause", ReasonName(d.Cause)).Str("prefill", workerID(d.Prefill)).
			Str("decode", workerID(d.Decode)).Int64("reserved", d.ReservedTokens).Msg("decision")
	}
	endDecision(span, q, out)
	s.m.latency.Observe(time.Since(start).Seconds())
	m.kind.Decision = out
	m.resp.Kind = &m.kind
	m.seq = seq
	return &m.resp, m
}

// decisionPool recycles decisionMsg blocks a Route stream has sent (recycle).
var decisionPool = sync.Pool{New: func() any { return new(decisionMsg) }}

// recycle hands m back once its answer is sent (nothing refers to it any more).
func (m *decisionMsg) recycle() {
	*m = decisionMsg{}
	decisionPool.Put(m)
}

// refuse answers a query the policy refused (a new session past every decode worker's
// new-session bound: policy/newsession.go): its empty reservation is dropped and the query
// gets RESOURCE_EXHAUSTED with the reason's name first, so that the gateway answers 503
// no_d_capacity instead of failing open onto a worker that would evict for it.
func (s *Service) refuse(q *kvcv1.RouteQuery, x *queryCtx, span trace.Span) *kvcv1.RouteResponse {
	s.mu.Lock()
	s.led.remove(x.seq)
	s.mu.Unlock()
	s.m.newRefused.Inc()
	endDecision(span, q, nil)
	s.log.Debug().Str("session", q.SessionId).Int64("tokens", q.InputTokens+q.MaxOutputTokens).Msg("new session refused: every decode worker at its new-session bound")
	return s.errResp(q.RequestId, "", codes.ResourceExhausted, fmt.Sprintf(
		"NO_D_CAPACITY: no decode worker has room for a new session of %d tokens without evicting past --new-session-share %.2f of its capacity; retry later",
		q.InputTokens+q.MaxOutputTokens, x.in.Knobs.NewSessionShare))
}

// decisionMsg is a decision's answer with the messages it points to, allocated together (one
// allocation per decision instead of seven: the decision id's bytes too). Never copied: its
// fields are pointed to. A block a Route stream sent is recycled (decisionPool), its id's
// bytes with it: nothing may keep the answer's strings past the send (endDecision copies the
// id into a recording span).
type decisionMsg struct {
	seq  uint64 // the decision's sequence number (its id's)
	resp kvcv1.RouteResponse
	kind kvcv1.RouteResponse_Decision
	dec  kvcv1.RouteDecision
	exec kvcv1.RouteExecution
	refs [2]kvcv1.WorkerRef
	id   [idCap]byte // the decision id's bytes (setID)
	// ack is the acknowledgement of the decision's outcome when the answer is Handle's (its
	// caller keeps the block, so the ack's memory stays the outcome's: one allocation for the
	// decision and its outcome); a Route stream's blocks are recycled and leave it unused.
	ack ackMsg
}

// idCap holds a decision id: the prefix ("d" + 8 hex digits + "-") and up to 20 digits.
const idCap = 32

// setID returns the decision id of seq (Service.id) with its bytes in m.id (a longer one, which
// Service's prefix never makes, gets its own allocation).
func (m *decisionMsg) setID(prefix string, seq uint64) string {
	b := appendDecimal(append(m.id[:0], prefix...), seq)
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// appendDecimal is strconv.AppendUint(b, v, 10): a digit per step from the end (a decision's
// sequence number has a few; strconv's general path cost twice as many instructions).
func appendDecimal(b []byte, v uint64) []byte {
	var tmp [20]byte
	i := len(tmp)
	for v >= 10 {
		q := v / 10
		i--
		tmp[i] = byte('0' + v - q*10)
		v = q
	}
	i--
	tmp[i] = byte('0' + v)
	return append(b, tmp[i:]...)
}

// ref is ref(w) in m.refs[i] (nil for no worker).
func (m *decisionMsg) ref(i int, w *kvcv1.Worker) *kvcv1.WorkerRef {
	if w == nil {
		return nil
	}
	r := &m.refs[i]
	fillRef(r, w)
	return r
}

// execution fills out with the proto form of the policy's execution plan.
func (s *Service) execution(e *policy.Execution, out *kvcv1.RouteExecution) {
	*out = kvcv1.RouteExecution{
		CallPrefill:      e.CallPrefill,
		CallDecode:       e.CallDecode,
		Transfer:         e.Transfer,
		KeepSession:      e.KeepSession,
		OpenSession:      e.OpenSession,
		OnDecodeRefused:  e.OnDecodeRefused,
		OnTransferFailed: e.OnTransferFailed,
		RetryAllowed:     e.RetryAllowed,
		TruncateTo:       e.TruncateTo,
		LocalPrefill:     e.LocalPrefill,
		StoreGeneration:  e.StoreGeneration,
		LoadPrefixTokens: e.LoadPrefixTokens,
		LoadGeneration:   e.LoadGeneration,
		ReceiveFrom:      e.ReceiveFrom,
	}
	if e.CloseSessionOn != "" {
		// The worker's address as the cluster knows it now; a worker no longer listed has
		// nothing to close.
		for _, w := range s.c.Workers() {
			if w.WorkerId == e.CloseSessionOn && w.Role == kvcv1.WorkerRole_WORKER_ROLE_DECODE {
				out.CloseSessionOn = []*kvcv1.WorkerRef{ref(w)}
				break
			}
		}
	}
}

func (s *Service) pushSnapshot(session string, d *policy.Decision, seq uint64, traceparent string) error {
	cmd := &kvcv1.Command{Action: &kvcv1.Command_PushSnapshot{PushSnapshot: &kvcv1.PushSnapshotCommand{
		SessionId:              session,
		Generation:             d.SnapshotGeneration,
		Seqlen:                 d.SnapshotSeqlen,
		DecodeWorkerId:         d.Decode.WorkerId,
		DecodePeerAddr:         d.Decode.PeerAddr,
		DecodeTransferEndpoint: d.Decode.TransferEndpoint,
		Room:                   s.room(seq),
		DecisionId:             s.id(seq),
	}}, Traceparent: traceparent}
	return s.send(d.Prefill.WorkerId, "push_snapshot", cmd)
}

func (s *Service) send(worker, kind string, cmd *kvcv1.Command) error {
	err := s.c.SendCommand(worker, cmd)
	s.m.command(kind, err == nil)
	return err
}

// debugOn reports whether s.log writes debug events (zerolog's check in Debug, without making
// the event: a call and a pool lookup per decision while debug is off).
func (s *Service) debugOn() bool {
	return s.log.GetLevel() <= zerolog.DebugLevel && zerolog.GlobalLevel() <= zerolog.DebugLevel
}

// clock is the service's time (s.now when a test set it, else time.Now).
func (s *Service) clock() time.Time {
	if s.now != nil {
		return s.now()
	}
	return time.Now()
}
