package decode

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// ReleaseConfig configures the capacity release of idle sessions (a worker such as SGLang
// 0.5.23 never evicts a streaming session for capacity, so the sidecar does it for it).
type ReleaseConfig struct {
	// High is the fraction of the pool's capacity above which idle sessions are released; 0
	// disables the release.
	High float64
	// Low is the fraction the release brings the pool down to (Low < High).
	Low float64
	// MinIdle: a session committed more recently than this is never released (it is in use).
	MinIdle time.Duration
	// Interval between checks (1s).
	Interval time.Duration
	// AckTimeout bounds the wait for the worker's ack of one release command (10s).
	AckTimeout time.Duration
}

// Validate checks the settings (the binary exits with code 2 on an error).
func (c ReleaseConfig) Validate() error {
	switch {
	case c.High == 0:
		return nil
	case c.High < 0 || c.High > 1:
		return fmt.Errorf("release high watermark %v out of range (0, 1]", c.High)
	case c.Low < 0 || c.Low >= c.High:
		return fmt.Errorf("release low watermark %v must be in [0, high watermark %v)", c.Low, c.High)
	case c.MinIdle < 0:
		return fmt.Errorf("release minimum idle time %v is negative", c.MinIdle)
	case c.Interval < 0 || c.AckTimeout < 0:
		return fmt.Errorf("release interval and ack timeout must not be negative")
	}
	return nil
}

type releaser struct {
	cfg ReleaseConfig
}

func newReleaser(c ReleaseConfig) releaser {
	if c.Interval <= 0 {
		c.Interval = time.Second
	}
	if c.AckTimeout <= 0 {
		c.AckTimeout = 10 * time.Second
	}
	return releaser{cfg: c}
}

func (r releaser) enabled() bool { return r.cfg.High > 0 }

// releasableLocked reports whether ss may be released for capacity: it has a snapshot target
// while snapshots are on, its snapshot is or can be made current (a push of its committed
// length did not just fail), no release is out for it and no transfer into it is open. (An
// agent's pin is checked apart, pinnedAt: Load counts a pinned session as not evictable, so the
// control plane's admission does not plan on freeing it.)
func (s *Sidecar) releasableLocked(ss *session) bool {
	if ss.gone || ss.releasing || ss.target == nil || !s.enabled {
		return false
	}
	if ss.lastPushed < ss.committed && ss.failedLen == ss.committed {
		return false // its push failed: not current until the next commit
	}
	for _, r := range s.rooms {
		if r.res == nil && r.req.GetSessionId() == ss.id {
			return false
		}
	}
	return true
}

// activeAt is when ss was last in use here: its last commit or its last load, whichever is
// later. The capacity release never takes a session active less than MinIdle before now, on
// any path (the periodic pass, the pass a demand report kicks, the release command sent after
// its plan) and Load does not count it evictable.
func activeAt(ss *session) time.Time {
	if ss.loadedAt.After(ss.lastCommit) {
		return ss.loadedAt
	}
	return ss.lastCommit
}

// recentLocked reports whether ss was committed or loaded less than MinIdle before now.
func (s *Sidecar) recentLocked(ss *session, now time.Time) bool {
	return now.Sub(activeAt(ss)) < s.rel.cfg.MinIdle
}

// recentLoadLocked reports whether ss was loaded (LoadSessionCommand: a re-home) less than
// MinIdle before now: the release spares it even for a deficit, which a session committed
// less than MinIdle ago is not spared from (its next turn costs one snapshot reseed, the
// transfer a baseline pays every turn; the request waiting for pages is here now).
func recentLoadLocked(s *Sidecar, ss *session, now time.Time) bool {
	return !ss.loadedAt.IsZero() && now.Sub(ss.loadedAt) < s.rel.cfg.MinIdle
}

