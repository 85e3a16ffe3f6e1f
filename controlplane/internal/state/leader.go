package state

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// ErrInvalidPolicy wraps the range errors of a rejected policy update.
var ErrInvalidPolicy = errors.New("invalid policy")

// ErrPolicyTooLarge means a policy update would make the stored policy exceed
// MaxPolicyOverrides per-worker entries or MaxPolicyBytes encoded: permanent until overrides
// are removed (a negative per-worker value removes one).
var ErrPolicyTooLarge = errors.New("policy too large")

// Bounds of the stored policy record, checked before it is written: the record is one etcd
// value that every replica and sidecar reads, far below etcd's 1.5 MiB request limit.
const (
	MaxPolicyOverrides = 1024
	MaxPolicyBytes     = 256 << 10
)

// Term is one period of leadership: the fence, the batcher writing under it, and the
// goroutines (batcher, sweeper) bound to it.
type Term struct {
	// lead is the leadership's own context (the election's term): every "may this replica
	// act as leader" check of the state reads lead.Err() (acting), which for the election's
	// term also checks the renew deadline on the monotonic clock.
	lead context.Context
	// ctx derives from lead: the term's goroutines (sweeper, journal flusher, drain movers)
	// stop when it ends. The batcher does not: it outlives the term's end so that EndTerm can
	// flush what is pending while the fence still holds.
	ctx     context.Context
	drainWG sync.WaitGroup // drain movers (drain.go)
	fence   kvstore.Fence
	batcher *kvstore.Batcher
	cancel  context.CancelFunc
	done    chan struct{} // batcher.Run returned
	deposed chan struct{} // closed when a write was fenced off
	sweeper chan struct{} // sweeper returned
	flusher chan struct{} // volatile flusher returned
}

// Fence returns the term's fencing token.
func (t *Term) Fence() kvstore.Fence { return t.fence }

// Deposed is closed when a write of this term was rejected by the fence: another replica
// leads; the caller must end the term.
func (t *Term) Deposed() <-chan struct{} { return t.deposed }

// acting reports whether the state may act as leader under t: t is the current term and its
// leadership context has not ended. The one leadership check of the state.
func (t *Term) acting() bool { return t != nil && t.lead.Err() == nil }

// Lead is LeadTerm under a leadership that ends only with EndTerm (tests, benchmarks).
func (s *State) Lead(ctx context.Context, fence kvstore.Fence) (*Term, error) {
	return s.LeadTerm(ctx, context.Background(), fence)
}

