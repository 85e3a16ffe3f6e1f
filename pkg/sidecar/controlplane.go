package sidecar

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Handler is what a sidecar gives the control-plane loop. Every method must be quick: Apply must
// not wait for a transfer (start it and return).
type Handler interface {
	// Hello returns the sidecar's hello (last_epoch_seen is filled in by the loop).
	Hello() *kvcv1.Hello
	// Resync returns the sidecar's full residency truth (full_sync is set by the loop).
	Resync() *kvcv1.ResidentSessions
	// Load returns the current load report.
	Load() *kvcv1.WorkerLoad
	// Policy is called with the policy of every welcome and UpdatePolicyCommand.
	Policy(p *kvcv1.Policy)
	// Apply carries out a command (at most once per command; epoch already checked).
	Apply(ctx context.Context, cmd *kvcv1.Command) error
}

// CPConfig configures the control-plane loop.
type CPConfig struct {
	Endpoints []string
	// Heartbeat is the load report interval (1s).
	Heartbeat time.Duration
	// Backoff bounds the reconnect delay (50ms..cpclient.DefaultBackoffMax, jittered).
	BackoffMin, BackoffMax time.Duration
	// DialOptions override the default (insecure) transport credentials.
	DialOptions []grpc.DialOption
	// Lease is the control planes' election TTL (0: cpclient.DefaultLease): a control plane
	// that answers nothing for half of it is left for the next endpoint (cpclient.Liveness),
	// and not dialled again for a lease.
	Lease time.Duration
	// EventBuffer bounds the session events kept while the stream is down or slow
	// (DefaultEventBuffer); when full the oldest is dropped and counted.
	EventBuffer int
	// Registerer takes the loop's metrics (may be nil).
	Registerer prometheus.Registerer
}

// ControlPlane keeps one Connect stream to the control-plane leader alive: it follows leader
// hints, reconnects with jittered backoff, sends hello and a full resync on every connection,
// heartbeats load, reports session events and applies commands at most once, only with an epoch
// at least the highest seen, acking each.
//
// Session events are buffered (bounded, oldest dropped first) and sent in the order raised.
// Events raised while no stream was up are sent on the next connection right after the hello,
// before the full resync, so that the resync — the sidecar's residency truth at that moment — is
// what the control plane applies last; events raised after the resync follow it.
type ControlPlane struct {
	cfg CPConfig
	h   Handler
	log zerolog.Logger

	events *eventBuffer

	mu        sync.Mutex
	maxEpoch  int64
	applied   map[cmdKey]appliedResult
	order     []cmdKey
	connected bool
	leader    string
	connects  int
	connCh    chan struct{} // closed and replaced on every successful welcome

	// worker process health (SetWorkerDown), stamped on every hello and load report
	workerDown   bool
	workerReason string
	loadKick     chan struct{} // cap 1: send a load report now
}

type cmdKey struct {
	epoch int64
	id    uint64
}

type appliedResult struct{ err string }

const maxRemembered = 4096

// NewControlPlane builds the loop; call Run.
func NewControlPlane(cfg CPConfig, h Handler, log zerolog.Logger) *ControlPlane {
	if cfg.Heartbeat <= 0 {
		cfg.Heartbeat = time.Second
	}
	return &ControlPlane{
		cfg: cfg, h: h, log: log,
		events:   newEventBuffer(cfg.EventBuffer, cfg.Registerer),
		applied:  map[cmdKey]appliedResult{},
		connCh:   make(chan struct{}),
		loadKick: make(chan struct{}, 1),
	}
}

// SetWorkerDown records whether the worker process beside the sidecar is down (and why). The
// state goes in every hello and load report; a change is sent at once as a load report, not at
// the next heartbeat. It never blocks.
func (c *ControlPlane) SetWorkerDown(down bool, reason string) {
	if !down {
		reason = ""
	}
	c.mu.Lock()
	changed := c.workerDown != down || c.workerReason != reason
	c.workerDown, c.workerReason = down, reason
	c.mu.Unlock()
	if changed {
		select {
		case c.loadKick <- struct{}{}:
		default:
		}
	}
}

// load is the handler's load report stamped with the worker's health.
func (c *ControlPlane) load() *kvcv1.ConnectRequest {
	l := c.h.Load()
	if l == nil {
		l = &kvcv1.WorkerLoad{}
	}
	c.mu.Lock()
	l.WorkerDown, l.WorkerDownReason = c.workerDown, c.workerReason
	c.mu.Unlock()
	return &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Load{Load: &kvcv1.LoadReport{Load: l}}}
}