// pinnedAt reports whether an agent's pin (SetSessionHintsCommand.pinned_until_unix_ms) still
// holds at now.
func pinnedAt(ss *session, now time.Time) bool {
	return ss.hints.untilMs > now.UnixMilli()
}

// capacityLocked is the pool's capacity in tokens (the --kv-capacity-tokens override wins).
func (s *Sidecar) capacityLocked() int64 {
	if s.cfg.KVCapacity > 0 {
		return s.cfg.KVCapacity
	}
	if s.pool == nil {
		return 0
	}
	return s.pool.CapacityTokens()
}

// ReleasePlan is one pass of the capacity release, in priority order: the sessions to release
// now and those that wait for a later pass (for their own push, or for a push of a session
// ranked before them: releases never overtake).
type ReleasePlan struct {
	Used, Capacity int64
	// At is when it was planned: a session committed or loaded since is not released by it.
	At time.Time
	// Deficit is the tokens the worker's waiting requests need past its free room (0: none).
	Deficit int64
	Release []string
	Waiting []string
}

// demand is the worker's last ReportDemand: requests waiting in its prealloc queue, the tokens
// they need and the tokens it has free.
type demand struct {
	requests      int32
	running       int32 // ReportDemandRequest.running_requests: the requests holding their pages
	tokens, free  int64
	reports       int64 // reports received
	deficitPasses int64 // release passes that released or waited for a deficit
	spared        int64 // planned releases not sent: the session was committed or loaded since (releaseOne)
	onDemand      int64 // releases of sessions committed less than MinIdle ago, for a deficit
	refused       int64 // releases the worker refused (the session in use)
	// unevictable is the worker's capacity report (ReportDemandRequest.unevictable_tokens): the
	// committed KV of the sessions its requests are using. Forwarded in Load; 0 once the
	// worker is down (its sessions are gone).
	unevictable int64
	// released is the committed tokens of the sessions the capacity release freed since the
	// worker's last report (ReleaseSession of a session being released comes before the worker
	// frees its pages, so every later report counts them as free): a pass that runs before
	// that report — a commit's or a push's kick right after a pass — must not release for the
	// same deficit again.
	released int64
	// current: the fields above are a report the worker sent since it last came up; false
	// before its first report and from the moment it is seen down (forget) until it reports
	// again, the fields then all 0 (kvc_sidecar_demand_reported).
	current bool
	// forgotten counts the reports forget discarded (the worker went down with one current);
	// discarded, the reports not recorded because their caller was gone (ReportDemand).
	forgotten, discarded int64
}

// forget drops the worker's last report when it is seen down: its waiting requests, their
// tokens, its free room, its running requests and its unevictable KV all died with it. Until
// the restarted worker reports again nothing waits here: no release pass acts on the dead
// worker's deficit, the load report to the control plane shows no waiting or running requests
// and the demand gauges read 0. The counters stay. It returns the report it dropped and
// whether there was one.
func (d *demand) forget() (demand, bool) {
	old := *d
	d.requests, d.running, d.tokens, d.free, d.unevictable, d.released = 0, 0, 0, 0, 0, 0
	d.current = false
	if old.current {
		d.forgotten++
	}
	return old, old.current
}

// deficit is the tokens the waiting requests need past the free room and what the release
// freed since the report.
func (d demand) deficit() int64 {
	if d.requests <= 0 {
		return 0
	}
	return max(0, d.tokens-d.free-d.released)
}