// LeadTerm loads every record from etcd, then starts a term under fence. Only after it returns
// does the replica serve as leader. ctx bounds the load only. lead is the leadership's context
// (the election's term, done at the renew deadline): once it is done the state refuses to act
// as leader (no session update, command, attach, drain or policy write; Epoch answers 0) and
// the term's goroutines stop; call EndTerm to flush and clear.
func (s *State) LeadTerm(ctx, lead context.Context, fence kvstore.Fence) (*Term, error) {
	start := time.Now()
	snap, err := s.cfg.Store.LoadAll(ctx)
	if err != nil {
		return nil, fmt.Errorf("state: load: %w", err)
	}
	if snap.Malformed > 0 {
		s.log.Warn().Int("records", snap.Malformed).Msg("skipped malformed records while loading etcd")
	}
	// A corrupt policy record is never read as "no policy" (the defaults): the last good version
	// this replica knows (a standby watches the record) stays; with none known it refuses to
	// lead (issue 23 item 6).
	keepPolicy := false
	if snap.PolicyErr != nil {
		if !s.policyKnown.Load() {
			s.m.policyCorrupt.WithLabelValues("refused_to_lead").Inc()
			s.log.Error().Err(snap.PolicyErr).Str("key", s.cfg.Store.PolicyKey()).
				Msg("refusing to lead: the stored policy is corrupt and this replica knows no earlier version (put a valid one with etcdctl, or delete the key to run on the defaults)")
			return nil, fmt.Errorf("state: load: %w", snap.PolicyErr)
		}
		keepPolicy = true
		s.PolicyCorrupt(snap.PolicyErr)
	}
	// This term's generation range, above every earlier term's (policy.NextGeneration): the
	// durable counter, and at least past the newest term among the generations just loaded.
	// A broken term (exhausted, or not a number) is not served on: this replica refuses to lead,
	// loudly, rather than number generations that wrap or pass 2^53 (issue 23 item 2).
	floor, newest := loadedGenerationTerm(snap)
	genTerm, err := s.cfg.Store.NextGenerationTerm(ctx, fence, floor, policy.MaxGenerationTerm)
	if err != nil {
		reason := ""
		switch {
		case errors.Is(err, kvstore.ErrGenerationTermExhausted):
			reason = "exhausted"
		case errors.Is(err, kvstore.ErrGenerationTermCorrupt):
			reason = "unreadable"
		}
		if reason != "" {
			s.m.termRefused.WithLabelValues(reason).Inc()
			s.log.Error().Err(err).Str("key", s.cfg.Store.GenerationTermKey()).Uint64("loaded_floor", floor).Str("newest_session", newest).
				Int64("epoch", fence.Rev).Msg("refusing to lead: the generation term is broken (fix the key, or the session record holding a generation past 2^53)")
		}
		return nil, fmt.Errorf("state: generation term: %w", err)
	}
	tctx, tcancel := context.WithCancel(lead)
	bctx, bcancel := context.WithCancel(context.Background())
	t := &Term{
		lead:    lead,
		ctx:     tctx,
		fence:   fence,
		batcher: kvstore.NewBatcher(s.cfg.Store, fence, kvstore.WithMaxDelay(s.cfg.FlushDelay)),
		cancel:  func() { tcancel(); bcancel() },
		done:    make(chan struct{}),
		deposed: make(chan struct{}),
		sweeper: make(chan struct{}),
		flusher: make(chan struct{}),
	}
	if !keepPolicy {
		s.SetStoredPolicy(snap.Policy)
	}

	now := time.Now().UnixMilli()
	s.mu.Lock()
	s.resetLocked()
	s.term = t
	s.cur.Store(t)
	s.epoch.Store(fence.Rev)
	s.genTerm.Store(genTerm)
	s.issued.Store(0)
	s.m.generationTerm.Set(float64(genTerm))
	journalled := s.loadSessionsLocked(snap)
	if s.cfg.VolatileFlush < 0 {
		// No journal in this mode: write the journalled sessions in full (their entries die,
		// and with them the keys).
		for _, e := range s.sessions {
			if e.jseq() != 0 {
				s.persistSessionLocked(e.rec)
			}
		}
	}
	for _, w := range snap.Workers {
		if kvcv1.ValidateID("worker_id", w.GetWorkerId()) != nil {
			continue
		}
		if w.GetState() != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE || w.GetUnreachableSinceUnixMs() == 0 {
			w.UnreachableSinceUnixMs = now
		}
		w.State = kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
		w.ConnectedTo = ""
		e := &workerEntry{w: w}
		s.workers[w.GetWorkerId()] = e
		s.startGraceLocked(e)
		if w.GetRole() == kvcv1.WorkerRole_WORKER_ROLE_DECODE {
			s.resyncPending[w.GetWorkerId()] = struct{}{}
		}
	}
	s.startResyncLocked(now)
	s.publishWorkersLocked()
	for _, e := range s.workers {
		if e.w.GetDraining() {
			s.startDrainLocked(e) // a drain survives a failover: the flag is in etcd
		}
	}
	s.mu.Unlock()

	go func() {
		defer close(t.done)
		if err := t.batcher.Run(bctx); errors.Is(err, kvstore.ErrFenced) {
			s.log.Warn().Int64("epoch", fence.Rev).Msg("write fenced off: this replica was deposed")
			close(t.deposed)
		}
	}()
	go func() {
		defer close(t.sweeper)
		s.sweep(tctx)
	}()
	go func() {
		defer close(t.flusher)
		s.flushVolatile(tctx)
	}()
	s.m.loadSeconds.Set(time.Since(start).Seconds())
	if len(snap.MalformedVolatile) > 0 {
		s.log.Warn().Strs("keys", snap.MalformedVolatile).Msg("skipped malformed volatile journal keys")
	}
	s.log.Info().Int64("epoch", fence.Rev).Uint64("generation_term", genTerm).Int("sessions", len(snap.Sessions)).Int("workers", len(snap.Workers)).
		Int("journal_keys", len(snap.Volatile)).Int("journal_entries_applied", journalled).
		Dur("load", time.Since(start)).Msg("leader state loaded")
	return t, nil
}

// loadedGenerationTerm is the newest generation term among the loaded sessions' generations
// and their snapshots' (the volatile journal carries none), and the session holding it.
func loadedGenerationTerm(snap *kvstore.Snapshot) (uint64, string) {
	var g uint64
	var id string
	for _, r := range snap.Sessions {
		if m := max(r.GetGeneration(), r.GetSnapshot().GetGeneration()); m > g {
			g, id = m, r.GetSessionId()
		}
	}
	return policy.GenerationTerm(g), id
}

