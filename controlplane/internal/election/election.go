package election

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Leader is the observed leader.
type Leader struct {
	NodeID string `json:"node_id"`
	Addr   string `json:"addr"`
	Epoch  int64  `json:"-"`
}

// Config configures an Elector.
type Config struct {
	Client *clientv3.Client
	Prefix string // election key prefix, e.g. /kvc/v1/leader/
	NodeID string
	Addr   string // advertised gRPC address
	TTL    time.Duration
	// RenewDeadline is how long after the last lease renewal it sent (by this process's
	// monotonic clock) the replica may act as leader; it must be below TTL so that a leader
	// that cannot reach etcd stops acting before etcd expires its lease and a standby takes
	// over. 0 means DefaultRenewDeadline(TTL).
	RenewDeadline time.Duration
	// RenewInterval is how often the lease is renewed (each attempt bounded by the interval).
	// 0 means RenewDeadline/4.
	RenewInterval time.Duration
	Log           zerolog.Logger
	Reg           prometheus.Registerer
}

// DefaultRenewDeadline is two thirds of the TTL (client-go's 10 s of 15 s).
func DefaultRenewDeadline(ttl time.Duration) time.Duration { return ttl * 2 / 3 }

// Elector campaigns for leadership and observes the current leader.
type Elector struct {
	cfg     Config
	current atomic.Pointer[Leader]
	// cur is the term this replica serves as leader (nil otherwise): the one fact every
	// leadership check reads (IsLeader, the gate, the state; see Term).
	cur      atomic.Pointer[Term]
	stepDown chan string
	changed  chan struct{}

	// base is the reference of the monotonic clock; validUntil (nanoseconds since base) is
	// the renew deadline: the last renewal's send time plus RenewDeadline.
	base       time.Time
	validUntil atomic.Int64
	// observedAt is when (nanoseconds since base) Observe last read the election key.
	observedAt atomic.Int64
	// orphan is the lease of an ended term that could not be revoked (etcd unreachable then).
	// Its key would block every campaign until the lease expires, and an etcd leader change
	// extends it; the next term revokes it as soon as etcd answers again.
	orphan atomic.Int64

	gLeader   prometheus.Gauge
	elections prometheus.Counter
	lost      *prometheus.CounterVec
	renewals  *prometheus.CounterVec
}

// New returns an Elector. TTL is rounded up to whole seconds (etcd leases are in seconds).
func New(cfg Config) (*Elector, error) {
	if cfg.Client == nil || cfg.Prefix == "" || cfg.NodeID == "" {
		return nil, errors.New("election: client, prefix and node id are required")
	}
	if cfg.TTL < time.Second {
		return nil, fmt.Errorf("election: ttl %s is below 1s", cfg.TTL)
	}
	if cfg.RenewDeadline == 0 {
		cfg.RenewDeadline = DefaultRenewDeadline(cfg.TTL)
	}
	if cfg.RenewDeadline <= 0 || cfg.RenewDeadline >= cfg.TTL {
		return nil, fmt.Errorf("election: renew deadline %s must be positive and below the ttl %s", cfg.RenewDeadline, cfg.TTL)
	}
	if cfg.RenewInterval == 0 {
		cfg.RenewInterval = cfg.RenewDeadline / 4
	}
	if cfg.RenewInterval <= 0 || cfg.RenewInterval >= cfg.RenewDeadline {
		return nil, fmt.Errorf("election: renew interval %s must be positive and below the renew deadline %s", cfg.RenewInterval, cfg.RenewDeadline)
	}
	e := &Elector{
		cfg: cfg, stepDown: make(chan string, 1), changed: make(chan struct{}, 1), base: time.Now(),
		gLeader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_leader", Help: "1 while this replica is the leader.",
		}),
		elections: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_elections_won_total", Help: "Elections this replica won.",
		}),
		lost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_leadership_lost_total", Help: "Terms ended, by reason (session_lost, renew_deadline, step_down, lead_error, shutdown).",
		}, []string{"reason"}),
		renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_lease_renewals_total", Help: "Election lease renewals sent by this replica, by result (ok, error, lost).",
		}, []string{"result"}),
	}
	if cfg.Reg != nil {
		// Every reason from the start: the leader-flapping alert's increase() sees a series.
		for _, why := range []string{"session_lost", "renew_deadline", "step_down", "lead_error", "shutdown"} {
			e.lost.WithLabelValues(why)
		}
		cfg.Reg.MustRegister(e.gLeader, e.elections, e.lost, e.renewals)
	}
	return e, nil
}