// ReportDemand records the worker's prealloc-queue demand and, when requests wait for more
// than it has free, runs a release pass at once rather than at the next tick. A report whose
// caller is gone (its context done: it gave up, or its bridge connection closed — the worker
// died) is not recorded: gRPC cancels a connection's calls before the health tracker sees the
// connection end, so a dead worker's report handled late cannot bring its demand back after
// WorkerHealth forgot it; a live caller that timed out sends its next report anyway (kvc-sim
// and the SGLang plugin treat a failed report as unknown to the sidecar).
func (s *Sidecar) ReportDemand(ctx context.Context, req *kvcv1.ReportDemandRequest) (*kvcv1.ReportDemandResponse, error) {
	if req.GetWaitingRequests() < 0 || req.GetWaitingTokens() < 0 || req.GetFreeTokens() < 0 || req.GetUnevictableTokens() < 0 ||
		req.GetRunningRequests() < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "negative demand: %d requests, %d tokens, %d free, %d unevictable, %d running",
			req.GetWaitingRequests(), req.GetWaitingTokens(), req.GetFreeTokens(), req.GetUnevictableTokens(), req.GetRunningRequests())
	}
	s.mu.Lock()
	if err := ctx.Err(); err != nil {
		s.demand.discarded++
		s.mu.Unlock()
		return nil, status.FromContextError(err).Err()
	}
	s.demand.current = true
	s.demand.requests, s.demand.tokens, s.demand.free = req.GetWaitingRequests(), req.GetWaitingTokens(), req.GetFreeTokens()
	s.demand.unevictable = req.GetUnevictableTokens()
	s.demand.running = req.GetRunningRequests()
	s.demand.released = 0 // this report counts the freed pages
	s.demand.reports++
	short := s.demand.deficit() > 0
	s.mu.Unlock()
	if short {
		select {
		case s.relKick <- struct{}{}:
		default:
		}
	}
	return &kvcv1.ReportDemandResponse{}, nil
}

// DemandStats is the worker's last reported demand and the sidecar's response to it.
type DemandStats struct {
	WaitingRequests               int32
	WaitingTokens, FreeTokens     int64
	Reports, DeficitReleasePasses int64
	// SparedReleases: releases planned by a pass and not sent, the session committed or
	// loaded since (or within MinIdle).
	SparedReleases int64
	// UnevictableTokens is the worker's last capacity report (ReportDemandRequest.unevictable_tokens).
	UnevictableTokens int64
	// RunningRequests: the requests holding their pages, as last reported (running_requests).
	RunningRequests int32
	// OnDemandReleases: sessions released for a deficit less than MinIdle after their last
	// commit; RefusedReleases: releases the worker refused (the session in use).
	OnDemandReleases, RefusedReleases int64
	// Reported: the fields above are a report the worker sent since it last came up (false
	// before its first and from its down until its next: they are 0 then).
	Reported bool
	// ForgottenReports: reports dropped because the worker went down with them current;
	// DiscardedReports: reports not recorded, their caller gone (ReportDemand).
	ForgottenReports, DiscardedReports int64
}

// Demand returns the worker's last reported prealloc-queue demand.
func (s *Sidecar) Demand() DemandStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.demand
	return DemandStats{WaitingRequests: d.requests, WaitingTokens: d.tokens, FreeTokens: d.free, Reports: d.reports, DeficitReleasePasses: d.deficitPasses,
		UnevictableTokens: d.unevictable, RunningRequests: d.running, SparedReleases: d.spared, OnDemandReleases: d.onDemand, RefusedReleases: d.refused,
		Reported: d.current, ForgottenReports: d.forgotten, DiscardedReports: d.discarded}
}