// loadSessionsLocked fills the session table from a loaded snapshot: the records, then the
// volatile journal over them. It returns the journal entries applied.
func (s *State) loadSessionsLocked(snap *kvstore.Snapshot) int {
	for _, r := range snap.Sessions {
		id := r.GetSessionId()
		if kvcv1.ValidateID("session_id", id) != nil {
			continue
		}
		s.sessions[id] = sessEntry{rec: r}
		index(s.byDecode, r.GetDecodeWorker(), id)
		index(s.bySnap, r.GetSnapshot().GetPrefillWorker(), id)
		if vs := r.GetVolatileSeq(); vs < dirtyBit {
			s.jr.seq = max(s.jr.seq, vs)
		}
	}
	s.nSessions.Store(int64(len(s.sessions)))
	s.idsGen++
	return s.applyJournalLocked(snap.Volatile)
}

// Flush waits until every change made so far in the current term is in etcd, deferred
// volatile changes included.
func (s *State) Flush(ctx context.Context) error {
	s.mu.Lock()
	t := s.term
	if t != nil {
		s.flushDirtyLocked()
	}
	s.mu.Unlock()
	if t == nil {
		return ErrNotLeader
	}
	return t.batcher.Flush(ctx)
}

// endTermFlush bounds how long EndTerm waits for pending writes to reach etcd.
const endTermFlush = 5 * time.Second

// EndTerm ends t: no more writes are accepted, live streams are closed, what is pending
// (deferred volatile changes included) is flushed while the fence still holds, and the tables
// are cleared.
func (s *State) EndTerm(t *Term) {
	s.mu.Lock()
	if s.term != t {
		s.mu.Unlock()
		return
	}
	s.epoch.Store(0)
	s.genTerm.Store(0)
	s.m.generationTerm.Set(0)
	s.cur.Store(nil)
	s.flushDirtyLocked()
	for _, e := range s.workers {
		if e.grace != nil {
			e.grace.Stop()
		}
		if e.stream != nil {
			e.stream.close()
		}
	}
	s.mu.Unlock()
	// Write out what is pending (a whole interval of deferred volatile changes can be tens of
	// thousands of records) before stopping the batcher, whose own last attempt is short. A
	// deposed term's batcher answers at once with ErrFenced.
	fctx, fcancel := context.WithTimeout(context.Background(), endTermFlush)
	if err := t.batcher.Flush(fctx); err != nil && !errors.Is(err, kvstore.ErrFenced) {
		s.log.Warn().Err(err).Int("pending", t.batcher.Pending()).Msg("end of term: not every pending write reached etcd")
	}
	fcancel()
	t.cancel()
	<-t.done
	<-t.sweeper
	<-t.flusher
	t.drainWG.Wait()
	s.mu.Lock()
	s.term = nil
	s.resetLocked()
	s.publishWorkersLocked()
	s.mu.Unlock()
}

// flushVolatile writes deferred volatile session changes to the journal every
// Config.VolatileFlush until ctx ends (EndTerm writes the rest).
func (s *State) flushVolatile(ctx context.Context) {
	if s.cfg.VolatileFlush <= 0 {
		return
	}
	tick := time.NewTicker(s.cfg.VolatileFlush)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		s.flushDirtyPaced(ctx, s.cfg.VolatileFlush/2)
	}
}

// sweep expires idle sessions until ctx ends.
func (s *State) sweep(ctx context.Context) {
	for {
		ttl := time.Duration(s.Policy().GetSessionTtlMs()) * time.Millisecond
		every := min(max(ttl/10, time.Second), time.Minute)
		t := time.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		s.ExpireIdle(time.Now())
	}
}

// ExpireIdle deletes every session idle for the policy's session TTL at now and returns how
// many it deleted.
func (s *State) ExpireIdle(now time.Time) int {
	ttl := time.Duration(s.Policy().GetSessionTtlMs()) * time.Millisecond
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.term == nil {
		return 0
	}
	var ids []string
	for id, r := range s.sessions {
		if kvstore.IsIdle(r.rec, ttl, now) {
			ids = append(ids, id)
		}
	}
	for _, id := range ids {
		s.deleteSessionLocked(id)
	}
	s.m.expired.Add(float64(len(ids)))
	return len(ids)
}

// SetStoredPolicy installs the operator's overrides as read from etcd (nil: none stored). An
// older version than the one installed is ignored.
func (s *State) SetStoredPolicy(p *kvcv1.Policy) {
	s.policyKnown.Store(true)
	if p != nil {
		if cur := s.stored.Load(); cur != nil && cur.GetVersion() > p.GetVersion() {
			return
		}
	}
	s.stored.Store(p)
	s.policy.Store(FillPolicy(s.defaults, p))
}

