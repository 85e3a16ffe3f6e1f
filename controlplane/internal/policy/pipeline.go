package policy

import (
	"sync"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Query is one validated routing request.
type Query struct {
	SessionID string
	// Turn is the client's turn number; 0 when it gave none (Decide infers it, InferTurn).
	Turn            int32
	InputTokens     int64
	MaxOutputTokens int64
	MultiturnHint   bool
	// EndSession: the client ended the session (no worker is called; see endSession).
	EndSession bool
	// LowPriority: the agent's low-priority hint (pin.go): its prefills are hinted low.
	LowPriority bool
}

// Reserved is what the control plane itself has committed on one worker and not yet seen an
// outcome for.
type Reserved struct {
	Tokens int64 // decode: KV tokens reserved by decisions in flight
	// Settling (decode): tokens that successful outcomes added and the worker's last load report
	// does not show yet. They are idle sessions' KV, which the worker may evict: headroom scores
	// count them (new sessions do not pile onto a worker that only looks empty), the capacity
	// rule does not (fits).
	Settling int64
	// Transfers (decode): seeds and reseeds in flight, until their outcome — the queue score's
	// and the backpressure's count of the work a transfer brings (its turn decodes there).
	Transfers int32
	// Landed (decode): of Transfers, those whose KV has landed on the worker (its decode
	// sidecar's TRANSFER_DONE) and that only decode now: no transfer into the worker is
	// running while Transfers − Landed is 0 (the local large append's rule).
	Landed int32
	// StoreTransfers (decode): reseeds from a prefill store in flight (RESEED_SNAPSHOT) whose KV
	// has not landed yet, the transfers max_concurrent_transfers bounds: they start when
	// decided and end when the KV lands (TRANSFER_DONE). A transfer P computes
	// (SEED, RESEED_PREFILL) starts only once P prefilled; it holds no slot while it waits for P.
	StoreTransfers int32
	Seeds          int32 // decode: seeds in flight
	Prefills       int32 // prefill: decisions that make the worker prefill, in flight
	Plain          int32 // decode: plain P/D requests (PD_FALLBACK) in flight here, as a P/D router counts them
	// NewSession (decode): the part of Tokens reserved by decisions that open a new session
	// here (Decision.NewSession), bounded by Knobs.NewSessionShare (newsession.go).
	NewSession int64
}

// Ledger is the reservation view Decide reads (the router's ledger, read under its lock).
type Ledger interface {
	Reserved(workerID string) Reserved
	// TransferPending reports a seed or reseed of the session still in flight.
	TransferPending(sessionID string) bool
}

// Input is everything a decision depends on.
type Input struct {
	Knobs   *Knobs
	Query   Query
	Session *kvcv1.SessionRecord // nil for a session never seen
	Workers []*kvcv1.Worker
	Ledger  Ledger
	NowMs   int64
	// NoSnapshot forces snapshots to count as missing (the holder could not be commanded).
	NoSnapshot bool
	// Unavailable: the control plane cannot vouch for its state (not leading); plain P/D.
	Unavailable bool
	// Content: the prompt's and the session's page hashes (content.go); nil: lengths alone.
	Content *Content
	// Exclude lists worker ids the decision must not use (a gateway's retry after a worker's
	// death): they are treated as unroutable, and a session resident on an excluded decode
	// worker as having lost it (D_UNREACHABLE).
	Exclude []string
	// Resyncing: a new leader still waits for decode workers loaded from etcd to report what
	// they hold (state.Resyncing); a session it holds no residency for may be resident on one
	// of them, so it is not seeded or reseeded yet (a plain fallback, D_UNREACHABLE).
	Resyncing bool
	// GenerationTerm is the leader's generation term (generation.go): the generations this
	// decision predicts (Execution.StoreGeneration) are the ones the outcome will make. 0 when
	// not leading.
	GenerationTerm uint64
}

// Decision is the policy's answer. Worker pointers point into Input.Workers.
type Decision struct {
	Mode   kvcv1.RouteMode
	Reason kvcv1.RouteReason
	// Cause says why a session lost its residency (D_DRAINING, D_UNREACHABLE, SESSION_EVICTED)
	// or MIGRATED_AFTER_REJECTS; UNSPECIFIED when it did not. For logs and metrics.
	Cause   kvcv1.RouteReason
	Prefill *kvcv1.Worker
	Decode  *kvcv1.Worker
	// ReservedTokens on Decode until the outcome (or the reservation timeout).
	ReservedTokens int64
	// LocalAppendTokens: the uncached append a LOCAL_LARGE_APPEND's decode worker prefills.
	LocalAppendTokens int64
	Transfer          bool // takes one of Decode's transfer slots
	Seed              bool // counts toward Decode's in-flight seeds
	UsesPrefill       bool // Prefill computes (counts toward its in-flight prefills)
	CachedTokens      int64
	// TruncateTo: D keeps only this many tokens of the session before its append-prefill
	// (PREFIX_TRUNCATED); 0 = none.
	TruncateTo int64
	// LocalPrefill: D prefills a new session's first turn itself (LOCAL_FIRST_TURN), or, on a
	// PD_FALLBACK without a prefill worker, the whole request without keeping anything.
	LocalPrefill bool
	// PrefillPriority: PrefillPriorityLow for sessions predicted to go direct-to-D next.
	PrefillPriority    int32
	PauseMs            int64
	SnapshotSeqlen     int64
	SnapshotGeneration uint64
	// LocalReject names the decode worker the control plane refused for lack of capacity; the
	// router counts it as a rejection of this session by that worker. No plan is refused for
	// capacity any more (Admission), so nothing sets it today; the router still honours it.
	LocalReject string
	// Admission says whether the plan's decode worker admits it now by the control plane's
	// count (AdmitFits) or the plan was sent there anyway, to wait in the worker's prealloc queue
	// (issue 20 item 1: no plan is downgraded to a costlier one for capacity or budget).
	Admission Admission
	// KeepsResidency: a PD_FALLBACK of a KV-centric session that records residency on its D
	// (a seed the capacity or the seed limit refused): the KV it computes and moves stays there,
	// so the next turn is direct (execution: keep and open the session).
	KeepsResidency bool
	// WastedKV: a plain PD_FALLBACK (nothing kept) of a session that had a usable snapshot or a
	// resident copy (the router's kvc_router_wasted_kv_fallbacks_total).
	WastedKV bool
	// From is the decode worker the session was (or last was) resident on, for reseeds.
	From string
	// Turn is the session's turn as the control plane counts it (InferTurn).
	Turn int32
	// ReceiveFrom: a large append's decode worker keeps the session's KV [0, ReceiveFrom) and
	// receives only the pages past it (Execution.ReceiveFrom).
	ReceiveFrom int64
	// Exec is how the gateway carries the decision out (execution.go).
	Exec Execution
	// LoadSkippedBusy: P's store holds a usable prefix of the prompt, but its holder's queue
	// costs more than the load would spare (fromsnap.go, holderPays): the plan re-prefills the
	// whole context on its less loaded prefill worker (kvc_router_prefill_load_skipped_busy_total).
	LoadSkippedBusy bool
	// NewSession: the decision opens a session with no residency history on Decode (a seed, a
	// first turn prefilled on D, the fallback keeping a refused seed's KV); its ReservedTokens
	// count toward Reserved.NewSession (newsession.go).
	NewSession bool
	// Refused: a new session that no routable decode worker admits within the new-session
	// bound (newsession.go); nothing is routed or reserved, the router refuses the query
	// (RESOURCE_EXHAUSTED, NO_D_CAPACITY).
	Refused bool
}

// Gate is a named yes/no check on the request; the first gate of a profile that blocks makes
// the decision PD_FALLBACK with the gate's reason.
type Gate struct {
	Name   string
	Reason kvcv1.RouteReason
	Blocks func(c *Cycle) bool
}

// Filter is a named predicate over decode candidates.
type Filter struct {
	Name string
	// Reason reported when this filter is the deepest one any candidate reached before the set
	// went empty.
	Reason func(c *Cycle) kvcv1.RouteReason
	Keep   func(c *Cycle, w *Cand) bool
}

// Scorer gives a candidate a score in [0, 1] (clamped), weighted.
type Scorer struct {
	Name   string
	Weight float64
	Score  func(c *Cycle, w *Cand) float64
}

// Profile is one decode selection: filters then scorers, highest total wins.
type Profile struct {
	Name    string
	Filters []Filter
	Scorers []Scorer
}

// Cand is a decode candidate with its reservations.
type Cand struct {
	W   *kvcv1.Worker
	Res Reserved
}

// Cycle is the state of one decision.
type Cycle struct {
	In *Input
	K  *Knobs
	Q  *Query
	S  *kvcv1.SessionRecord
	// Need is the KV tokens the chosen decode worker must hold for this request.
	Need int64
	// Cause of lost residency (see Decision.Cause).
	Cause kvcv1.RouteReason
	// Current is the decode worker the session is resident on (migration), if any.
	Current string
	// Turn is the session's turn (InferTurn of the client's turn and the record).
	Turn int32

	cand, best Cand // scratch of pick
	// The tensor-parallel sizes of the prefill workers (tp.go), computed at the first pick.
	pSizes []int32
	pDone  bool
	// unpaired: pick takes decode workers no prefill worker can be paired with (tp.go).
	unpaired bool
	// used: a decision ran on c since it was made or released (DecideInto resets it then).
	used bool
}

// Decide is the routing policy. It is pure: the same Input gives the same Decision, execution
// plan included.
func Decide(in *Input) Decision {
	var d Decision
	c := cyclePool.Get().(*Cycle)
	DecideInto(&d, c, in)
	c.Release()
	cyclePool.Put(c)
	return d
}

// DecideInto is Decide into d on c, a Cycle the caller keeps for its decisions (the router's
// pooled query context holds one: no pool trip per decision, no copy of the Decision). c is
// reset first; it refers to in and its records afterwards, until c.Release.
func DecideInto(d *Decision, c *Cycle, in *Input) {
	if c.used { // else c is new or released: zero but for its scratch
		c.Release()
	}
	c.In, c.K, c.Q, c.S, c.Turn, c.used = in, in.Knobs, &in.Query, in.Session, InferTurn(in.Query.Turn, in.Session), true
	if in.Unavailable {
		c.Turn = in.Query.Turn // no session state to count from
	}
	if in.Query.EndSession {
		*d = c.endSession()
		return
	}
	c.decide(d)
	d.Turn = c.Turn
	if in.Query.LowPriority && d.UsesPrefill {
		d.PrefillPriority = PrefillPriorityLow // the agent said so: P's cache evicts it first
	}
	d.Exec = execution(d, in.Unavailable)
	seedThroughStore(d, in)
	c.fromSnapshot(d)
}

// Release drops c's references (input, records, workers) and keeps its scratch for reuse; the
// next DecideInto on c has nothing to reset.
func (c *Cycle) Release() {
	ps := c.pSizes[:0]
	*c = Cycle{pSizes: ps}
}

// cyclePool recycles the Cycle of a decision (one allocation per decision otherwise: the
// rules' funcs take it, so it escapes), with its scratch slices.
var cyclePool = sync.Pool{New: func() any { return new(Cycle) }}

// endSession: the client ended the session. Nothing is routed and nothing reserved; the plan
// closes the session on the decode worker it is resident on (known only while leading), whose
// sidecar then reports the release.
func (c *Cycle) endSession() Decision {
	d := Decision{Reason: kvcv1.RouteReason_ROUTE_REASON_SESSION_END, Turn: c.Turn}
	if !c.In.Unavailable && c.S != nil {
		d.From = c.S.DecodeWorker
	}
	d.Exec = Execution{CloseSessionOn: d.From}
	return d
}

// InferTurn is the session's turn: the client's when it gives one (> 0), else one more than
// the last turn the control plane saw for a known session, else 0.
func InferTurn(clientTurn int32, rec *kvcv1.SessionRecord) int32 {
	if clientTurn > 0 {
		return clientTurn
	}
	if rec != nil && rec.LastSeenUnixMs > 0 && rec.Turn < 1<<30 {
		return rec.Turn + 1
	}
	return 0
}

// decide writes the decision into out (a resident direct turn built there: residentTo).
func (c *Cycle) decide(out *Decision) {
	in := c.In
	if in.Unavailable {
		*out = c.fallback(kvcv1.RouteReason_ROUTE_REASON_CONTROL_PLANE_UNAVAILABLE)
		return
	}
	if !c.K.KVCentricEnabled {
		*out = c.fallback(kvcv1.RouteReason_ROUTE_REASON_KV_CENTRIC_DISABLED)
		return
	}
	rec := c.S
	if rec != nil && rec.DecodeWorker != "" {
		d := c.findDecode(rec.DecodeWorker)
		switch {
		case d == nil || d.State == kvcv1.WorkerState_WORKER_STATE_UNREACHABLE || d.State == kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN ||
			c.excluded(d.WorkerId):
			// WORKER_DOWN: the sidecar is up but its worker process died, and the session's KV
			// with it. Excluded: a gateway saw it refuse or drop a connection just now.
			*out = c.lost(kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE, rec.DecodeWorker)
			return
		case isDraining(d):
			// A drain moves the session only to a D that admits it now (DrainProfile); the
			// draining worker still serves it meanwhile, so it is not queued elsewhere.
			c.Cause = kvcv1.RouteReason_ROUTE_REASON_D_DRAINING
			dec, _ := c.reseed(0, rec.DecodeWorker, DrainProfile, false)
			if dec.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || dec.Reason == kvcv1.RouteReason_ROUTE_REASON_SESSION_NOT_RESIDENT {
				*out = dec
				return
			}
			if !servesResident(d) {
				*out = c.lost(kvcv1.RouteReason_ROUTE_REASON_D_DRAINING, rec.DecodeWorker)
				return
			}
			// Nowhere to move it: a draining worker still serves the sessions it holds. A direct
			// turn says why it was not moved (D_DRAINING); a large append keeps its reason.
			c.Cause = kvcv1.RouteReason_ROUTE_REASON_D_DRAINING
			dec = c.resident(d)
			if dec.Mode == kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D && dec.Reason != kvcv1.RouteReason_ROUTE_REASON_LOCAL_LARGE_APPEND {
				dec.Reason = kvcv1.RouteReason_ROUTE_REASON_D_DRAINING
			}
			*out = dec
			return
		}
		c.residentTo(out, d)
		return
	}
	if in.Resyncing {
		// Not resident as far as this new leader knows, but a decode worker that has not
		// reported yet may hold it (an acknowledged residency etcd did not get): placing it
		// elsewhere now would forget that residency. Served without session effects meanwhile.
		*out = c.fallback(kvcv1.RouteReason_ROUTE_REASON_D_UNREACHABLE)
		return
	}
	if rec != nil && (rec.Generation > 0 || rec.PreviousDecodeWorker != "") {
		*out = c.lost(kvcv1.RouteReason_ROUTE_REASON_SESSION_EVICTED, rec.PreviousDecodeWorker)
		return
	}
	*out = c.seed()
}

// residentTo is resident(d) into out, a direct turn (the common decision) built in place
// instead of returned by value and copied.
func (c *Cycle) residentTo(out *Decision, d *kvcv1.Worker) {
	if c.S.DRejects[d.WorkerId] >= c.K.MigrationRejectThreshold || c.In.Content.known() ||
		c.Q.InputTokens-min(c.S.KvCommittedLen, c.Q.InputTokens) > c.K.DirectMaxUncachedTokens {
		*out = c.resident(d) // a migration, content or a large append
		return
	}
	c.direct(out, d)
}

// direct is resident's direct turn on d, into out.
func (c *Cycle) direct(out *Decision, d *kvcv1.Worker) {
	cached := min(c.S.KvCommittedLen, c.Q.InputTokens)
	c.Need = c.Q.InputTokens - cached + c.Q.MaxOutputTokens
	cand := Cand{W: d, Res: c.In.Ledger.Reserved(d.WorkerId)}
	// Never downgraded for capacity: the turn needs only its new pages on its own D, which
	// queues it (prealloc) until they free, as every P/D router's request waits there; a
	// whole-context PD_FALLBACK would need more pages on some D and a prefill on P.
	*out = Decision{
		Mode:           kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
		Reason:         kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT,
		Cause:          c.Cause,
		Decode:         d,
		ReservedTokens: c.Need,
		CachedTokens:   cached,
		PauseMs:        c.pause(&cand),
		From:           d.WorkerId,
	}
	if !fits(c, &cand) {
		out.Admission = AdmitOverCapacity
		out.Reason = kvcv1.RouteReason_ROUTE_REASON_D_QUEUED
	}
}

// resident: the session lives on d, a routable decode worker.
func (c *Cycle) resident(d *kvcv1.Worker) Decision {
	// An agent's pin (pin.go) keeps the session where it is: no migration while it holds.
	if c.S.DRejects[d.WorkerId] >= c.K.MigrationRejectThreshold && !isDraining(d) && !Pinned(c.S, c.In.NowMs) {
		c.Current = d.WorkerId
		if dec, ok := c.reseed(kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS, d.WorkerId, MigrateProfile, true); ok {
			return dec
		}
		// Nowhere to migrate: serve it in place if d admits it.
	}
	if c.In.Content.known() {
		// On content: the resident KV is reused only when it is a prefix of the prompt.
		if pages, whole := c.residentPrefix(); !whole {
			return c.prefixMismatch(d, pages)
		}
	}
	committed := c.S.KvCommittedLen
	cached := min(committed, c.Q.InputTokens)
	uncached := c.Q.InputTokens - cached
	if uncached > c.K.DirectMaxUncachedTokens {
		if dec, ok := c.localAppend(d, uncached, cached); ok {
			return dec
		}
		return c.largeAppend(d, uncached, cached)
	}
	var dec Decision
	c.direct(&dec, d)
	return dec
}

// localAppend: a large append (over direct_max_uncached_tokens) that the session's own decode
// worker prefills itself, DIRECT_TO_D / LOCAL_LARGE_APPEND, when that is the cheapest way to
// serve it and its decode batch can absorb it: D holds the session's committed KV — at least as
// much of the prompt as P's snapshot (D pushes it) or P's radix (P computed only some turns) —
// and prefills on the same kind of GPU, so D computes no more than P would and needs no P queue,
// store load, bootstrap or transfer. The cost falls on D's decode batch instead: its prefill
// chunks hold the GPU alone, stalling every co-running decode by the whole prefill (SGLang's
// scheduler alternates prefill and decode batches; decodegpu.go in kvc-sim). A co-running
// request of g output tokens keeps its mean TPOT within the SLO while the stall is at most
// (g − 1) × (TPOT SLO − TPOT), which local_append_stall_tokens_per_output expresses in prefill
// tokens (decode-side prefill rate × that slack per output token). So it is taken when:
//   - the append is at most local_append_max_tokens;
//   - no seed or reseed transfer into D is in flight, by the ledger or D's last load report
//     (rooms waiting for their transfer): their first tokens would wait behind the prefill;
//   - every decision in flight on D that decodes there (max_output > 1) asked for enough output
//     tokens: uncached ≤ (max_output − 1) × local_append_stall_tokens_per_output
//     (decodeBatch; a ledger that cannot list them counts any reservation as a batch it cannot
//     bound).
//
// D need not admit it now: like a direct turn it then waits in D's prealloc queue
// (Admission AdmitOverCapacity), which still beats P — P's plan waits for the same pages on D
// before P computes (P waits for D's bootstrap), and computes at least as much. Otherwise
// false, and the large append goes to P (largeAppend).
func (c *Cycle) localAppend(d *kvcv1.Worker, uncached, cached int64) (Decision, bool) {
	res := c.In.Ledger.Reserved(d.WorkerId)
	if c.K.LocalAppendMaxTokens <= 0 || uncached > c.K.LocalAppendMaxTokens ||
		d.GetLoad().GetTransferQueueDepth() > 0 || res.Transfers > res.Landed || res.StoreTransfers > 0 {
		return Decision{}, false
	}
	if n, minOut := c.decodeBatch(d.WorkerId, res); n > 0 && uncached > (minOut-1)*c.K.LocalAppendStallTokensPerOutput {
		return Decision{}, false
	}
	c.Need = uncached + c.Q.MaxOutputTokens
	cand := Cand{W: d, Res: res}
	dec := Decision{
		Mode:              kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
		Reason:            kvcv1.RouteReason_ROUTE_REASON_LOCAL_LARGE_APPEND,
		Cause:             c.Cause,
		Decode:            d,
		ReservedTokens:    c.Need,
		LocalAppendTokens: uncached,
		CachedTokens:      cached,
		PauseMs:           c.pause(&cand),
		From:              d.WorkerId,
	}
	if !fits(c, &cand) {
		dec.Admission = AdmitOverCapacity
	}
	return dec, true
}

// WorkerFinder is the part of a Ledger that finds a worker of the decision's snapshot by id
// (FindWorker's answer), which it may cache per snapshot (the router's ledger does: a session's
// decode worker is looked up by its record's id, the same string decision after decision).
type WorkerFinder interface {
	FindWorker(ws []*kvcv1.Worker, id string, role kvcv1.WorkerRole) *kvcv1.Worker
}

// FindWorker returns the worker of ws with id and role (nil: none).
func FindWorker(ws []*kvcv1.Worker, id string, role kvcv1.WorkerRole) *kvcv1.Worker {
	return findWorker(ws, id, role)
}

// findDecode is the decode worker id of the decision's snapshot, through the ledger's
// WorkerFinder when it has one.
func (c *Cycle) findDecode(id string) *kvcv1.Worker {
	if f, ok := c.In.Ledger.(WorkerFinder); ok {
		return f.FindWorker(c.In.Workers, id, kvcv1.WorkerRole_WORKER_ROLE_DECODE)
	}
	return findWorker(c.In.Workers, id, kvcv1.WorkerRole_WORKER_ROLE_DECODE)
}

// DecodeBatcher is the part of a Ledger that lists a decode worker's batch: the decisions in
// flight there that decode (max_output > 1), how many and the smallest max_output among them.
type DecodeBatcher interface {
	DecodeBatch(workerID string) (requests int32, minOutput int64)
}

// decodeBatch is the ledger's DecodeBatch; a ledger without it reports any reservation on the
// worker as one request of one output token (a batch whose TPOT cannot take any stall).
func (c *Cycle) decodeBatch(workerID string, res Reserved) (int32, int64) {
	if b, ok := c.In.Ledger.(DecodeBatcher); ok {
		return b.DecodeBatch(workerID)
	}
	if res.Tokens > 0 {
		return 1, 1
	}
	return 0, 0
}

// largeAppend: the uncached append is too large for D's append-prefill, so P prefills the
// input (plain P/D, PD_FALLBACK; from the snapshot where P's store holds one, fromsnap.go) —
// into the session's own D, which keeps it: D keeps the held tokens of the prompt, [0, held),
// and receives only the pages past them (ReceiveFrom), and the gateway sends keep_session, so
// kv_committed_len catches up and the next turn goes direct-to-D again. held is the committed
// KV for an append, and the longest common prefix on content for an edited history (D cuts
// its session there itself). D needs and reserves what a direct turn would: append +
// max_output. It is never downgraded for capacity: a D that cannot admit it now queues it
// (Admission AdmitOverCapacity), and only D's own refusal after its wait is a rejection
// (enough of them migrate the session).
func (c *Cycle) largeAppend(d *kvcv1.Worker, uncached, held int64) Decision {
	c.Need = uncached + c.Q.MaxOutputTokens
	cand := Cand{W: d, Res: c.In.Ledger.Reserved(d.WorkerId)}
	adm := AdmitFits
	if !fits(c, &cand) {
		adm = AdmitOverCapacity
	}
	p := c.leastLoadedPrefill(TPSize(d))
	if p == nil {
		return c.fallback(kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER)
	}
	return Decision{
		Admission:       adm,
		Mode:            kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK,
		Reason:          kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND,
		Cause:           c.Cause,
		Prefill:         p,
		Decode:          d,
		ReservedTokens:  c.Need,
		UsesPrefill:     true,
		PrefillPriority: PrefillPriorityLow,
		PauseMs:         c.pause(&cand),
		From:            d.WorkerId,
		ReceiveFrom:     c.receiveFrom(held),
	}
}

// lost: the session had a decode worker and lost it.
func (c *Cycle) lost(cause kvcv1.RouteReason, from string) Decision {
	c.Cause = cause
	dec, _ := c.reseed(0, from, ReseedProfile, false)
	return dec
}

// reseed places a lost or migrating session on a new decode worker. With optional set, an
// empty candidate set returns ok=false instead of a fallback.
func (c *Cycle) reseed(reason kvcv1.RouteReason, from string, prof *Profile, optional bool) (Decision, bool) {
	if g := firstBlocking(c, ReseedGates); g != nil {
		if optional {
			return Decision{}, false
		}
		return c.fallback(g.Reason), true
	}
	c.Need = c.Q.InputTokens + c.Q.MaxOutputTokens
	d, why := c.pick(prof)
	if d == nil {
		if optional {
			return Decision{}, false
		}
		return c.fallback(why), true
	}
	snapP, snapReason, snapTokens := c.snapshot(TPSize(d.W))
	dec := Decision{
		Decode:         d.W,
		ReservedTokens: c.Need,
		Transfer:       true,
		Cause:          c.Cause,
		PauseMs:        c.pause(d),
		From:           from,
		Admission:      c.admission(d, snapP != nil),
	}
	if reason == 0 {
		reason = snapReason
	}
	dec.Reason = reason
	if snapP != nil {
		s := c.S.Snapshot
		dec.Mode = kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT
		dec.Prefill = snapP
		dec.CachedTokens = snapTokens
		dec.SnapshotSeqlen = snapTokens
		dec.SnapshotGeneration = s.Generation
		dec.PrefillPriority = PrefillPriorityNormal
		if c.Cause == 0 {
			dec.Cause = kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS
		}
		return dec, true
	}
	p := c.leastLoadedPrefill(TPSize(d.W))
	if p == nil {
		return c.fallback(kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER), true
	}
	dec.Mode = kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL
	dec.Prefill = p
	dec.UsesPrefill = true
	dec.PrefillPriority = PrefillPriorityLow
	if c.Cause == 0 {
		dec.Cause = kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS
	}
	return dec, true
}

// admission is how the chosen decode worker of a reseed admits it (its profile scores what a
// seed's filters refuse): a D that rejected the session since its last success, one that has
// no room for it now by the capacity rule, or one whose store-transfer slots are all taken (a
// reseed from the store only) — the plan still goes there and waits in its prealloc queue.
func (c *Cycle) admission(d *Cand, fromStore bool) Admission {
	switch {
	case !FilterNotRejecter.Keep(c, d):
		return AdmitRejecter
	case !fits(c, d):
		return AdmitOverCapacity
	case fromStore && !FilterTransferBudget.Keep(c, d):
		return AdmitOverBudget
	}
	return AdmitFits
}

// seed: a session with no residency history.
func (c *Cycle) seed() Decision {
	if g := firstBlocking(c, SeedGates); g != nil {
		return c.fallback(g.Reason)
	}
	c.Need = c.Q.InputTokens + c.Q.MaxOutputTokens
	prof := SeedProfile
	if c.In.Content.known() && len(c.In.Content.Overlap) > 0 {
		prof = SeedOnContentProfile
	}
	d, why := c.pick(prof)
	if d == nil {
		return c.fallback(why)
	}
	if dec, ok := c.placeOnContent(d); ok {
		return dec
	}
	reason := kvcv1.RouteReason_ROUTE_REASON_NEW_SESSION
	if c.overlapTokens(d.W.WorkerId) > 0 && ScoreOverlap.Score(c, d) > 0 {
		reason = kvcv1.RouteReason_ROUTE_REASON_PREFIX_OVERLAP
	}
	p := c.leastLoadedPrefill(TPSize(d.W))
	if p == nil {
		return c.fallback(kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER)
	}
	return Decision{
		Mode:            kvcv1.RouteMode_ROUTE_MODE_SEED,
		Reason:          reason,
		Prefill:         p,
		Decode:          d.W,
		ReservedTokens:  c.Need,
		Transfer:        true,
		Seed:            true,
		UsesPrefill:     true,
		PrefillPriority: PrefillPriorityLow,
		PauseMs:         c.pause(d),
		NewSession:      true,
	}
}

// fallback is plain P/D: least-loaded P, the routable D with most headroom, no reservation.
// Without any routable P the reason becomes NO_PREFILL_WORKER and D prefills the whole request
// itself (LocalPrefill: no transfer, no prefill worker, nothing kept — decode workers are
// colocated servers able to prefill; issue 16 finding 5: a transfer without a source cannot
// run). Without a D either, the gateway uses its own worker list.
//
// Prefill and decode pair only with equal tensor parallelism (tp.go): D is one a prefill worker
// can be paired with when there is one (else any), and P one of D's tp_size.
//
// A KV-centric session's fallback for a seed that capacity or the seed limit refused
// (keepsResidency) records residency on its D: it computes and moves the whole context there
// anyway, so D keeps it (execution: open and keep the session) and the next turn goes direct;
// it reserves what it needs there (input + max_output), so its pages are visible to the next
// decision. Every other fallback keeps nothing, and one of a session that had a usable
// snapshot or a resident copy is WastedKV.
func (c *Cycle) fallback(reason kvcv1.RouteReason) Decision {
	dec := Decision{Mode: kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, Reason: reason, Cause: c.Cause}
	keep := c.keepsResidency(reason)
	c.Need = 0
	// The baselines (KV-centric routing off) are routed as their own routers route (plainpd.go).
	plain := reason == kvcv1.RouteReason_ROUTE_REASON_KV_CENTRIC_DISABLED
	var d *Cand
	var why kvcv1.RouteReason
	if plain {
		if d = c.plainDecode(); d == nil {
			c.unpaired = true
			d = c.plainDecode()
			c.unpaired = false
		}
	} else {
		d, why = c.pick(FallbackProfile)
		if d == nil && why == kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER {
			// Only decode workers no prefill worker pairs with: one of them, prefilling itself.
			c.unpaired = true
			d, _ = c.pick(FallbackProfile)
			c.unpaired = false
		}
	}
	tp := int32(0)
	if d != nil {
		tp = TPSize(d.W)
	}
	if plain {
		dec.Prefill = c.plainPrefill(tp)
	} else {
		dec.Prefill = c.leastLoadedPrefill(tp)
	}
	if dec.Prefill == nil {
		dec.Reason = kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER
	} else {
		dec.UsesPrefill = true
	}
	if d != nil {
		dec.Decode = d.W
		dec.PauseMs = c.pause(d)
		dec.LocalPrefill = dec.Prefill == nil
	}
	switch {
	case keep && d != nil && dec.Prefill != nil:
		c.Need = c.Q.InputTokens + c.Q.MaxOutputTokens
		if !newSessionRoom(c, d) {
			// Past d's new-session bound: the best decode worker within its bound, else
			// refused (newsession.go).
			if d, _ = c.pick(keepFallbackProfile); d == nil {
				return c.refused()
			}
			if dec.Prefill = c.leastLoadedPrefill(TPSize(d.W)); dec.Prefill == nil {
				return c.refused()
			}
			dec.Decode, dec.PauseMs = d.W, c.pause(d)
		}
		dec.KeepsResidency, dec.ReservedTokens, dec.Transfer = true, c.Need, true
		dec.NewSession = true
		dec.PrefillPriority = PrefillPriorityLow // the next turn goes direct-to-D
		if !fits(c, d) {
			dec.Admission = AdmitOverCapacity
		}
	case !plain && reason != kvcv1.RouteReason_ROUTE_REASON_CONTROL_PLANE_UNAVAILABLE:
		tp := int32(1)
		if d != nil {
			tp = TPSize(d.W)
		}
		dec.WastedKV = c.residentCopy() || c.usableSnapshot(tp)
	}
	return dec
}

// keepsResidency: the fallback replaces a seed of a KV-centric session that the capacity
// filter, the transfer budget or seed_max_inflight_decode refused; its KV stays where it lands.
// The seed gates' own refusals (seed_min_turn, the size limits, single-turn) are the operator's
// choice not to keep the session and stay plain, as do the fallbacks of a session the control
// plane cannot place (pending transfer, resync, no prefill worker).
func (c *Cycle) keepsResidency(reason kvcv1.RouteReason) bool {
	if !c.K.KVCentricEnabled || c.In.Unavailable || c.In.Resyncing || c.S.GetDecodeWorker() != "" {
		return false
	}
	switch reason {
	case kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY, kvcv1.RouteReason_ROUTE_REASON_TRANSFER_BUDGET,
		kvcv1.RouteReason_ROUTE_REASON_SEED_FILTER_INFLIGHT:
		return !c.In.Ledger.TransferPending(c.Q.SessionID)
	}
	return false
}

// residentCopy: the session is resident on a decode worker that still serves it.
func (c *Cycle) residentCopy() bool {
	id := c.S.GetDecodeWorker()
	if id == "" {
		return false
	}
	d := c.findDecode(id)
	return d != nil && servesResident(d) && !c.excluded(id)
}

// usableSnapshot: the session has a snapshot a reseed onto a decode worker of tensor-parallel
// size tp could use.
func (c *Cycle) usableSnapshot(tp int32) bool {
	if c.S.GetSnapshot() == nil {
		return false
	}
	p, _, _ := c.snapshot(tp)
	return p != nil
}

// pick runs a profile over the decode workers. With no survivor it returns the reason of the
// deepest filter any candidate reached.
func (c *Cycle) pick(p *Profile) (*Cand, kvcv1.RouteReason) {
	bestScore := -1.0
	found := false
	deepest := -1
	unpairable := false
	cand := &c.cand // reused: no allocation per candidate
	for _, w := range c.In.Workers {
		if w.Role != kvcv1.WorkerRole_WORKER_ROLE_DECODE {
			continue
		}
		if !c.unpaired && !c.pairable(w) {
			unpairable = true // no prefill worker of its tensor-parallel size (tp.go)
			continue
		}
		*cand = Cand{W: w, Res: c.In.Ledger.Reserved(w.WorkerId)}
		failed := -1
		for i := range p.Filters {
			if !p.Filters[i].Keep(c, cand) {
				failed = i
				break
			}
		}
		if failed >= 0 {
			deepest = max(deepest, failed)
			continue
		}
		score := 0.0
		for i := range p.Scorers {
			s := p.Scorers[i].Score(c, cand)
			if s < 0 {
				s = 0
			} else if s > 1 {
				s = 1
			}
			score += s * p.Scorers[i].Weight
		}
		if !found || score > bestScore || (score == bestScore && w.WorkerId < c.best.W.WorkerId) {
			c.best, bestScore, found = *cand, score, true
		}
	}
	if found {
		return &c.best, 0 // valid until the next pick
	}
	if deepest < 0 && unpairable {
		return nil, kvcv1.RouteReason_ROUTE_REASON_NO_PREFILL_WORKER
	}
	if deepest < 0 {
		return nil, kvcv1.RouteReason_ROUTE_REASON_NO_D_CAPACITY
	}
	return nil, p.Filters[deepest].Reason(c)
}

// snapshot returns the prefill worker holding a usable snapshot and the tokens of it to reuse,
// or nil and the reason why not (SNAPSHOT_HIT when usable). On content, only the snapshot's
// prefix that is provably a prefix of the prompt is reused (PREFIX_MISMATCH when that is
// shorter than the whole snapshot, or nothing). Usable: it covers the input (on content its
// full pages) minus tail_tolerance_tokens; a longer one is reused up to the input.
//
// The holder must have the decode worker's tensor-parallel size tp (rank r reads rank r).
func (c *Cycle) snapshot(tp int32) (*kvcv1.Worker, kvcv1.RouteReason, int64) {
	if !c.K.SnapshotsEnabled {
		return nil, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOTS_DISABLED, 0
	}
	s := c.S.GetSnapshot()
	if c.In.NoSnapshot || s == nil || s.PrefillWorker == "" || s.Seqlen <= 0 {
		return nil, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING, 0
	}
	p := findWorker(c.In.Workers, s.PrefillWorker, kvcv1.WorkerRole_WORKER_ROLE_PREFILL)
	if p == nil || !servesSnapshots(p) || c.excluded(p.WorkerId) || TPSize(p) != tp {
		return nil, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_MISSING, 0
	}
	if m := c.K.SnapshotMaxStalenessMs; m > 0 && c.In.NowMs-s.UpdatedUnixMs > m {
		return nil, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE, 0
	}
	// Length only: a snapshot longer than the input (the new turn is shorter than the KV the
	// session had: a shrunken or edited context) is read as the direct path reads the resident
	// KV, cached up to the input (resident: min(kv_committed_len, input)); the decode worker
	// loads that many tokens and prefills nothing more (issue 14 item 8: half the stale reseeds
	// of the Mooncake replay were such turns). On content, only the proven common prefix.
	tokens, reason := min(s.Seqlen, c.Q.InputTokens), kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_HIT
	floor := c.Q.InputTokens // the snapshot must cover at least this minus tail_tolerance_tokens
	if c.In.Content.known() {
		t, ok := c.snapshotPrefix(s.Seqlen)
		if !ok {
			return nil, kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH, 0
		}
		if t < s.Seqlen/c.In.Content.PageSize*c.In.Content.PageSize {
			reason = kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH
		}
		tokens = t
		// content reuses whole pages only: the input's partial last page is not a shortfall
		floor = c.Q.InputTokens / c.In.Content.PageSize * c.In.Content.PageSize
	}
	if tokens < floor-c.K.TailToleranceTokens || tokens > c.Q.InputTokens || tokens <= 0 {
		if reason == kvcv1.RouteReason_ROUTE_REASON_PREFIX_MISMATCH {
			return nil, reason, 0
		}
		return nil, kvcv1.RouteReason_ROUTE_REASON_SNAPSHOT_STALE, 0
	}
	return p, reason, tokens
}

// leastLoadedPrefill: routable prefill worker with the fewest running+waiting requests plus
// the prefills the control plane has in flight on it; ties to the smallest id. With tp > 0,
// only one of that tensor-parallel size (the decode worker's: they pair rank r with rank r).
func (c *Cycle) leastLoadedPrefill(tp int32) *kvcv1.Worker {
	var best *kvcv1.Worker
	var bestLoad int64
	for _, w := range c.In.Workers {
		if w.Role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL || !routable(w) || c.excluded(w.WorkerId) || (tp > 0 && TPSize(w) != tp) {
			continue
		}
		load := c.prefillLoad(w)
		if best == nil || load < bestLoad || (load == bestLoad && w.WorkerId < best.WorkerId) {
			best, bestLoad = w, load
		}
	}
	return best
}

// prefillLoad is a prefill worker's queue as the control plane sees it: the requests its last
// load report counted running and waiting, plus the decisions in flight that make it prefill.
func (c *Cycle) prefillLoad(w *kvcv1.Worker) int64 {
	l := w.GetLoad()
	return int64(l.GetRunningRequests()) + int64(l.GetWaitingRequests()) + int64(c.In.Ledger.Reserved(w.WorkerId).Prefills)
}

// pause is the backpressure hint for the chosen decode worker.
func (c *Cycle) pause(d *Cand) int64 {
	l := d.W.GetLoad()
	tq := max(l.GetTransferQueueDepth(), d.Res.Transfers)
	if (c.K.BackpressureTransferQ > 0 && tq > c.K.BackpressureTransferQ) ||
		(c.K.BackpressurePreallocQ > 0 && l.GetPreallocQueueDepth() > c.K.BackpressurePreallocQ) {
		return c.K.BackpressurePauseMs
	}
	return 0
}

func firstBlocking(c *Cycle, gates []Gate) *Gate {
	for i := range gates {
		if gates[i].Blocks(c) {
			return &gates[i]
		}
	}
	return nil
}

func findWorker(ws []*kvcv1.Worker, id string, role kvcv1.WorkerRole) *kvcv1.Worker {
	if id == "" {
		for _, w := range ws {
			if w.WorkerId == "" && w.Role == role {
				return w
			}
		}
		return nil
	}
	last := id[len(id)-1]
	for _, w := range ws {
		// Ids of one cluster mostly differ in their last byte (d00…d31, decode-7): compared
		// first, it spares the byte compare of almost every other worker's id.
		if wid := w.WorkerId; len(wid) == len(id) && wid[len(wid)-1] == last && wid == id && w.Role == role {
			return w
		}
	}
	return nil
}

func isDraining(w *kvcv1.Worker) bool {
	return w.Draining || w.State == kvcv1.WorkerState_WORKER_STATE_DRAINING
}

// excluded reports a worker the query asked to avoid.
func (c *Cycle) excluded(id string) bool {
	for _, x := range c.In.Exclude {
		if x == id {
			return true
		}
	}
	return false
}

// servesResident: a draining decode worker whose sidecar and worker are up still serves the
// sessions it holds.
func servesResident(d *kvcv1.Worker) bool {
	return d.State == kvcv1.WorkerState_WORKER_STATE_READY || d.State == kvcv1.WorkerState_WORKER_STATE_DRAINING
}

// servesSnapshots: a prefill sidecar that can write a snapshot into a decode worker — its stream
// is up (READY, DRAINING, or WORKER_DOWN: the snapshot store is the sidecar's memory, not the
// dead worker's, and a reseed via snapshot needs no prefill compute).
func servesSnapshots(p *kvcv1.Worker) bool {
	switch p.State {
	case kvcv1.WorkerState_WORKER_STATE_READY, kvcv1.WorkerState_WORKER_STATE_DRAINING, kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN:
		return true
	}
	return false
}

// routable: connected, ready and not draining.
func routable(w *kvcv1.Worker) bool {
	return w.State == kvcv1.WorkerState_WORKER_STATE_READY && !w.Draining
}

// effectiveCapacity is kv_capacity_tokens × (1 − headroom).
func effectiveCapacity(c *Cycle, w *kvcv1.Worker) int64 {
	return int64(float64(w.KvCapacityTokens) * (1 - c.K.DCapacityHeadroom))
}

// fits is the one capacity rule of every plan: pinned (pinnedTokens, last load) + the
// decisions in flight there + the requesting session's own resident KV (ownTokens) + what the
// plan needs (Cycle.Need: a resident turn its uncached tokens + output, a reseed or seed the
// context + output) ≤ capacity × (1 − headroom). Idle resident sessions of others are the
// decode worker's cache: it evicts or releases them to admit new work, so they do not block
// admission, whether its last load report shows them yet or not (Reserved.Settling is not
// counted); they still lower the headroom score, so new sessions prefer emptier workers.
func fits(c *Cycle, d *Cand) bool {
	if d.W.KvCapacityTokens <= 0 {
		return false
	}
	return pinnedTokens(d.W)+d.Res.Tokens+c.ownTokens(d.W)+c.Need <= effectiveCapacity(c, d.W)
}

// ownTokens is the requesting session's own KV on w, which its turn pins: the part of its
// resident copy the turn reuses (min(kv_committed_len, input)); 0 on any other worker. Counted
// whether or not w's last load report includes it (it is idle, and evictable, between turns),
// so that a heartbeat cannot change the answer. A report that already counts it as pinned (a
// push in flight) counts it twice: an over-count of one session that affects only the
// admission label and scores, since no plan of a resident session is refused.
func (c *Cycle) ownTokens(w *kvcv1.Worker) int64 {
	if c.S == nil || c.S.DecodeWorker != w.WorkerId {
		return 0
	}
	return max(0, min(c.S.KvCommittedLen, c.Q.InputTokens))
}

// pinnedTokens is the part of a worker's used KV that it cannot evict: the larger of its
// sidecar's estimate (used − evictable: the sessions neither the worker's LRU nor the capacity
// release would take — pushing, agent-pinned, just committed, without a current snapshot) and
// the worker's own report (unevictable_tokens: the sessions its requests are using now, which
// the sidecar's estimate of an LRU worker counts as evictable). Each is a lower bound of what
// the pool cannot give; a worker that does not report sends 0, and the estimate alone counts.
func pinnedTokens(w *kvcv1.Worker) int64 {
	l := w.GetLoad()
	return max(0, l.GetUsedTokens()-max(0, l.GetEvictableTokens()), l.GetUnevictableTokens())
}