// Report queues a session event for the control plane; it never blocks. Events raised while
// disconnected are kept and sent on the next connection; when the buffer is full the oldest
// queued event is dropped (kvc_sidecar_cp_events_dropped_total).
func (c *ControlPlane) Report(ev *kvcv1.SessionEvent) {
	if ev.UnixMs == 0 {
		ev.UnixMs = time.Now().UnixMilli()
	}
	if d := c.events.push(ev); d != nil {
		c.log.Warn().Str("session", d.GetSessionId()).Stringer("kind", d.GetKind()).Msg("event buffer full; oldest event dropped")
	}
}

// KickLoad sends a load report now instead of at the next heartbeat: for a change the control
// plane's decisions read and should not see a heartbeat late (a decode sidecar's last waiting
// transfer room done: its transfer_queue_depth back to 0). It never blocks; kicks before the
// next report's send are one report.
func (c *ControlPlane) KickLoad() {
	select {
	case c.loadKick <- struct{}{}:
	default:
	}
}

// PendingEvents is the number of session events not yet sent.
func (c *ControlPlane) PendingEvents() int { return c.events.len() }

// MaxEpoch is the highest command/welcome epoch seen.
func (c *ControlPlane) MaxEpoch() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.maxEpoch
}

// Connected reports whether a stream is up and the address of the leader it goes to.
func (c *ControlPlane) Connected() (bool, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.connected, c.leader
}

// Connects counts successful connections (welcomes) so far.
func (c *ControlPlane) Connects() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.connects
}

// Run connects and reconnects until ctx is done. It returns nil on cancellation.
func (c *ControlPlane) Run(ctx context.Context) error {
	if len(c.cfg.Endpoints) == 0 {
		return errors.New("control plane: no endpoints")
	}
	return cpclient.Follow(ctx, cpclient.NewEndpoints(c.cfg.Endpoints), c.session,
		cpclient.WithBackoff(c.cfg.BackoffMin, c.cfg.BackoffMax),
		cpclient.WithLogger(c.log, "control plane stream ended"),
		cpclient.OnSilent(func(string) { c.events.silent.Inc() }))
}

// errStaleLeader ends a stream to a leader whose epoch is below one already seen.
var errStaleLeader = errors.New("control plane: leader epoch below the highest seen")

func (c *ControlPlane) session(ctx context.Context, addr string) (welcomed bool, err error) {
	opts := append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	opts = append(opts, c.cfg.DialOptions...)
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return false, fmt.Errorf("dial %s: %w", addr, err)
	}
	defer conn.Close()
	// A control plane that stops answering (paused, or its link frozen) ends the stream within
	// half a lease (cpclient.Liveness), whatever the stream was waiting for.
	wctx, stopWatch := cpclient.LivenessFor(c.cfg.Lease).Guard(ctx, conn)
	defer func() {
		if serr := stopWatch(); serr != nil {
			err = fmt.Errorf("%s: %w", addr, serr)
		}
	}()
	sctx, cancel := context.WithCancel(wctx)
	defer cancel()
	stream, err := kvcv1.NewSidecarServiceClient(conn).Connect(sctx)
	if err != nil {
		return false, err
	}
	hello := c.h.Hello()
	hello.LastEpochSeen = c.MaxEpoch()
	c.mu.Lock()
	hello.WorkerDown, hello.WorkerDownReason = c.workerDown, c.workerReason
	c.mu.Unlock()
	if err := stream.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: hello}}); err != nil {
		return false, recvErr(stream, err)
	}
	first, err := stream.Recv()
	if err != nil {
		return false, err
	}
	w := first.GetWelcome()
	if w == nil {
		return false, errors.New("control plane: first message is not a welcome")
	}
	if w.GetEpoch() < c.MaxEpoch() {
		return false, fmt.Errorf("%w (%d < %d)", errStaleLeader, w.GetEpoch(), c.MaxEpoch())
	}
	c.seeEpoch(w.GetEpoch())
	if w.GetPolicy() != nil {
		c.h.Policy(w.GetPolicy())
	}
	// Events raised while disconnected go first, in order: the resync that follows is the truth
	// at a later moment, so the control plane ends on it whatever those events said.
	if n, err := c.sendBuffered(stream, 0); err != nil {
		return false, recvErr(stream, err)
	} else if n > 0 {
		c.events.replayed.Add(float64(n))
		c.log.Info().Int("events", n).Msg("sent events raised while disconnected")
	}
	rs := c.h.Resync()
	rs.FullSync = true
	if err := stream.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_ResidentSessions{ResidentSessions: rs}}); err != nil {
		return false, recvErr(stream, err)
	}
	if err := stream.Send(c.load()); err != nil {
		return false, recvErr(stream, err)
	}
	c.mu.Lock()
	c.connected, c.leader = true, addr
	c.connects++
	close(c.connCh)
	c.connCh = make(chan struct{})
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.connected = false
		c.mu.Unlock()
	}()
	c.log.Info().Str("addr", addr).Int64("epoch", w.GetEpoch()).Str("leader", w.GetLeaderId()).
		Int("sessions", len(rs.GetSessions())).Int("snapshots", len(rs.GetSnapshots())).Msg("connected to control plane")

	acks := make(chan *kvcv1.CommandAck, 256)
	g, gctx := errgroup.WithContext(sctx)
	g.Go(func() error { // receive and apply commands
		for {
			m, err := stream.Recv()
			if err != nil {
				return err
			}
			cmd := m.GetCommand()
			if cmd == nil {
				continue
			}
			ack := c.apply(gctx, cmd)
			select {
			case acks <- ack:
			case <-gctx.Done():
				return gctx.Err()
			}
		}
	})
	g.Go(func() error { // the only sender
		t := time.NewTicker(c.cfg.Heartbeat)
		defer t.Stop()
		for {
			var msg *kvcv1.ConnectRequest
			select {
			case <-gctx.Done():
				return gctx.Err()
			case <-t.C:
				msg = c.load()
			case <-c.loadKick:
				msg = c.load()
			case <-c.events.ready:
				if _, err := c.sendBuffered(stream, eventBurst); err != nil {
					return err
				}
				if c.events.len() > 0 {
					c.events.signal() // more queued: take turns with acks and heartbeats
				}
				continue
			case a := <-acks:
				msg = &kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Ack{Ack: a}}
			}
			if err := stream.Send(msg); err != nil {
				return err
			}
		}
	})
	err = g.Wait()
	return true, err
}