// PolicyCorrupt reports a stored policy record that does not decode (kvstore.WatchPolicy, a
// leader's load): the policy in use stays as it is, loudly.
func (s *State) PolicyCorrupt(err error) {
	s.m.policyCorrupt.WithLabelValues("kept_last_good").Inc()
	s.log.Error().Err(err).Int64("version", s.stored.Load().GetVersion()).
		Msg("the stored policy is corrupt: keeping the last good version (put a valid one with UpdatePolicy)")
}

// UpdatePolicy merges the set fields of update into the stored policy, validates the result
// with defaults filled in, bumps the version, writes it to etcd under the fence (synchronously)
// and pushes it to every connected sidecar. It returns the new filled policy.
func (s *State) UpdatePolicy(ctx context.Context, update *kvcv1.Policy) (*kvcv1.Policy, error) {
	s.policyMu.Lock()
	defer s.policyMu.Unlock()
	s.mu.Lock()
	t := s.term
	s.mu.Unlock()
	if !t.acting() {
		return nil, ErrNotLeader
	}
	if err := ValidatePolicy(withoutRemovals(update)); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidPolicy, err)
	}
	if err := s.checkOverrideWorkers(update); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidPolicy, err)
	}
	stored := s.stored.Load()
	merged := MergePolicyUpdate(stored, update)
	if n := len(merged.GetMaxConcurrentTransfersPerWorker()); n > MaxPolicyOverrides {
		return nil, fmt.Errorf("%w: %d per-worker overrides (max_concurrent_transfers_per_worker), limit %d; remove some with a negative value", ErrPolicyTooLarge, n, MaxPolicyOverrides)
	}
	if n := proto.Size(merged); n > MaxPolicyBytes {
		return nil, fmt.Errorf("%w: %d bytes encoded, limit %d", ErrPolicyTooLarge, n, MaxPolicyBytes)
	}
	full := FillPolicy(s.defaults, merged)
	if err := ValidatePolicy(full); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidPolicy, err)
	}
	merged.Version = stored.GetVersion() + 1
	full.Version = merged.Version
	if err := s.cfg.Store.PutPolicy(ctx, t.fence, merged); err != nil {
		if errors.Is(err, kvstore.ErrFenced) {
			return nil, ErrNotLeader
		}
		if errors.Is(err, kvstore.ErrTooLarge) {
			return nil, fmt.Errorf("%w: %w", ErrPolicyTooLarge, err)
		}
		return nil, err
	}
	s.SetStoredPolicy(merged)
	s.log.Info().Int64("version", merged.Version).Msg("policy updated")
	s.mu.Lock()
	for _, e := range s.workers {
		if e.stream != nil {
			cmd := &kvcv1.Command{Action: &kvcv1.Command_UpdatePolicy{UpdatePolicy: &kvcv1.UpdatePolicyCommand{
				Policy: proto.Clone(full).(*kvcv1.Policy),
			}}}
			_ = s.sendLocked(e.stream, cmd)
		}
	}
	s.mu.Unlock()
	return full, nil
}

// checkOverrideWorkers refuses per-worker overrides (values >= 0) for workers this leader does
// not know (never registered, so never loaded from etcd nor connected): such entries would
// accumulate in the record forever. Removals (negative values) are always accepted.
func (s *State) checkOverrideWorkers(update *kvcv1.Policy) error {
	var unknown []string
	s.mu.Lock()
	for id, v := range update.GetMaxConcurrentTransfersPerWorker() {
		if v < 0 {
			continue
		}
		if _, ok := s.workers[id]; !ok {
			unknown = append(unknown, id)
		}
	}
	s.mu.Unlock()
	if len(unknown) == 0 {
		return nil
	}
	slices.Sort(unknown)
	if len(unknown) > 5 {
		unknown = append(unknown[:5], fmt.Sprintf("… (%d in all)", len(unknown)))
	}
	return fmt.Errorf("max_concurrent_transfers_per_worker names unknown workers %q: overrides are accepted only for registered workers", unknown)
}

// withoutRemovals returns update without its negative per-worker entries (they remove an
// override and are not values to range-check); update itself is not modified.
func withoutRemovals(update *kvcv1.Policy) *kvcv1.Policy {
	if update == nil {
		return nil
	}
	neg := false
	for _, v := range update.GetMaxConcurrentTransfersPerWorker() {
		neg = neg || v < 0
	}
	if !neg {
		return update
	}
	out := proto.Clone(update).(*kvcv1.Policy)
	for id, v := range out.MaxConcurrentTransfersPerWorker {
		if v < 0 {
			delete(out.MaxConcurrentTransfersPerWorker, id)
		}
	}
	return out
}