// planReleaseLocked picks, when the pool is above the high watermark, the idle sessions that
// bring it down to the low watermark, lowest priority first. Rank: the agent's low-priority
// hint (SetSessionHintsCommand.low_priority: those first), then idle time (whole seconds
// since the last commit, longest first), then size (committed tokens, largest first), then
// session id; sessions idle less than MinIdle, pinned (an agent hint: pinned_until_unix_ms
// still ahead of now — its agent waits on a tool and comes back) or not releasable
// (releasableLocked) are never picked — they are what the worker is using — except that
// requests waiting for pages (a deficit) are given sessions committed less than MinIdle ago,
// after every idler one, smallest first, and only up to the deficit (release on demand: such a session's next
// turn costs one snapshot reseed, what a baseline pays every turn; a request that waits for
// them is here now; issue 20: turns waited seconds for the MinIdle of full pools' sessions);
// a session loaded less than MinIdle ago (a re-home) is spared still. A session whose snapshot is current (everything
// committed is pushed, no push queued or running) is released now; one that needs a push gets
// one queued at once whatever delta_tokens says, and is released by a later pass once that
// push has landed — and so are the sessions ranked after it (their pushes start meanwhile), so
// that releases follow the priority order exactly.
func (s *Sidecar) planReleaseLocked(now time.Time) ReleasePlan {
	p := ReleasePlan{Capacity: s.capacityLocked(), At: now}
	if !s.rel.enabled() || s.pool == nil || p.Capacity <= 0 {
		return p
	}
	for _, ss := range s.sessions {
		p.Used += ss.committed
	}
	for _, r := range s.rooms {
		if r.res == nil {
			p.Used += r.req.GetTokens()
		}
	}
	// Requests waiting in the worker's prealloc queue for pages it does not have free: their
	// pages are taken before any PrepareReceive, so neither the sessions nor the rooms count
	// them, and a pool just under the high watermark with a reseed waiting for more than the
	// free room held the queue — every turn behind it included — until the prealloc wait ran
	// out (issue 20: REJECTED_BY_D, TTFT p99 = the 20 s wait).
	p.Deficit = s.demand.deficit()
	watermark := float64(p.Used) > s.rel.cfg.High*float64(p.Capacity)
	if !watermark && p.Deficit <= 0 {
		return p
	}
	type cand struct {
		ss     *session
		idle   int64
		low    bool
		recent bool // committed less than MinIdle ago: taken only for the deficit
	}
	var cands []cand
	for _, ss := range s.sessions {
		idle := now.Sub(activeAt(ss))
		recent := s.recentLocked(ss, now)
		if !s.releasableLocked(ss) || pinnedAt(ss, now) || inUseAt(ss, now) || recentLoadLocked(s, ss, now) {
			continue
		}
		if recent && p.Deficit <= 0 {
			continue
		}
		cands = append(cands, cand{ss, int64(idle / time.Second), ss.hints.low, recent})
	}
	slices.SortFunc(cands, func(a, b cand) int {
		if a.low != b.low {
			if a.low {
				return -1
			}
			return 1
		}
		if a.recent != b.recent { // the idle ones before any in conversation
			if b.recent {
				return -1
			}
			return 1
		}
		if c := cmp.Compare(b.idle, a.idle); c != 0 {
			return c
		}
		if a.recent {
			// Released on demand, a session in conversation comes back soon and pays a reseed
			// of all it holds: the smallest first, so that the deficit costs several short
			// reseeds rather than one long one of the largest session (its whole-context
			// transfer is what sets the TTFT tail).
			if c := cmp.Compare(a.ss.committed, b.ss.committed); c != 0 {
				return c
			}
		} else if c := cmp.Compare(b.ss.committed, a.ss.committed); c != 0 {
			return c
		}
		return cmp.Compare(a.ss.id, b.ss.id)
	})
	var need int64
	if watermark {
		need = p.Used - int64(s.rel.cfg.Low*float64(p.Capacity))
	}
	short := p.Deficit // what the waiting requests still need: recent sessions give only that
	blocked := false
	for _, c := range cands {
		if need <= 0 && short <= 0 {
			break
		}
		if c.recent && short <= 0 {
			continue
		}
		ss := c.ss
		need -= ss.committed
		short -= ss.committed
		current := ss.push == nil && !ss.queued && ss.lastPushed >= ss.committed
		if current && !blocked {
			ss.releasing = true
			p.Release = append(p.Release, ss.id)
			continue
		}
		blocked = true
		p.Waiting = append(p.Waiting, ss.id)
		if !current && ss.push == nil && !ss.queued {
			ss.forcePush = true
			s.maybeEnqueueLocked(ss)
		}
	}
	return p
}