// Current returns the observed leader (ok false when none is known). It never names this
// replica unless IsLeader holds: a replica past its renew deadline may still see its own key
// in etcd (or not see etcd at all), and must not send callers back to itself.
//
// Another replica is named only while this one has read the election key from etcd within the
// last TTL: a replica that cannot reach etcd does not know whether that leader still leads
// (it steps down at its renew deadline when it cannot reach etcd either), and callers sent
// to a replica that stepped down would loop between two standbys.
func (e *Elector) Current() (Leader, bool) {
	l := e.current.Load()
	if l == nil {
		return Leader{}, false
	}
	if l.NodeID == e.cfg.NodeID {
		if !e.IsLeader() {
			return Leader{}, false
		}
		return *l, true
	}
	if seen := e.observedAt.Load(); seen == 0 || e.mono()-time.Duration(seen) > e.cfg.TTL {
		return Leader{}, false
	}
	return *l, true
}

// IsLeader reports whether this replica leads now: it holds a term that serves and its lease
// was renewed within the renew deadline. The deadline is checked on every call against the
// monotonic clock, so a process resumed after a pause (SIGSTOP, a long GC or scheduler stall)
// or cut off from etcd answers false at once, before the term's own goroutines notice.
func (e *Elector) IsLeader() bool {
	t := e.cur.Load()
	return t != nil && t.Err() == nil
}

// ErrRenewDeadline is the cause (context.Cause) of a term context ended at the renew deadline.
var ErrRenewDeadline = errors.New("election: renew deadline passed")

// Term is the context of one leadership: the ctx a LeadFunc gets. It is done when the term
// ends for any reason (session lost, step down, stop) and, checked on every Err call against
// the monotonic clock, at the renew deadline: Err cancels it then (cause ErrRenewDeadline) and
// reports it, even before the watchdog goroutine has run (a process resumed after SIGSTOP).
// Every leader-bound check and goroutine uses it or derives from it: the gate's streams, the
// state's mutations and commands (state.LeadTerm), its sweeper, journal flusher and drains.
type Term struct {
	context.Context
	cancel context.CancelCauseFunc
	e      *Elector
	epoch  int64
}

// Err reports the end of the term; past the renew deadline it ends the term first.
func (t *Term) Err() error {
	if err := t.Context.Err(); err != nil {
		return err
	}
	if !t.e.leaseValid() {
		t.cancel(ErrRenewDeadline)
		return t.Context.Err()
	}
	return nil
}

// Epoch is the term's epoch (the create revision of the leader key).
func (t *Term) Epoch() int64 { return t.epoch }

// RenewDeadline is the configured renew deadline.
func (e *Elector) RenewDeadline() time.Duration { return e.cfg.RenewDeadline }

func (e *Elector) mono() time.Duration { return time.Since(e.base) }

// leaseValid reports whether the renew deadline has not passed.
func (e *Elector) leaseValid() bool { return int64(e.mono()) < e.validUntil.Load() }

// extend moves the renew deadline to sent+RenewDeadline (never backwards).
func (e *Elector) extend(sent time.Duration) {
	until := int64(sent + e.cfg.RenewDeadline)
	for {
		cur := e.validUntil.Load()
		if until <= cur || e.validUntil.CompareAndSwap(cur, until) {
			return
		}
	}
}

