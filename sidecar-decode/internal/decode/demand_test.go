package decode

import (
	"context"
	"reflect"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestCapacityReleaseSeesDemand: a pool under the high watermark releases idle sessions when
// the worker reports requests waiting in its prealloc queue for more than it has free — enough
// for the deficit, in the release order — and nothing when the free room covers them.
func TestCapacityReleaseSeesDemand(t *testing.T) {
	cases := []struct {
		name    string
		demand  *kvcv1.ReportDemandRequest // nil: none reported
		release []string
		waiting []string
		deficit int64
	}{
		{name: "no demand", release: nil},
		{name: "demand within the free room", demand: &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 40, FreeTokens: 136}},
		{name: "queue drained", demand: &kvcv1.ReportDemandRequest{WaitingRequests: 0, WaitingTokens: 0, FreeTokens: 0}},
		// 120 of 256 tokens committed (high 128): under the watermark, but 200 tokens wait
		// with 136 free, 64 short: "old" (idle longest, 40) is not enough, "mid" (40) too.
		{name: "deficit", demand: &kvcv1.ReportDemandRequest{WaitingRequests: 2, WaitingTokens: 200, FreeTokens: 136},
			release: []string{"old", "mid"}, deficit: 64},
		// a deficit past every session idle longer than MinIdle takes the one committed just
		// now too (release on demand; before, it waited out MinIdle)
		{name: "deficit past the idle sessions", demand: &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 250, FreeTokens: 136},
			release: []string{"old", "mid", "busy"}, deficit: 114},
		// a deficit that one session covers releases one
		{name: "small deficit", demand: &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 150, FreeTokens: 136},
			release: []string{"old"}, deficit: 14},
		// the session ranked first needs a push: it is pushed, and the others wait for it
		{name: "deficit behind a push", demand: &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 150, FreeTokens: 136},
			waiting: []string{"behind"}, deficit: 14},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t) // 64 pages of 4 tokens: 256 tokens
			s.rel = newReleaser(ReleaseConfig{High: 0.5, Low: 0.25, MinIdle: time.Second})
			ctx := context.Background()
			now := time.Now()
			add := idleSessions(t, s, now)
			if tc.name == "deficit behind a push" {
				add("behind", 40, time.Hour, 32) // idlest, its snapshot 8 tokens behind
			} else {
				add("old", 40, time.Hour, 40)
			}
			add("mid", 40, time.Minute, 40)
			add("busy", 40, 0, 40) // committed just now: only for a deficit the others leave
			if tc.demand != nil {
				if _, err := s.ReportDemand(ctx, tc.demand); err != nil {
					t.Fatal(err)
				}
			}
			s.mu.Lock()
			p := s.planReleaseLocked(now)
			s.mu.Unlock()
			if p.Used != 120 || p.Deficit != tc.deficit || !reflect.DeepEqual(p.Release, tc.release) || !reflect.DeepEqual(p.Waiting, tc.waiting) {
				t.Fatalf("plan %+v; want release %v, waiting %v, deficit %d", p, tc.release, tc.waiting, tc.deficit)
			}
			if tc.waiting != nil {
				s.mu.Lock()
				b := s.sessions["behind"]
				forced := b.queued && b.forcePush
				s.mu.Unlock()
				if !forced {
					t.Fatal("the waiting session's push was not forced into the queue")
				}
			}
		})
	}
}