// releaseTick runs one pass: it plans and sends each release (WorkerReleaseCommand, reason
// CAPACITY) in priority order, waiting for the worker's ack of each.
func (s *Sidecar) releaseTick(ctx context.Context) ReleasePlan {
	p, _ := s.releasePass(ctx)
	return p
}

// releasePass is releaseTick that also reports how many releases the worker refused (a
// session in use: the next pass ranks past it).
func (s *Sidecar) releasePass(ctx context.Context) (ReleasePlan, int) {
	s.mu.Lock()
	p := s.planReleaseLocked(time.Now())
	if p.Deficit > 0 && (len(p.Release) > 0 || len(p.Waiting) > 0) {
		s.demand.deficitPasses++
	}
	s.mu.Unlock()
	if len(p.Release) > 0 || len(p.Waiting) > 0 {
		s.log.Info().Int64("used_tokens", p.Used).Int64("capacity_tokens", p.Capacity).Int64("deficit_tokens", p.Deficit).Strs("release", p.Release).
			Strs("waiting", p.Waiting).Msg("pool above the release watermark or requests waiting for pages: releasing idle sessions")
	}
	refused := 0
	for _, id := range p.Release {
		if s.releaseOne(ctx, id, p.At, p.Deficit > 0) {
			refused++
		}
	}
	return p, refused
}

// pushLandedLocked runs a release pass at once when a push lands while requests wait for
// pages: the session it made current may go now, and so may the sessions ranked after it when
// the release forced it (planReleaseLocked's Waiting list). Before, only a forced push kicked a
// pass, and a session whose own push (its commit's, its idle flush) made it current waited for
// the next tick (1 s at real speed) or demand report with the waiting requests' pages held that
// long: issue 20, E4 at 1P3D load 8, a committed session idle 0.36 s on average before its
// release while 100–250K tokens of reseeds waited on an 88K pool.
func (s *Sidecar) pushLandedLocked(ok bool) {
	if !ok {
		return
	}
	s.kickIfShortLocked()
}

// kickIfShortLocked runs a release pass at once (without blocking) when the capacity release
// is on and requests wait for more pages than the worker has free: on a demand report, a
// commit (the session's turn ended, so it is idle and may go) and a push's landing (the
// session is current now).
func (s *Sidecar) kickIfShortLocked() {
	if !s.rel.enabled() || s.demand.deficit() <= 0 {
		return
	}
	select {
	case s.relKick <- struct{}{}:
	default:
	}
}