// renew renews the session's lease every RenewInterval until ctx ends, extending the renew
// deadline from each successful renewal's send time. When etcd says the lease is gone it
// voids the deadline and closes gone.
func (e *Elector) renew(ctx context.Context, lease clientv3.LeaseID, gone chan<- struct{}) {
	t := time.NewTimer(e.cfg.RenewInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		sent := e.mono()
		cctx, cancel := context.WithTimeout(ctx, e.cfg.RenewInterval)
		_, err := e.cfg.Client.KeepAliveOnce(cctx, lease)
		cancel()
		switch {
		case err == nil:
			e.extend(sent)
			e.renewals.WithLabelValues("ok").Inc()
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			e.validUntil.Store(0)
			e.renewals.WithLabelValues("lost").Inc()
			close(gone)
			return
		default:
			if ctx.Err() != nil {
				return
			}
			e.renewals.WithLabelValues("error").Inc()
		}
		// Pace from the send time: a hung attempt already used its interval.
		t.Reset(max(e.cfg.RenewInterval-(e.mono()-sent), 0))
	}
}

// Hint returns the leader hint for NotLeader errors (nil fields when no leader is known).
func (e *Elector) Hint() *kvcv1.LeaderHint {
	l, ok := e.Current()
	if !ok {
		return &kvcv1.LeaderHint{}
	}
	return &kvcv1.LeaderHint{LeaderId: l.NodeID, LeaderAddr: l.Addr, Epoch: l.Epoch}
}

// NotLeaderError is cpclient.NotLeaderError with the current hint.
func (e *Elector) NotLeaderError() error { return cpclient.NotLeaderError(e.Hint()) }

// StepDown ends the current term (if any); the replica resigns and campaigns again after a
// pause of one TTL.
func (e *Elector) StepDown(reason string) {
	select {
	case e.stepDown <- reason:
	default:
	}
}

// LeadFunc runs while this replica holds the election; it calls serving once it has loaded
// its state and serves as leader (only then does IsLeader report true), and must return soon
// after ctx is done. ctx is the term (*Term): done when leadership ends, at the renew deadline
// included; everything leader-bound should check or derive from it.
type LeadFunc func(ctx context.Context, fence kvstore.Fence, serving func()) error

// Run campaigns and leads until ctx ends.
func (e *Elector) Run(ctx context.Context, lead LeadFunc) error {
	ttl := int((e.cfg.TTL + time.Second - 1) / time.Second)
	val, _ := json.Marshal(Leader{NodeID: e.cfg.NodeID, Addr: e.cfg.Addr})
	backoff := cpclient.Backoff{Min: 100 * time.Millisecond, Max: 2 * time.Second}
	for ctx.Err() == nil {
		pause, err := e.term(ctx, ttl, string(val), lead)
		if err != nil && ctx.Err() == nil {
			e.cfg.Log.Warn().Err(err).Msg("election round failed")
			pause = max(pause, backoff.Next())
		} else {
			backoff.Reset()
		}
		if pause > 0 {
			t := time.NewTimer(pause)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
		}
	}
	return nil
}