// TestReportDemandKicksRelease: a report of a deficit runs a release pass at once (no tick
// within the test's time), which releases through the worker's command stream.
func TestReportDemandKicksRelease(t *testing.T) {
	s := newTestSidecar(t)
	s.rel = newReleaser(ReleaseConfig{High: 0.5, Low: 0.25, MinIdle: time.Second, Interval: time.Hour})
	rep := chanReporter(make(chan *kvcv1.SessionEvent, 16))
	s.SetReporter(rep)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveBridge(t, s)
	rw := &releasingWorker{}
	done := make(chan struct{})
	go func() { defer close(done); rw.run(t, ctx, s, c) }()
	relDone := make(chan struct{})
	rctx, rcancel := context.WithCancel(ctx)
	go func() { defer close(relDone); s.runRelease(rctx) }()
	// The worker stops first (its in-flight calls then end in ctx's cancel, which it ignores);
	// stopping the release loop first would leave an ack in flight with its command gone.
	defer func() { cancel(); rcancel(); <-done; <-relDone }()
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "a", PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 40, Pages: []int64{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}}); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	a := s.sessions["a"]
	a.lastCommit, a.lastPushed, a.queued = time.Now().Add(-time.Minute), 40, false
	s.queue = s.queue[:0]
	s.mu.Unlock()
	for !s.att.Watcher().AttachAcked {
		select {
		case <-ctx.Done():
			t.Fatal("worker never attached")
		case <-time.After(5 * time.Millisecond):
		}
	}
	if _, err := c.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 240, FreeTokens: 216}); err != nil {
		t.Fatal(err)
	}
	for evicted := false; !evicted; {
		select {
		case ev := <-rep:
			evicted = ev.GetSessionId() == "a" && ev.GetKind() == kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED
		case <-ctx.Done():
			t.Fatalf("the deficit released nothing: %+v", s.Demand())
		}
	}
	if d := s.Demand(); d.Reports != 1 || d.DeficitReleasePasses < 1 || d.WaitingTokens != 240 {
		t.Fatalf("demand stats %+v", d)
	}
	if _, err := c.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: -1}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("negative demand: %v, want InvalidArgument", err)
	}
}

// idleSessions returns add(id, kv, idle, pushed): a session committed on s with kv tokens in
// pages of its own, its snapshot target set and pushed up to pushed, last committed idle before
// now, and no push queued — what the capacity release ranks.
func idleSessions(t *testing.T, s *Sidecar, now time.Time) func(id string, kv int64, idle time.Duration, pushed int64) {
	next := int64(0)
	return func(id string, kv int64, idle time.Duration, pushed int64) {
		t.Helper()
		ctx := context.Background()
		if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: id, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
			t.Fatal(err)
		}
		pg := make([]int64, (kv+3)/4)
		for i := range pg {
			pg[i], next = next, next+1
		}
		if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: id, CommittedLen: kv, Pages: pg}); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		ss := s.sessions[id]
		ss.lastCommit, ss.lastPushed, ss.queued = now.Add(-idle), pushed, false
		s.queue = s.queue[:0]
		s.mu.Unlock()
	}
}

// chanReporter hands each session event to the test.
type chanReporter chan *kvcv1.SessionEvent

func (r chanReporter) Report(ev *kvcv1.SessionEvent) { r <- ev }
func (chanReporter) KickLoad()                       {}

// TestLoadForwardsWorkerUnevictable: the worker's capacity report (ReportDemandRequest
// unevictable_tokens) and its prealloc queue (waiting_requests) reach the control plane in the
// load report, clamped to what the sidecar
// counts as used, gone when the worker dies; a report of demand without it, or a negative one,
// changes nothing else.
func TestLoadForwardsWorkerUnevictable(t *testing.T) {
	s := newTestSidecar(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveBridge(t, s)
	for _, sc := range []struct {
		id  string
		len int64
	}{{"a", 40}, {"b", 24}} {
		if _, err := c.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: sc.id, CommittedLen: sc.len, Pages: make([]int64, sc.len/4)}); err != nil {
			t.Fatal(err)
		}
	}
	if l := s.Load(); l.GetUsedTokens() != 64 || l.GetUnevictableTokens() != 0 {
		t.Fatalf("before any report: %v", l)
	}
	steps := []struct {
		name string
		req  *kvcv1.ReportDemandRequest
		want int64
		bad  bool
		// queue: the prealloc queue depth the load report forwards (issue 20: a reseed's
		// target is scored by it; before, it was always 0)
		queue int32
	}{
		{"a in use", &kvcv1.ReportDemandRequest{UnevictableTokens: 40}, 40, false, 0},
		{"more than used: clamped", &kvcv1.ReportDemandRequest{UnevictableTokens: 100}, 64, false, 0},
		{"negative refused", &kvcv1.ReportDemandRequest{UnevictableTokens: -1}, 64, true, 0},
		{"idle again", &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 8, FreeTokens: 100}, 0, false, 1},
		{"three wait", &kvcv1.ReportDemandRequest{WaitingRequests: 3, WaitingTokens: 300, FreeTokens: 100}, 0, false, 3},
		{"b in use", &kvcv1.ReportDemandRequest{UnevictableTokens: 24}, 24, false, 0},
	}
	for _, st := range steps {
		_, err := c.ReportDemand(ctx, st.req)
		if (status.Code(err) == codes.InvalidArgument) != st.bad {
			t.Fatalf("%s: %v", st.name, err)
		}
		if l := s.Load(); l.GetUnevictableTokens() != st.want || l.GetPreallocQueueDepth() != st.queue {
			t.Fatalf("%s: load says %d unevictable, prealloc queue %d; want %d, %d", st.name, l.GetUnevictableTokens(), l.GetPreallocQueueDepth(), st.want, st.queue)
		}
	}
	if d := s.Demand(); d.UnevictableTokens != 24 {
		t.Fatalf("demand stats %+v", d)
	}
	s.WorkerHealth(true, "test: process gone")
	if l := s.Load(); l.GetUnevictableTokens() != 0 || l.GetUsedTokens() != 0 {
		t.Fatalf("after the worker died: %v", l)
	}
}

