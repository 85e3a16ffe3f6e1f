package sidecar

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// AttachSettle bounds how long a sidecar whose fresh attach status told the worker to register
// again (pool_registered=false) waits, once the pool is registered, for the worker to
// acknowledge that attach status (after it re-committed every resident session) before it
// calls itself ready and connects to the control plane. A worker that never acknowledges (an
// older client) only delays readiness by this much.
const AttachSettle = 3 * time.Second

// watchQueue is how many commands may wait for a watcher's stream.
const watchQueue = 64

// maxWorkerInstance bounds WatchCommandsRequest.worker_instance.
const maxWorkerInstance = 256

// AttachState is what a sidecar core tells its Attach about itself for an attach status.
type AttachState func() (poolRegistered bool, residentSessions int32)

// Attach is a sidecar's half of the worker–sidecar re-attach protocol (WorkerBridge
// WatchCommands / AckCommand): it keeps the worker's one command stream (a newer watcher
// replaces an older one), opens every stream with an AttachStatus carrying this process's
// random instance id, delivers commands (release, truncate) and matches their acks, and decides
// when the sidecar is ready: once the pool is registered and — when the attach status told the
// worker to re-register — the worker acknowledged that status (or AttachSettle passed). Both
// sidecar cores embed one; it is safe for concurrent use.
type Attach struct {
	instance string
	log      zerolog.Logger
	state    AttachState

	registered chan struct{}
	regOnce    sync.Once
	closed     chan struct{}
	closeOnce  sync.Once

	mu       sync.Mutex
	cur      *watcher
	nextID   uint64
	pending  map[uint64]*pendingCmd
	pool     bool // the pool is registered (PoolRegistered was called)
	settling bool // a goroutine waits for the attach ack before readiness
}

type watcher struct {
	instance   string
	since      time.Time
	out        chan *kvcv1.WatchCommandsResponse
	done       chan struct{} // closed when the stream ends or is replaced
	attachID   uint64
	attachPool bool          // the attach status said pool_registered
	acked      chan struct{} // closed when the worker acknowledged the attach status
	ackOnce    sync.Once
	endOnce    sync.Once
}

func (w *watcher) end() { w.endOnce.Do(func() { close(w.done) }) }

type pendingCmd struct {
	w  *watcher
	ch chan *kvcv1.AckCommandRequest // buffered 1: the ack, or nil when the watcher ended
}

// NewAttach builds an Attach with a random instance id; state reports the core's pool and
// resident sessions for each attach status.
func NewAttach(state AttachState, log zerolog.Logger) *Attach {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return &Attach{instance: hex.EncodeToString(b[:]), log: log, state: state, registered: make(chan struct{}),
		closed: make(chan struct{}), pending: map[uint64]*pendingCmd{}, nextID: 1}
}

// Close ends every watcher stream (UNAVAILABLE, "sidecar shutting down") so that the bridge
// server's graceful stop does not wait for them; later streams end at once. The cores call it
// when their Run returns.
func (a *Attach) Close() { a.closeOnce.Do(func() { close(a.closed) }) }

// Instance is this sidecar process's random id (AttachStatus.sidecar_instance).
func (a *Attach) Instance() string { return a.instance }

// Registered is closed once the pool is registered and the attach settled (Core.Registered).
func (a *Attach) Registered() <-chan struct{} { return a.registered }

// PoolRegistered is called by the core after every successful RegisterKVPool. The first call
// makes the sidecar ready at once — unless the current watcher's attach status said
// pool_registered=false and the worker has not acknowledged it yet: then readiness waits for
// that acknowledgement (the worker re-commits its sessions first), the watcher's end, or
// AttachSettle, whichever comes first.
func (a *Attach) PoolRegistered() {
	a.mu.Lock()
	a.pool = true
	w := a.cur
	a.mu.Unlock()
	select {
	case <-a.registered:
		return
	default:
	}
	if w == nil || w.attachPool {
		a.ready("")
		return
	}
	select {
	case <-w.acked:
		a.ready("")
		return
	default:
	}
	a.mu.Lock()
	if a.settling {
		a.mu.Unlock()
		return // a waiter runs already
	}
	a.settling = true
	a.mu.Unlock()
	go func() {
		t := time.NewTimer(AttachSettle)
		defer t.Stop()
		why := ""
		select {
		case <-w.acked:
		case <-w.done:
			why = "watcher ended before acknowledging the attach status"
		case <-t.C:
			why = fmt.Sprintf("no acknowledgement of the attach status within %v", AttachSettle)
		}
		a.ready(why)
	}()
}