// recvErr returns the stream's real status when Send failed with io.EOF.
func recvErr(stream grpc.BidiStreamingClient[kvcv1.ConnectRequest, kvcv1.ConnectResponse], sendErr error) error {
	if _, err := stream.Recv(); err != nil {
		return err
	}
	return sendErr
}

// eventBurst is how many events the sender sends before it looks at acks and heartbeats again.
const eventBurst = 64

// sendBuffered sends up to max queued events (all when max <= 0) in order. An event whose Send
// failed goes back to the front of the buffer with those not tried, for the next connection.
func (c *ControlPlane) sendBuffered(stream grpc.BidiStreamingClient[kvcv1.ConnectRequest, kvcv1.ConnectResponse], max int) (int, error) {
	evs := c.events.take(max)
	for i, ev := range evs {
		if err := stream.Send(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_SessionEvent{SessionEvent: ev}}); err != nil {
			c.events.putBack(evs[i:])
			return i, err
		}
	}
	return len(evs), nil
}

func (c *ControlPlane) seeEpoch(e int64) {
	c.mu.Lock()
	if e > c.maxEpoch {
		c.maxEpoch = e
	}
	c.mu.Unlock()
}

// apply runs a command at most once and only with a current epoch; it returns the ack.
// Each command is a span (cmdtrace.go), child of the decision that sent it.
func (c *ControlPlane) apply(ctx context.Context, cmd *kvcv1.Command) (ack *kvcv1.CommandAck) {
	ctx, span := startCommand(ctx, cmd)
	result := "applied"
	defer func() { endCommand(span, result, ack) }()
	k := cmdKey{cmd.GetEpoch(), cmd.GetCommandId()}
	c.mu.Lock()
	if cmd.GetEpoch() < c.maxEpoch {
		max := c.maxEpoch
		c.mu.Unlock()
		c.log.Warn().Uint64("command_id", k.id).Int64("epoch", k.epoch).Int64("max_epoch", max).Msg("stale command refused")
		result = "stale"
		return &kvcv1.CommandAck{CommandId: k.id, Ok: false, Error: fmt.Sprintf("stale epoch %d < %d", k.epoch, max)}
	}
	if r, dup := c.applied[k]; dup {
		c.mu.Unlock()
		result = "duplicate"
		return &kvcv1.CommandAck{CommandId: k.id, Ok: r.err == "", Error: r.err}
	}
	c.maxEpoch = cmd.GetEpoch()
	c.mu.Unlock()

	var err error
	if up := cmd.GetUpdatePolicy(); up != nil {
		c.h.Policy(up.GetPolicy())
	} else {
		err = c.h.Apply(ctx, cmd)
	}
	res := appliedResult{}
	if err != nil {
		res.err = err.Error()
		result = "error"
	}
	c.mu.Lock()
	c.applied[k] = res
	c.order = append(c.order, k)
	if len(c.order) > maxRemembered {
		delete(c.applied, c.order[0])
		c.order = c.order[1:]
	}
	c.mu.Unlock()
	return &kvcv1.CommandAck{CommandId: k.id, Ok: err == nil, Error: res.err}
}

// WaitConnected blocks until a connection count above after is reached or ctx is done.
func (c *ControlPlane) WaitConnected(ctx context.Context, after int) error {
	for {
		c.mu.Lock()
		n, ch := c.connects, c.connCh
		c.mu.Unlock()
		if n > after {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}
