package decode

import (
	"time"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
)

// evIdleFlush is the event of an idle flush that queued a push (counted in
// kvc_sidecar_events_total{event="snapshot_idle_flush"}).
const evIdleFlush = "snapshot_idle_flush"

// Idle flush (issue 14 item 7). Pushes go out when a session's unpushed tail reaches the delta
// threshold, so the snapshot of a session that stops mid-delta lags its KV by up to the
// threshold — and idle sessions are exactly those a full decode worker evicts (or the capacity
// release picks), whose next turn then reseeds from a snapshot that is too short
// (SNAPSHOT_STALE, a re-prefill). With Config.IdleFlush > 0 every commit re-arms a per-session
// timer; when it fires and no newer commit came, the unpushed tail is pushed whatever its size,
// as the capacity release does for the sessions it frees. A session that keeps committing (it
// is decoding) never fires it: only sessions idle for IdleFlush pay the extra push, once per
// idle period.

// idleTimer is a timer that can be stopped (*time.Timer).
type idleTimer interface {
	Stop() bool
}

// afterFunc arms a timer that calls f after d (time.AfterFunc; tests inject their own clock).
type afterFunc func(d time.Duration, f func()) idleTimer

func realAfterFunc(d time.Duration, f func()) idleTimer { return time.AfterFunc(d, f) }

// armIdleLocked re-arms ss's idle-flush timer after a commit (no-op when the flush is off).
func (s *Sidecar) armIdleLocked(ss *session) {
	if s.cfg.IdleFlush <= 0 {
		return
	}
	if ss.idle != nil {
		ss.idle.Stop()
	}
	ss.commits++
	seq := ss.commits
	ss.idle = s.after(s.cfg.IdleFlush, func() { s.idleFlush(ss, seq) })
}

// stopIdleLocked stops ss's idle-flush timer (the session is gone).
func (s *Sidecar) stopIdleLocked(ss *session) {
	if ss.idle != nil {
		ss.idle.Stop()
		ss.idle = nil
	}
}

// idleFlush runs when ss was idle for IdleFlush after its commit number seq: with no newer
// commit and an unpushed tail, it queues the push of the tail regardless of the delta threshold.
// It reports whether a push will carry the current commit.
func (s *Sidecar) idleFlush(ss *session, seq uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.gone || ss.commits != seq || ss.committed <= ss.lastPushed {
		return false
	}
	prev, pending := ss.forcePush, ss.queued
	ss.forcePush = true // a push running now re-queues the tail it does not carry (pushSession)
	if !s.maybeEnqueueLocked(ss) {
		ss.forcePush = prev // nowhere to push (no target, snapshots off, its push just failed)
		return false
	}
	if !pending { // counted when the flush queued the push (or re-queues it after a running one)
		s.idleFlushes++
		s.ev.Emit(sidecar.Event{Event: evIdleFlush, Session: ss.id, Generation: ss.target.GetGeneration(), BaseLen: ss.lastPushed,
			Tokens: ss.committed - ss.lastPushed, Peer: ss.target.GetPrefillWorkerId(), Reason: "idle " + s.cfg.IdleFlush.String()})
	}
	return true
}

// IdleFlushes is how many idle flushes queued a push so far.
func (s *Sidecar) IdleFlushes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.idleFlushes
}