func (a *Attach) ready(why string) {
	a.regOnce.Do(func() {
		if why != "" {
			a.log.Warn().Str("reason", why).Msg("ready without the worker's re-commit confirmation")
		}
		close(a.registered)
	})
}

// WaitingFor says what the sidecar waits for before it is ready ("" when ready): the text of
// /readyz and of the start-up log line.
func (a *Attach) WaitingFor() string {
	select {
	case <-a.registered:
		return ""
	default:
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case !a.pool && a.cur == nil:
		return "waiting for worker to register its KV pool (no watcher connected)"
	case !a.pool:
		return fmt.Sprintf("waiting for worker to register its KV pool (worker %s watching since %s)", a.cur.instance, a.cur.since.UTC().Format(time.RFC3339))
	default:
		return "waiting for worker to re-commit its resident sessions (attach status not acknowledged yet)"
	}
}

// WatcherInfo describes the current watcher (GET /v1/status).
type WatcherInfo struct {
	Connected      bool   `json:"connected"`
	WorkerInstance string `json:"worker_instance,omitempty"`
	SinceUnixMs    int64  `json:"since_unix_ms,omitempty"`
	AttachAcked    bool   `json:"attach_acked,omitempty"`
}

// Watcher describes the current watcher.
func (a *Attach) Watcher() WatcherInfo {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cur == nil {
		return WatcherInfo{}
	}
	wi := WatcherInfo{Connected: true, WorkerInstance: a.cur.instance, SinceUnixMs: a.cur.since.UnixMilli()}
	select {
	case <-a.cur.acked:
		wi.AttachAcked = true
	default:
	}
	return wi
}

// Watch serves WatchCommands: the attach status first, then commands, until the worker goes
// away, a newer watcher replaces this one (ABORTED) or ctx ends.
func (a *Attach) Watch(req *kvcv1.WatchCommandsRequest, stream grpc.ServerStreamingServer[kvcv1.WatchCommandsResponse]) error {
	if n := len(req.GetWorkerInstance()); n > maxWorkerInstance {
		return status.Errorf(codes.InvalidArgument, "worker_instance of %d bytes (at most %d)", n, maxWorkerInstance)
	}
	reg, resident := a.state()
	w := &watcher{instance: req.GetWorkerInstance(), since: time.Now(), out: make(chan *kvcv1.WatchCommandsResponse, watchQueue),
		done: make(chan struct{}), acked: make(chan struct{}), attachPool: reg}
	a.mu.Lock()
	old := a.cur
	a.cur = w
	w.attachID = a.nextID
	a.nextID++
	a.mu.Unlock()
	if old != nil {
		old.end()
		a.log.Info().Str("old", old.instance).Str("new", w.instance).Msg("a newer command watcher replaces the old one")
	}
	defer func() {
		w.end()
		a.mu.Lock()
		if a.cur == w {
			a.cur = nil
		}
		for id, p := range a.pending {
			if p.w == w {
				delete(a.pending, id)
				p.ch <- nil
			}
		}
		a.mu.Unlock()
	}()
	a.log.Info().Str("worker_instance", w.instance).Bool("pool_registered", reg).Int32("resident_sessions", resident).Msg("worker attached (command watcher)")
	if err := stream.Send(&kvcv1.WatchCommandsResponse{CommandId: w.attachID, Command: &kvcv1.WatchCommandsResponse_Attach{
		Attach: &kvcv1.AttachStatus{SidecarInstance: a.instance, PoolRegistered: reg, ResidentSessions: resident}}}); err != nil {
		return err
	}
	ctx := stream.Context()
	for {
		select {
		case <-a.closed:
			return status.Error(codes.Unavailable, "sidecar shutting down")
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-w.done:
			return status.Error(codes.Aborted, "replaced by a newer command watcher")
		case m := <-w.out:
			if err := stream.Send(m); err != nil {
				return err
			}
		}
	}
}