// releaseOne asks the worker to free a session (it calls ReleaseSession, then frees the pages,
// then acks). A refusal (the session is in use) or a missing watcher leaves the session as it is;
// it returns true when the worker refused. A session committed or loaded since the pass planned
// it at planned (the releases before it waited for the worker's acks meanwhile), or less than
// MinIdle ago, is not sent: it is in use again — except that a pass for a deficit (onDemand:
// requests wait for pages) takes a session committed less than MinIdle ago, though never one
// committed since the plan nor one loaded less than MinIdle ago.
func (s *Sidecar) releaseOne(ctx context.Context, id string, planned time.Time, onDemand bool) bool {
	s.mu.Lock()
	ss := s.sessions[id]
	young := false // committed less than MinIdle ago: released on demand
	if ss != nil && ss.releasing {
		now := time.Now()
		young = s.recentLocked(ss, now)
		recent := young && (!onDemand || recentLoadLocked(s, ss, now))
		if activeAt(ss).After(planned) || recent || pinnedAt(ss, now) {
			ss.releasing = false
			s.demand.spared++
			s.mu.Unlock()
			s.log.Info().Str("session", id).Msg("capacity release not sent: the session was committed or loaded since the pass planned it")
			return false
		}
	}
	s.mu.Unlock()
	actx, cancel := context.WithTimeout(ctx, s.rel.cfg.AckTimeout)
	ack, err := s.att.Send(actx, &kvcv1.WatchCommandsResponse{Reason: kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY,
		Command: &kvcv1.WatchCommandsResponse_Release{Release: &kvcv1.WorkerReleaseCommand{SessionId: id}}})
	cancel()
	refused := false // the worker answered no: it uses the session (a send failure says nothing)
	if err == nil && !ack.GetOk() {
		err, refused = fmt.Errorf("worker refused: %s", ack.GetError()), true
	}
	if err != nil {
		s.mu.Lock()
		if ss := s.sessions[id]; ss != nil {
			ss.releasing = false
			if refused {
				ss.inUseAt = time.Now()
			}
		}
		if refused {
			s.demand.refused++
		}
		s.mu.Unlock()
		s.log.Warn().Str("session", id).Str("error", status.Convert(err).Message()).Msg("capacity release not done")
		return refused
	}
	s.log.Info().Str("session", id).Int64("freed_tokens", ack.GetFreedTokens()).Msg("session released for capacity")
	// The worker's ReleaseSession dropped and reported it; a worker that acked without calling
	// it is not trusted to still hold the session.
	s.mu.Lock()
	ss = s.sessions[id]
	still := ss != nil && ss.releasing
	if young {
		s.demand.onDemand++
	}
	s.mu.Unlock()
	if still {
		if dropped, _, ok := s.drop(id); ok {
			s.mu.Lock()
			s.demand.released += dropped.committed
			s.mu.Unlock()
			s.reportCapacityRelease(dropped)
		}
	}
	return false
}

// releaseInUseRetry: how long a session whose release the worker refused (in use) is passed
// over when it does not commit meanwhile (a turn that failed commits nothing).
const releaseInUseRetry = 5 * time.Second

// inUseAt: the worker refused to release ss since its last commit, less than releaseInUseRetry
// ago: a request is using it (waiting for pages or running). Without it the release picked
// the same sessions, the idle-longest by their last commit, on every pass while their own
// turns waited for pages in the worker's prealloc queue, and freed nothing else (seen: 53
// refusals and one release in 52 passes on one decode worker of a 24-session run).
func inUseAt(ss *session, now time.Time) bool {
	return !ss.inUseAt.IsZero() && !ss.inUseAt.Before(ss.lastCommit) && now.Sub(ss.inUseAt) < releaseInUseRetry
}

func (s *Sidecar) reportCapacityRelease(ss *session) {
	s.ev.Emit(sidecar.Event{Event: sidecar.EvSessionRelease, Session: ss.id, Generation: ss.gen, Seqlen: ss.committed, Reason: "capacity"})
	s.rep.Report(&kvcv1.SessionEvent{SessionId: ss.id, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED, KvLen: ss.committed,
		Generation: ss.gen, Detail: "capacity release (snapshot current)"})
}

// maxReleaseRounds bounds the passes one tick or kick runs back to back.
const maxReleaseRounds = 4

// releaseRounds runs a pass and, while the worker refused some of its releases (sessions whose
// turns wait for pages, which it passes over now) and requests still wait for pages, plans
// again at once instead of at the next tick or report.
func (s *Sidecar) releaseRounds(ctx context.Context) {
	for range maxReleaseRounds {
		p, refused := s.releasePass(ctx)
		if refused == 0 || p.Deficit <= 0 || ctx.Err() != nil {
			return
		}
		s.mu.Lock()
		short := s.demand.deficit() > 0
		s.mu.Unlock()
		if !short {
			return
		}
	}
}

// runRelease checks the watermarks every Interval until ctx is done.
func (s *Sidecar) runRelease(ctx context.Context) {
	if !s.rel.enabled() {
		return
	}
	t := time.NewTicker(s.rel.cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.releaseRounds(ctx)
		case <-s.relKick:
			s.releaseRounds(ctx)
		}
	}
}
