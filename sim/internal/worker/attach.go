package worker

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Reconnect backoff of the command watcher (jittered): a sidecar restart is found within
// attachBackoffMax of its socket coming back. A sidecar without WatchCommands (UNIMPLEMENTED)
// is asked again every attachUnimplementedWait.
const (
	attachBackoffMin        = 50 * time.Millisecond
	attachBackoffMax        = time.Second
	attachUnimplementedWait = 10 * time.Second
)

// attacher is the worker's half of the re-attach protocol (WorkerBridge WatchCommands /
// AckCommand): a standing command stream to the sidecar, reopened with backoff whenever it
// breaks. When a (restarted) sidecar's attach status says it holds no pool, the worker
// registers its pool again and re-commits every resident session, then acknowledges the
// attach status; it carries out the sidecar's release commands (capacity release) and
// acknowledges each.
type attacher struct {
	instance string
	once     sync.Once
	cancel   context.CancelFunc
	done     chan struct{}

	mu       sync.Mutex
	sidecar  string // instance id of the sidecar attached to
	attaches int    // attach statuses received
	reattach int    // of which asked for a re-registration
}

// initAttach prepares the attacher and takes the pool file's name out of its directory (the
// pool lives on as long as this process; kill -9 leaves nothing in /dev/shm; the sidecar maps
// it through /proc/<pid>/fd/<n>). Called by New.
func (w *Worker) initAttach() error {
	w.att.instance = fmt.Sprintf("kvc-sim/%s/pid-%d/%d", w.cfg.WorkerID, os.Getpid(), time.Now().UnixNano())
	w.att.done = make(chan struct{})
	if w.mem != nil {
		if err := w.mem.Unlink(); err != nil {
			return err
		}
	}
	return nil
}

// startAttach starts the command watcher once (after the first successful RegisterKVPool); it
// runs until Close.
func (w *Worker) startAttach() {
	w.att.once.Do(func() {
		ctx, cancel := context.WithCancel(context.Background())
		w.att.cancel = cancel
		go func() {
			defer close(w.att.done)
			w.runAttach(ctx)
		}()
	})
}

// stopAttach stops the watcher and waits for it (Close).
func (w *Worker) stopAttach() {
	started := false
	w.att.once.Do(func() {}) // a watcher not started yet never starts
	if w.att.cancel != nil {
		w.att.cancel()
		started = true
	}
	if started {
		<-w.att.done
	}
}

// AttachInfo is what the watcher saw (tests, GET /kvc/attach).
type AttachInfo struct {
	SidecarInstance string `json:"sidecar_instance"`
	Attaches        int    `json:"attaches"`
	Reregistrations int    `json:"reregistrations"`
}

// Attach reports the watcher's state.
func (w *Worker) Attach() AttachInfo {
	w.att.mu.Lock()
	defer w.att.mu.Unlock()
	return AttachInfo{SidecarInstance: w.att.sidecar, Attaches: w.att.attaches, Reregistrations: w.att.reattach}
}

func (w *Worker) runAttach(ctx context.Context) {
	backoff := attachBackoffMin
	failures := 0 // in a row, for the log: the first and every 20th
	for ctx.Err() == nil {
		attached, err := w.watchOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if attached {
			backoff, failures = attachBackoffMin, 0
		}
		failures++
		wait := backoff/2 + rand.N(backoff/2+1)
		switch {
		case status.Code(err) == codes.Unimplemented:
			wait = attachUnimplementedWait
			if failures == 1 {
				w.log.Warn().Err(err).Msg("sidecar has no WatchCommands: no re-attach after a sidecar restart")
			}
		case failures%20 == 1:
			w.log.Warn().Err(err).Int("attempt", failures).Dur("retry_in", wait).Msg("command watcher broke; reconnecting")
		default:
			w.log.Debug().Err(err).Int("attempt", failures).Dur("retry_in", wait).Msg("command watcher broke; reconnecting")
		}
		if sleepCtx(ctx, wait) != nil {
			return
		}
		backoff = min(2*backoff, attachBackoffMax)
	}
}