// TestLoadForwardsRunningRequests: the worker's running requests and its prealloc queue
// (ReportDemandRequest running_requests, waiting_requests) reach the control plane in the load
// report as running_requests and waiting_requests (before, both were always 0 from a decode
// sidecar); a negative count is refused and changes nothing; a dead worker runs nothing.
func TestLoadForwardsRunningRequests(t *testing.T) {
	s := newTestSidecar(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveBridge(t, s)
	for _, st := range []struct {
		name             string
		req              *kvcv1.ReportDemandRequest
		bad              bool
		running, waiting int32
	}{
		{"two run", &kvcv1.ReportDemandRequest{RunningRequests: 2}, false, 2, 0},
		{"three run, one waits", &kvcv1.ReportDemandRequest{RunningRequests: 3, WaitingRequests: 1, WaitingTokens: 64, FreeTokens: 8}, false, 3, 1},
		{"negative refused", &kvcv1.ReportDemandRequest{RunningRequests: -1}, true, 3, 1},
		{"drained", &kvcv1.ReportDemandRequest{}, false, 0, 0},
		{"one runs", &kvcv1.ReportDemandRequest{RunningRequests: 1, UnevictableTokens: 8}, false, 1, 0},
	} {
		_, err := c.ReportDemand(ctx, st.req)
		if (status.Code(err) == codes.InvalidArgument) != st.bad {
			t.Fatalf("%s: %v", st.name, err)
		}
		if l := s.Load(); l.GetRunningRequests() != st.running || l.GetWaitingRequests() != st.waiting {
			t.Fatalf("%s: load says %d running, %d waiting; want %d, %d", st.name, l.GetRunningRequests(), l.GetWaitingRequests(), st.running, st.waiting)
		}
	}
	if d := s.Demand(); d.RunningRequests != 1 {
		t.Fatalf("demand stats %+v", d)
	}
	s.WorkerHealth(true, "test: process gone")
	if l := s.Load(); l.GetRunningRequests() != 0 || l.GetWaitingRequests() != 0 {
		t.Fatalf("after the worker died: %v", l)
	}
}

// TestPushLandingKicksRelease: a push that lands while requests wait for pages runs a pass at
// once — the session it made current may go, whether the release forced it or its own commit
// or idle flush queued it (before, only a forced push kicked: issue 20, E4 at 1P3D load 8, a
// committed session sat idle 0.36 s on average before its release while reseeds waited for its
// pages); one that failed, one landing with no deficit, or with the release off does not.
func TestPushLandingKicksRelease(t *testing.T) {
	for _, tc := range []struct {
		name          string
		ok, short, on bool
		kick          bool
	}{
		{"push landed, requests short of pages", true, true, true, true},
		{"push failed", false, true, true, false},
		{"no deficit", true, false, true, false},
		{"release off", true, true, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t)
			if tc.on {
				s.rel = newReleaser(ReleaseConfig{High: 0.9, Low: 0.5, MinIdle: time.Second, Interval: time.Hour})
			}
			s.mu.Lock()
			if tc.short {
				s.demand.requests, s.demand.tokens, s.demand.free = 1, 200, 100
			}
			s.pushLandedLocked(tc.ok)
			s.mu.Unlock()
			if kicked := drainKick(s); kicked != tc.kick {
				t.Fatalf("kicked %v, want %v", kicked, tc.kick)
			}
		})
	}
}

// drainKick reports whether a release pass was kicked, and takes the kick.
func drainKick(s *Sidecar) bool {
	select {
	case <-s.relKick:
		return true
	default:
		return false
	}
}