// term runs one session: campaign, lead, resign. It returns how long to wait before the next.
func (e *Elector) term(ctx context.Context, ttl int, val string, lead LeadFunc) (time.Duration, error) {
	granted := e.mono() // the lease cannot expire before granted+TTL
	sess, err := concurrency.NewSession(e.cfg.Client, concurrency.WithTTL(ttl), concurrency.WithContext(ctx))
	if err != nil {
		return 0, fmt.Errorf("session: %w", err)
	}
	e.revokeOrphan(ctx)
	defer e.closeSession(ctx, sess) // revokes the lease: our key (if any) goes at once
	e.validUntil.Store(0)
	e.extend(granted)
	renewCtx, rstop := context.WithCancel(ctx)
	gone := make(chan struct{})
	renewing := make(chan struct{})
	go func() { defer close(renewing); e.renew(renewCtx, sess.Lease(), gone) }()
	defer func() { rstop(); <-renewing }()
	el := concurrency.NewElection(sess, e.cfg.Prefix)

	cctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(sess.Ctx(), cancel)
	err = e.campaign(ctx, cctx, el, val)
	stop()
	cancel()
	if err != nil {
		select {
		case <-sess.Done():
			return 0, errors.New("session lost while campaigning")
		default:
		}
		return 0, fmt.Errorf("campaign: %w", err)
	}
	// Confirm: Campaign can return without us holding the key when the lease lapsed meanwhile.
	rctx, rcancel := context.WithTimeout(ctx, e.cfg.TTL)
	resp, err := e.cfg.Client.Txn(rctx).If(clientv3.Compare(clientv3.CreateRevision(el.Key()), "=", el.Rev())).Commit()
	rcancel()
	if err != nil || !resp.Succeeded {
		return 0, fmt.Errorf("campaign won but not confirmed (err %v)", err)
	}
	if !e.leaseValid() {
		// Won, but the lease was not renewed within the renew deadline: it may expire any
		// moment. Give the key back and campaign again.
		rctx, rcancel = context.WithTimeout(ctx, 2*time.Second)
		_ = el.Resign(rctx)
		rcancel()
		return 0, errors.New("campaign won after the renew deadline passed")
	}
	fence := kvstore.Fence{Key: el.Key(), Rev: el.Rev()}
	e.elections.Inc()
	e.cfg.Log.Info().Int64("epoch", fence.Rev).Msg("elected leader")

	lctx, lcancel := context.WithCancelCause(ctx)
	term := &Term{Context: lctx, cancel: lcancel, e: e, epoch: fence.Rev}
	reason := make(chan string, 1)
	go func() {
		why := e.watch(term, sess, gone)
		lcancel(errors.New(why)) // IsLeader is false from the moment the term is known to end
		reason <- why
	}()
	serving := func() {
		if term.Err() != nil {
			return // the term ended while loading
		}
		e.cur.Store(term)
		e.gLeader.Set(1)
		e.current.Store(&Leader{NodeID: e.cfg.NodeID, Addr: e.cfg.Addr, Epoch: fence.Rev})
	}
	lerr := lead(term, fence, serving)
	lcancel(context.Canceled)
	why := <-reason
	e.cur.CompareAndSwap(term, nil)
	e.gLeader.Set(0)
	if l := e.current.Load(); l != nil && l.NodeID == e.cfg.NodeID && l.Epoch == fence.Rev {
		// Do not name ourselves in hints any more; Observe fills in the next leader.
		e.current.CompareAndSwap(l, nil)
	}
	if lerr != nil && ctx.Err() == nil && why == "shutdown" {
		why = "lead_error"
	}
	label := why
	if len(label) > 9 && label[:9] == "step_down" {
		label = "step_down"
	}
	e.lost.WithLabelValues(label).Inc()
	e.cfg.Log.Warn().Str("reason", why).Err(lerr).Int64("epoch", fence.Rev).Msg("leadership ended")
	// Resign (bounded) so a standby can take over now, not after the TTL.
	rctx, rcancel = context.WithTimeout(context.Background(), 2*time.Second)
	_ = el.Resign(rctx)
	rcancel()
	if why != "shutdown" && why != "session_lost" && why != "renew_deadline" {
		return e.cfg.TTL, nil // stepped down or deposed: let the other replica lead
	}
	return 0, nil
}

// closeSession revokes the term's lease, bounded by the TTL as concurrency.Session.Close is; a
// lease it could not revoke (etcd unreachable) is left to revokeOrphan.
func (e *Elector) closeSession(ctx context.Context, sess *concurrency.Session) {
	sess.Orphan()
	ctx, cancel := context.WithTimeout(ctx, e.cfg.TTL) // the run's context, as the session's own Close
	defer cancel()
	if _, err := e.cfg.Client.Revoke(ctx, sess.Lease()); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		if ctx.Err() != nil && errors.Is(context.Cause(ctx), context.Canceled) {
			return // stopping: nothing will campaign again in this process
		}
		e.orphan.Store(int64(sess.Lease()))
		e.cfg.Log.Warn().Err(err).Int64("lease", int64(sess.Lease())).Msg("could not revoke the ended term's lease: revoking it once etcd answers")
	}
}