// watchOnce runs one WatchCommands stream until it breaks; attached reports whether the
// attach status was received and handled.
func (w *Worker) watchOnce(ctx context.Context) (attached bool, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := w.bridge.WatchCommands(sctx, &kvcv1.WatchCommandsRequest{WorkerInstance: w.att.instance})
	if err != nil {
		return false, err
	}
	first, err := stream.Recv()
	if err != nil {
		return false, err
	}
	st := first.GetAttach()
	if st == nil {
		return false, fmt.Errorf("first WatchCommands message is %T, not an attach status", first.GetCommand())
	}
	w.att.mu.Lock()
	w.att.sidecar = st.GetSidecarInstance()
	w.att.attaches++
	if !st.GetPoolRegistered() {
		w.att.reattach++
	}
	w.att.mu.Unlock()
	ack := &kvcv1.AckCommandRequest{CommandId: first.GetCommandId(), Ok: true}
	if !st.GetPoolRegistered() {
		n, err := w.reattach(sctx)
		if err != nil {
			return false, err
		}
		w.log.Warn().Str("sidecar_instance", st.GetSidecarInstance()).Int("sessions_recommitted", n).
			Msg("sidecar restarted: KV pool registered again and resident sessions re-committed")
	}
	if err := w.ack(sctx, ack); err != nil {
		return false, err
	}
	w.log.Info().Str("sidecar_instance", st.GetSidecarInstance()).Bool("pool_registered", st.GetPoolRegistered()).
		Int32("resident_sessions", st.GetResidentSessions()).Msg("attached to the sidecar")
	for {
		m, err := stream.Recv()
		if err != nil {
			return true, err
		}
		w.command(sctx, m)
	}
}

func (w *Worker) ack(ctx context.Context, a *kvcv1.AckCommandRequest) error {
	actx, cancel := context.WithTimeout(ctx, w.cfg.BridgeTimeout)
	defer cancel()
	_, err := w.bridge.AckCommand(actx, a, grpc.WaitForReady(true))
	return err
}

// reattach registers the pool with a sidecar that lost it and commits every session this
// worker holds: those the sidecar knew (committed once), and those no sidecar ever knew
// although no turn uses them any more — a turn whose CommitSession failed while the sidecar
// was down leaves its session held here and tracked by nobody (issue 23 item 6: 7 such
// sessions after all sidecars restarted). They are adopted: the sidecar reports them in its
// resync and the control plane keeps or releases them like any other copy. It returns how many.
func (w *Worker) reattach(ctx context.Context) (int, error) {
	if _, err := w.RegisterPool(ctx); err != nil {
		return 0, err
	}
	type commit struct {
		s     *session
		id    string
		kv    int64
		pages []int64
		adopt bool
	}
	w.mu.Lock()
	var cs []commit
	for _, s := range w.sessions {
		if s.kvLen <= 0 || (!s.committed && s.pinned > 0) {
			continue // a running turn commits its session when it finishes
		}
		n := pagesFor(s.kvLen, w.cfg.Geometry.PageSize)
		if int64(len(s.pages)) < n {
			continue
		}
		cs = append(cs, commit{s, s.id, s.kvLen, append([]int64(nil), s.pages[:n]...), !s.committed})
	}
	w.mu.Unlock()
	done, adopted := 0, 0
	for _, c := range cs {
		cctx, cancel := context.WithTimeout(ctx, w.cfg.BridgeTimeout)
		_, err := w.bridge.CommitSession(cctx, &kvcv1.CommitSessionRequest{SessionId: c.id, CommittedLen: c.kv, Pages: c.pages})
		cancel()
		if err == nil && c.adopt {
			w.mu.Lock()
			c.s.committed = true
			w.mu.Unlock()
			adopted++
		}
		switch {
		case err == nil:
			done++
		case status.Code(err) == codes.FailedPrecondition:
			// a turn that finished meanwhile committed a longer length first
			done++
		default:
			if ctx.Err() != nil {
				return done, ctx.Err()
			}
			w.m.bridgeErrors.WithLabelValues("CommitSession").Inc()
			w.log.Error().Err(err).Str("session", c.id).Msg("re-commit after the sidecar restarted failed")
		}
	}
	if adopted > 0 {
		w.log.Warn().Int("sessions", adopted).Msg("sessions no sidecar knew (their commit failed while it was down) committed to the restarted sidecar")
	}
	return done, nil
}