// TestCommitKicksReleaseWhileShort: a commit while requests wait for more pages than the
// worker has free runs a release pass at once (the session's turn ended: it is idle now, and
// the pass forces its push and releases it when that lands); without a deficit, or with the
// release off, a commit kicks nothing. Before, the committed session waited for the next tick
// or demand report.
func TestCommitKicksReleaseWhileShort(t *testing.T) {
	for _, tc := range []struct {
		name      string
		short, on bool
		kick      bool
	}{
		{"deficit", true, true, true},
		{"no deficit", false, true, false},
		{"release off", true, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t)
			if tc.on {
				s.rel = newReleaser(ReleaseConfig{High: 0.9, Low: 0.5, MinIdle: time.Second, Interval: time.Hour})
			}
			if tc.short {
				s.mu.Lock()
				s.demand.requests, s.demand.tokens, s.demand.free = 1, 200, 100
				s.mu.Unlock()
			}
			if _, err := s.CommitSession(context.Background(), &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 8, Pages: []int64{0, 1}}); err != nil {
				t.Fatal(err)
			}
			if kicked := drainKick(s); kicked != tc.kick {
				t.Fatalf("kicked %v, want %v", kicked, tc.kick)
			}
		})
	}
}

// TestReleasedCountsUntilTheNextReport: the sessions the capacity release freed count against
// the deficit until the worker's next demand report (which sees their pages free), so a pass
// that runs in between — a commit's kick right after a pass — does not release again for the
// same deficit; the next report replaces the count.
func TestReleasedCountsUntilTheNextReport(t *testing.T) {
	s := newTestSidecar(t) // 64 pages of 4 tokens: 256 tokens
	s.rel = newReleaser(ReleaseConfig{High: 0.9, Low: 0.5, MinIdle: time.Second, Interval: time.Hour})
	ctx := context.Background()
	now := time.Now()
	next := int64(0)
	for i, id := range []string{"a", "b", "c"} {
		if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: id, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
			t.Fatal(err)
		}
		pg := []int64{next, next + 1, next + 2, next + 3, next + 4, next + 5, next + 6, next + 7, next + 8, next + 9}
		next += 10
		if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: id, CommittedLen: 40, Pages: pg}); err != nil {
			t.Fatal(err)
		}
		s.mu.Lock()
		ss := s.sessions[id]
		ss.lastCommit, ss.lastPushed, ss.queued = now.Add(-time.Duration(3-i)*time.Minute), 40, false // a idlest
		s.queue = s.queue[:0]
		s.mu.Unlock()
	}
	// 50 tokens short: a and b go.
	if _, err := s.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 150, FreeTokens: 100}); err != nil {
		t.Fatal(err)
	}
	plan := func() ReleasePlan {
		s.mu.Lock()
		defer s.mu.Unlock()
		p := s.planReleaseLocked(now)
		for _, id := range p.Release {
			s.sessions[id].releasing = false // planned, not sent: the next plan may pick it again
		}
		return p
	}
	if p := plan(); p.Deficit != 50 || !reflect.DeepEqual(p.Release, []string{"a", "b"}) {
		t.Fatalf("first plan %+v", p)
	}
	// The worker carries out a's release (ReleaseSession of a session being released): before
	// its next report, 10 tokens are still short: one more session (b), not two.
	s.mu.Lock()
	s.sessions["a"].releasing = true
	s.mu.Unlock()
	if _, err := s.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "a", Reason: kvcv1.ReleaseReason_RELEASE_REASON_EVICTED}); err != nil {
		t.Fatal(err)
	}
	if p := plan(); p.Deficit != 10 || !reflect.DeepEqual(p.Release, []string{"b"}) {
		t.Fatalf("plan after a's release, before the report: %+v; want deficit 10, release [b]", p)
	}
	// The worker's next report sees a's pages free; its deficit is the whole truth again.
	if _, err := s.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 150, FreeTokens: 140}); err != nil {
		t.Fatal(err)
	}
	if p := plan(); p.Deficit != 10 || !reflect.DeepEqual(p.Release, []string{"b"}) {
		t.Fatalf("plan after the report: %+v", p)
	}
	if _, err := s.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 150, FreeTokens: 100}); err != nil {
		t.Fatal(err)
	}
	if p := plan(); p.Deficit != 50 || !reflect.DeepEqual(p.Release, []string{"b", "c"}) {
		t.Fatalf("plan after a report of 50 short: %+v", p)
	}
}