// revokeOrphan revokes the lease of an earlier term that closeSession could not revoke. It runs
// right after a new session was granted (etcd answers again): without it, after etcd (or its
// quorum) comes back, every campaign waits for the old lease's TTL.
func (e *Elector) revokeOrphan(ctx context.Context) {
	id := e.orphan.Swap(0)
	if id == 0 {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, e.cfg.TTL)
	defer cancel()
	if _, err := e.cfg.Client.Revoke(rctx, clientv3.LeaseID(id)); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		e.orphan.CompareAndSwap(0, id)
		return
	}
	e.cfg.Log.Info().Int64("lease", id).Msg("revoked the lease of an earlier term")
}

// campaignCleanup bounds how long a campaign cancelled by shutdown may spend cleaning up.
const campaignCleanup = time.Second

// campaign runs el.Campaign(cctx) but returns within campaignCleanup once ctx (the run's
// context) ends. A cancelled Campaign resigns with the etcd client's own context, which has no
// deadline: with etcd unreachable it would block forever, and with it the process's stop (a
// standby ignored SIGTERM while etcd was black-holed). The abandoned call ends when the client
// is closed; the session's lease, revoked or expiring, removes the key either way.
func (e *Elector) campaign(ctx, cctx context.Context, el *concurrency.Election, val string) error {
	done := make(chan error, 1)
	go func() { done <- el.Campaign(cctx, val) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	t := time.NewTimer(campaignCleanup)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		e.cfg.Log.Warn().Msg("campaign did not end within 1s of the stop (etcd unreachable?): abandoned")
		return ctx.Err()
	}
}

// watch waits for the end of a term and returns why. Its timer ends the term at the renew
// deadline unless renewals moved it; IsLeader checks the deadline on every call as well.
func (e *Elector) watch(term *Term, sess *concurrency.Session, gone <-chan struct{}) string {
	wd := time.NewTimer(time.Duration(e.validUntil.Load()) - e.mono())
	defer wd.Stop()
	for {
		select {
		case <-sess.Done():
			return "session_lost"
		case <-gone:
			return "session_lost"
		case <-wd.C:
			if term.Err() != nil {
				return "renew_deadline"
			}
			wd.Reset(time.Duration(e.validUntil.Load()) - e.mono())
		case r := <-e.stepDown:
			return "step_down: " + r
		case <-term.Done():
			if errors.Is(context.Cause(term), ErrRenewDeadline) {
				return "renew_deadline" // an Err call saw the deadline first
			}
			return "shutdown"
		}
	}
}

// Observe keeps Current up to date (the first-created key under the prefix) until ctx ends.
// Besides the watch it re-reads the key every TTL/2; a replica that could not read it for a
// TTL stops naming another replica as leader (see Current).
func (e *Elector) Observe(ctx context.Context) error {
	get := func() bool {
		gctx, gcancel := context.WithTimeout(ctx, e.cfg.TTL) // a cut-off etcd must not hang us
		defer gcancel()
		resp, err := e.cfg.Client.Get(gctx, e.cfg.Prefix, clientv3.WithFirstCreate()...)
		if err != nil {
			return false
		}
		e.setFrom(resp)
		e.observedAt.Store(int64(e.mono()))
		return true
	}
	for ctx.Err() == nil {
		if get() {
			e.watchLeader(ctx, get)
		}
		t := time.NewTimer(200 * time.Millisecond)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
	}
	return nil
}

// watchLeader re-reads the leader on every change under the prefix and every TTL/2, until a
// read fails, the watch ends or ctx ends.
func (e *Elector) watchLeader(ctx context.Context, get func() bool) {
	wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer wcancel()
	wch := e.cfg.Client.Watch(wctx, e.cfg.Prefix, clientv3.WithPrefix())
	tick := time.NewTicker(e.cfg.TTL / 2)
	defer tick.Stop()
	for {
		select {
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				return
			}
		case <-tick.C:
		case <-ctx.Done():
			return
		}
		if !get() {
			return
		}
	}
}

func (e *Elector) setFrom(resp *clientv3.GetResponse) {
	if len(resp.Kvs) == 0 {
		if e.cur.Load() == nil {
			e.current.Store(nil)
		}
		return
	}
	kv := resp.Kvs[0]
	var l Leader
	if json.Unmarshal(kv.Value, &l) != nil {
		return
	}
	l.Epoch = kv.CreateRevision
	e.current.Store(&l)
}
