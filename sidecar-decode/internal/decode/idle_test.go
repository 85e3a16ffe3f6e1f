package decode

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// syncBuffer is a bytes.Buffer safe for the event log's writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// fakeTimers is an injected afterFunc: the test fires the armed timers itself.
type fakeTimers struct {
	mu     sync.Mutex
	timers []*fakeTimer
}

type fakeTimer struct {
	d       time.Duration
	f       func()
	stopped bool
}

func (t *fakeTimer) Stop() bool {
	was := !t.stopped
	t.stopped = true
	return was
}

func (ft *fakeTimers) after(d time.Duration, f func()) idleTimer {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	t := &fakeTimer{d: d, f: f}
	ft.timers = append(ft.timers, t)
	return t
}

// last is the most recently armed timer and how many were armed.
func (ft *fakeTimers) last() (*fakeTimer, int) {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	if len(ft.timers) == 0 {
		return nil, 0
	}
	return ft.timers[len(ft.timers)-1], len(ft.timers)
}

// TestIdleFlush: every commit re-arms the session's idle timer (the previous one stopped); when
// the timer of the newest commit fires, the unpushed tail below delta_tokens is queued, forced;
// a timer of an older commit, a session with nothing unpushed, without a target or released
// queues nothing; --snapshot-idle-flush 0 arms nothing.
func TestIdleFlush(t *testing.T) {
	ctx := context.Background()
	s := newTestSidecar(t) // delta 8 tokens, page size 4; Run is not started: queued pushes stay queued
	s.cfg.IdleFlush = 2 * time.Second
	ft := &fakeTimers{}
	s.after = ft.after
	var evlog syncBuffer
	s.ev = sidecar.NewEventLog(&evlog, "d", nil)
	target := func(sess string) {
		t.Helper()
		if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: sess, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
			t.Fatal(err)
		}
	}
	commit := func(sess string, n int64) bool {
		t.Helper()
		res, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: sess, CommittedLen: n, Pages: pages(int((n + 3) / 4))})
		if err != nil {
			t.Fatal(err)
		}
		return res.GetPushEnqueued()
	}
	state := func(sess string) (queue int, queued, forced bool) {
		s.mu.Lock()
		defer s.mu.Unlock()
		ss := s.sessions[sess]
		return len(s.queue), ss.queued, ss.forcePush
	}
	landed := func(sess string) { // what pushSession does when the queued push lands
		s.mu.Lock()
		ss := s.sessions[sess]
		ss.lastPushed, ss.queued, ss.forcePush = ss.committed, false, false
		s.queue = s.queue[:0]
		s.mu.Unlock()
	}

	target("a")
	if commit("a", 8) != true { // delta reached: queued as before
		t.Fatal("delta push not queued")
	}
	landed("a")
	if commit("a", 11) { // 3 unpushed tokens < delta 8
		t.Fatal("a 3-token tail queued below delta")
	}
	first, n := ft.last()
	if n != 2 || first.d != 2*time.Second || first.stopped {
		t.Fatalf("timers armed %d, last %+v; want 2, the last for 2s and running", n, first)
	}
	if commit("a", 13) { // still below delta; re-arms
		t.Fatal("a 5-token tail queued below delta")
	}
	second, n := ft.last()
	if n != 3 || !first.stopped || second.stopped {
		t.Fatalf("the commit did not re-arm: %d timers, previous stopped %v", n, first.stopped)
	}
	first.f() // an older commit's timer that fired while the newer commit re-armed: nothing
	if q, queued, forced := state("a"); q != 0 || queued || forced {
		t.Fatalf("an older commit's timer queued a push (queue %d, queued %v, forced %v)", q, queued, forced)
	}
	second.f() // idle for 2 s after 13 tokens: the 5-token tail goes out
	if q, queued, forced := state("a"); q != 1 || !queued || !forced {
		t.Fatalf("idle flush: queue %d, queued %v, forced %v; want the push queued and forced", q, queued, forced)
	}
	if got := s.IdleFlushes(); got != 1 {
		t.Fatalf("idle flushes %d, want 1", got)
	}
	if got := strings.Count(evlog.String(), `"event":"snapshot_idle_flush"`); got != 1 {
		t.Fatalf("%d snapshot_idle_flush events, want 1: %s", got, evlog.String())
	}
	second.f() // fired again (cannot happen with a real timer): the push is already queued
	if q, _, _ := state("a"); q != 1 {
		t.Fatalf("queue %d after a second fire, want 1", q)
	}
	landed("a")
	second.f() // nothing unpushed any more
	if q, queued, _ := state("a"); q != 0 || queued {
		t.Fatal("a current snapshot was pushed again")
	}

	// No snapshot target: nothing to push to, and no force left behind for a later commit.
	commit("b", 3)
	tb, _ := ft.last()
	tb.f()
	if q, queued, forced := state("b"); q != 0 || queued || forced {
		t.Fatalf("session without target: queue %d, queued %v, forced %v", q, queued, forced)
	}

	// Released: its timer is stopped, and a fire that raced the release does nothing.
	target("c")
	commit("c", 5)
	tc, _ := ft.last()
	if _, err := s.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "c"}); err != nil {
		t.Fatal(err)
	}
	if !tc.stopped {
		t.Fatal("the released session's timer still runs")
	}
	tc.f()
	s.mu.Lock()
	q := len(s.queue)
	s.mu.Unlock()
	if q != 0 || s.IdleFlushes() != 1 {
		t.Fatalf("a released session was flushed (queue %d, flushes %d)", q, s.IdleFlushes())
	}

	// Off: no timer armed at all.
	s.cfg.IdleFlush = 0
	_, before := ft.last()
	commit("a", 14)
	if _, after := ft.last(); after != before {
		t.Fatalf("idle flush 0 armed a timer (%d → %d)", before, after)
	}
}

// TestIdleFlushRealTimer: with the real clock, a session left idle below the delta gets its
// push queued (the test waits on the queue's wake channel, not on a sleep).
func TestIdleFlushRealTimer(t *testing.T) {
	ctx := context.Background()
	s := newTestSidecar(t)
	s.cfg.IdleFlush = 20 * time.Millisecond
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "a", PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	if res, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 5, Pages: pages(2)}); err != nil || res.GetPushEnqueued() {
		t.Fatalf("commit: %v %v", res, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	id, ok := s.next(wctx)
	if !ok || id != "a" {
		t.Fatalf("next push %q %v; want a's idle flush", id, ok)
	}
}