// Ack serves AckCommand: the result of a command, or the worker's acknowledgement of its
// attach status (after re-registering and re-committing, or at once when nothing was needed).
func (a *Attach) Ack(req *kvcv1.AckCommandRequest) (*kvcv1.AckCommandResponse, error) {
	a.mu.Lock()
	if p, ok := a.pending[req.GetCommandId()]; ok {
		delete(a.pending, req.GetCommandId())
		a.mu.Unlock()
		p.ch <- req
		return &kvcv1.AckCommandResponse{}, nil
	}
	w := a.cur
	a.mu.Unlock()
	if w != nil && w.attachID == req.GetCommandId() {
		w.ackOnce.Do(func() { close(w.acked) })
		return &kvcv1.AckCommandResponse{}, nil
	}
	return nil, status.Errorf(codes.NotFound, "command %d unknown (already acknowledged, or its watcher is gone)", req.GetCommandId())
}

// ErrNoWatcher is returned by Send when no worker watches commands.
var ErrNoWatcher = status.Error(codes.FailedPrecondition, "no worker is watching commands (WatchCommands)")

// Send delivers a command (its command_id is filled in) to the current watcher and waits for
// the worker's ack. It fails when no watcher is connected, the watcher ends first or ctx ends.
func (a *Attach) Send(ctx context.Context, m *kvcv1.WatchCommandsResponse) (*kvcv1.AckCommandRequest, error) {
	a.mu.Lock()
	w := a.cur
	if w == nil {
		a.mu.Unlock()
		return nil, ErrNoWatcher
	}
	id := a.nextID
	a.nextID++
	m.CommandId = id
	p := &pendingCmd{w: w, ch: make(chan *kvcv1.AckCommandRequest, 1)}
	select {
	case w.out <- m:
	default:
		a.mu.Unlock()
		return nil, status.Errorf(codes.ResourceExhausted, "%d commands already wait for the worker", watchQueue)
	}
	a.pending[id] = p
	a.mu.Unlock()
	select {
	case ack := <-p.ch:
		if ack == nil {
			return nil, status.Errorf(codes.Unavailable, "the worker's command watcher ended before acknowledging command %d", id)
		}
		return ack, nil
	case <-ctx.Done():
		a.mu.Lock()
		delete(a.pending, id)
		a.mu.Unlock()
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// Status is a sidecar's GET /v1/status: the attach state and the registered pool's shape.
type Status struct {
	WorkerID        string      `json:"worker_id"`
	SidecarInstance string      `json:"sidecar_instance"`
	Ready           bool        `json:"ready"`
	WaitingFor      string      `json:"waiting_for,omitempty"`
	Watcher         WatcherInfo `json:"watcher"`
	PoolRegistered  bool        `json:"pool_registered"`
	Layout          string      `json:"layout,omitempty"`
	NumLayers       int32       `json:"num_layers,omitempty"`
	Buffers         int         `json:"buffers,omitempty"`
	PageSize        int32       `json:"page_size,omitempty"`
	PageCount       int64       `json:"page_count,omitempty"`
	ItemLen         int64       `json:"item_len,omitempty"`
	TPRank          int32       `json:"tp_rank"`
	TPSize          int32       `json:"tp_size"`
	AuxItemLens     []int64     `json:"aux_item_lens,omitempty"`
}

// Status describes the attach state and pool (nil before registration).
func (a *Attach) Status(workerID string, p *kvxfer.Pool) Status {
	st := Status{WorkerID: workerID, SidecarInstance: a.instance, WaitingFor: a.WaitingFor(), Watcher: a.Watcher(), TPSize: 1}
	st.Ready = st.WaitingFor == ""
	if p != nil {
		st.PoolRegistered = true
		st.Layout, st.NumLayers, st.Buffers, st.PageSize, st.PageCount, st.ItemLen = p.LayoutName(), p.NumLayers, p.Buffers(), p.PageSize, p.PageCount, p.ItemLen
		st.TPRank, st.TPSize, st.AuxItemLens = p.TPRank, max(p.TPSize, 1), p.AuxItemLens
	}
	return st
}
