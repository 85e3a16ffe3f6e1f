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
	Log    zerolog.Logger
	Reg    prometheus.Registerer
}

// Elector campaigns for leadership and observes the current leader.
type Elector struct {
	cfg      Config
	current  atomic.Pointer[Leader]
	leading  atomic.Bool
	stepDown chan string
	changed  chan struct{}

	gLeader   prometheus.Gauge
	elections prometheus.Counter
	lost      *prometheus.CounterVec
}

// New returns an Elector. TTL is rounded up to whole seconds (etcd leases are in seconds).
func New(cfg Config) (*Elector, error) {
	if cfg.Client == nil || cfg.Prefix == "" || cfg.NodeID == "" {
		return nil, errors.New("election: client, prefix and node id are required")
	}
	if cfg.TTL < time.Second {
		return nil, fmt.Errorf("election: ttl %s is below 1s", cfg.TTL)
	}
	e := &Elector{
		cfg: cfg, stepDown: make(chan string, 1), changed: make(chan struct{}, 1),
		gLeader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_cp_leader", Help: "1 while this replica is the leader.",
		}),
		elections: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_cp_elections_won_total", Help: "Elections this replica won.",
		}),
		lost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_cp_leadership_lost_total", Help: "Terms ended, by reason (session_lost, step_down, lead_error, shutdown).",
		}, []string{"reason"}),
	}
	if cfg.Reg != nil {
		cfg.Reg.MustRegister(e.gLeader, e.elections, e.lost)
	}
	return e, nil
}

// Current returns the observed leader (ok false when none is known).
func (e *Elector) Current() (Leader, bool) {
	l := e.current.Load()
	if l == nil {
		return Leader{}, false
	}
	return *l, true
}

// IsLeader reports whether this replica leads now.
func (e *Elector) IsLeader() bool { return e.leading.Load() }

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
// after ctx is cancelled.
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
	sess, err := concurrency.NewSession(e.cfg.Client, concurrency.WithTTL(ttl), concurrency.WithContext(ctx))
	if err != nil {
		return 0, fmt.Errorf("session: %w", err)
	}
	defer func() { _ = sess.Close() }() // revokes the lease: our key (if any) goes at once
	el := concurrency.NewElection(sess, e.cfg.Prefix)

	cctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(sess.Ctx(), cancel)
	err = el.Campaign(cctx, val)
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
	fence := kvstore.Fence{Key: el.Key(), Rev: el.Rev()}
	e.elections.Inc()
	e.cfg.Log.Info().Int64("epoch", fence.Rev).Msg("elected leader")

	lctx, lcancel := context.WithCancel(ctx)
	reason := make(chan string, 1)
	go func() {
		select {
		case <-sess.Done():
			reason <- "session_lost"
		case r := <-e.stepDown:
			reason <- "step_down: " + r
		case <-lctx.Done():
			reason <- "shutdown"
		}
		lcancel()
	}()
	serving := func() {
		e.leading.Store(true)
		e.gLeader.Set(1)
		e.current.Store(&Leader{NodeID: e.cfg.NodeID, Addr: e.cfg.Addr, Epoch: fence.Rev})
	}
	lerr := lead(lctx, fence, serving)
	lcancel()
	why := <-reason
	e.leading.Store(false)
	e.gLeader.Set(0)
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
	if why != "shutdown" && why != "session_lost" {
		return e.cfg.TTL, nil // stepped down or deposed: let the other replica lead
	}
	return 0, nil
}

// Observe keeps Current up to date (the first-created key under the prefix) until ctx ends.
func (e *Elector) Observe(ctx context.Context) error {
	for ctx.Err() == nil {
		resp, err := e.cfg.Client.Get(ctx, e.cfg.Prefix, clientv3.WithFirstCreate()...)
		if err == nil {
			e.setFrom(resp)
			wch := e.cfg.Client.Watch(clientv3.WithRequireLeader(ctx), e.cfg.Prefix, clientv3.WithPrefix(),
				clientv3.WithRev(resp.Header.Revision+1))
			for wr := range wch {
				if wr.Err() != nil {
					break
				}
				r, err := e.cfg.Client.Get(ctx, e.cfg.Prefix, clientv3.WithFirstCreate()...)
				if err != nil {
					break
				}
				e.setFrom(r)
			}
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

func (e *Elector) setFrom(resp *clientv3.GetResponse) {
	if len(resp.Kvs) == 0 {
		if !e.leading.Load() {
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