// command carries out one sidecar command and acknowledges it.
func (w *Worker) command(ctx context.Context, m *kvcv1.WatchCommandsResponse) {
	ack := &kvcv1.AckCommandRequest{CommandId: m.GetCommandId()}
	switch c := m.GetCommand().(type) {
	case *kvcv1.WatchCommandsResponse_Release:
		freed, err := w.releaseForSidecar(c.Release.GetSessionId(), m.GetReason())
		if err != nil {
			ack.Error = err.Error()
		} else {
			ack.Ok, ack.FreedTokens = true, freed
		}
	case *kvcv1.WatchCommandsResponse_Truncate:
		ack.Error = "kvc-sim does not truncate sessions"
	default:
		ack.Error = fmt.Sprintf("unknown command %T", c)
	}
	if err := w.ack(ctx, ack); err != nil {
		w.log.Warn().Err(err).Uint64("command_id", m.GetCommandId()).Msg("AckCommand failed")
	}
}

// idleOtherLocked reports whether a committed session other than s holds pages no request
// uses (w.mu held): one the sidecar's capacity release can take instead of s.
func (w *Worker) idleOtherLocked(s *session) bool {
	for _, o := range w.sessions {
		if o != s && o.pinned == 0 && o.committed && len(o.pages) > 0 {
			return true
		}
	}
	return false
}

// releaseForSidecar frees a session the sidecar asked to release (capacity release): refused
// while a request uses it; otherwise ReleaseSession (reason EVICTED) and its pages freed, as
// for an eviction. It returns the tokens freed. A capacity release of a session whose turns
// only wait for pages is refused while another idle session could be released instead (the
// SGLang plugin's release_for_capacity sees its queued requests the same way).
func (w *Worker) releaseForSidecar(id string, reason kvcv1.WorkerCommandReason) (int64, error) {
	w.allocMu.Lock() // not concurrently with an allocation's eviction
	defer w.allocMu.Unlock()
	w.mu.Lock()
	s := w.sessions[id]
	switch {
	case s == nil:
		w.mu.Unlock()
		return 0, fmt.Errorf("session %s is not resident", id)
	case s.pinned > s.waiting:
		n := s.pinned - s.waiting
		w.mu.Unlock()
		return 0, fmt.Errorf("session %s is in use by %d running request(s)", id, n)
	case s.waiting > 0 && reason == kvcv1.WorkerCommandReason_WORKER_COMMAND_REASON_CAPACITY && w.idleOtherLocked(s):
		// Its turn waits for a few pages; releasing it turns that turn into a reseed of the
		// whole context into the same full pool (issue 20: 141 of 311 turns retried so, 2-6 s
		// TTFT). Another session no request uses gives room without it: the sidecar takes that
		// one (it passes over a refused session until its next commit).
		n := s.waiting
		w.mu.Unlock()
		return 0, fmt.Errorf("session %s is in use by %d turn(s) waiting for pages, and an idle session can be released instead", id, n)
	}
	// Only turns still waiting for pages use it (or none): they find it gone and answer 409
	// (generate.go), as a queued turn of a slot the SGLang plugin released re-prefills.
	delete(w.sessions, id)
	kv := s.kvLen
	w.mu.Unlock()
	w.log.Info().Str("session", id).Int64("kv_len", kv).Stringer("reason", reason).Msg("releasing session on the sidecar's command")
	w.m.evictions.Inc()
	if s.committed {
		if err := w.release(id, kvcv1.ReleaseReason_RELEASE_REASON_EVICTED); err != nil {
			w.mu.Lock()
			w.quarantined += int64(len(s.pages)) // the sidecar may still read them
			w.mu.Unlock()
			return 0, fmt.Errorf("ReleaseSession of %s: %v", id, err)
		}
	}
	w.freePages(s.pages)
	return kv, nil
}
