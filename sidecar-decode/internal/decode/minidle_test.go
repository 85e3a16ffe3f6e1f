package decode

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// idleSession gives s a session id of kv tokens with a current snapshot, last committed idle
// ago (pages from *next on).
func idleSession(t *testing.T, s *Sidecar, id string, kv int64, idle time.Duration, next *int64) {
	t.Helper()
	ctx := context.Background()
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: id, PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	pg := make([]int64, (kv+3)/4)
	for i := range pg {
		pg[i] = *next
		*next++
	}
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: id, CommittedLen: kv, Pages: pg}); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	ss := s.sessions[id]
	ss.lastCommit, ss.lastPushed, ss.queued = time.Now().Add(-idle), kv, false
	s.queue = s.queue[:0]
	s.mu.Unlock()
}

// TestReleaseSparesALoadedSession: a session a LoadSessionCommand just loaded (a re-home) is
// neither released — by the periodic pass or by a deficit's — nor reported evictable for
// the release's minimum idle time, even when its last commit is older (the worker already held
// the whole snapshot, so the load committed nothing new); the session idle longer is released.
func TestReleaseSparesALoadedSession(t *testing.T) {
	for _, tc := range []struct {
		name    string
		demand  *kvcv1.ReportDemandRequest // nil: the pool is above the high watermark
		release []string
	}{
		{"periodic pass above the watermark", nil, []string{"old"}},
		// the deficit (114 tokens) also takes the session committed just now, never the loaded one
		{"deficit pass", &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 250, FreeTokens: 136}, []string{"old", "busy"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t) // 256 tokens
			high := 0.3            // 120 of 256 committed: above it
			if tc.demand != nil {
				high = 0.9 // under it: only the deficit releases
			}
			s.rel = newReleaser(ReleaseConfig{High: high, Low: 0.01, MinIdle: time.Minute})
			var next int64
			idleSession(t, s, "loaded", 40, time.Hour, &next)
			idleSession(t, s, "old", 40, 30*time.Minute, &next)
			idleSession(t, s, "busy", 40, 0, &next)
			w := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/open_session" {
					_, _ = rw.Write([]byte(`"already open"`))
					return
				}
				_, _ = rw.Write([]byte(`{"meta_info":{"kvc":{"kv_len_after":40,"verified_bytes":2560}}}`))
			}))
			defer w.Close()
			s.cfg.WorkerURL = w.URL
			rep := &recordingReporter{}
			s.SetReporter(rep)
			s.loadSession(context.Background(), &kvcv1.LoadSessionCommand{SessionId: "loaded", Seqlen: 40, PrefillWorkerId: "p0",
				PrefillPeerAddr: "p:1", Room: 9, DecisionId: "d-9"})
			if rep.kinds(kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED)["loaded"] == nil {
				t.Fatalf("not loaded: %v", rep.evs)
			}
			if tc.demand != nil {
				if _, err := s.ReportDemand(context.Background(), tc.demand); err != nil {
					t.Fatal(err)
				}
			}
			s.mu.Lock()
			p := s.planReleaseLocked(time.Now())
			s.mu.Unlock()
			if !slices.Equal(p.Release, tc.release) || len(p.Waiting) != 0 {
				t.Fatalf("plan %+v: want %v released", p, tc.release)
			}
			if l := s.Load(); l.GetEvictableTokens() != 0 { // "old" is releasing now; "loaded" and "busy" are recent
				t.Fatalf("evictable %d, want 0 (the loaded session is not room)", l.GetEvictableTokens())
			}
		})
	}
}

// TestReleaseNotSentAfterACommit: a session a pass planned to release and that is committed
// before its release command goes out (the releases ranked before it wait for the worker's
// acks meanwhile) is not released; the planned release of a session still idle is.
func TestReleaseNotSentAfterACommit(t *testing.T) {
	s := newTestSidecar(t)
	s.rel = newReleaser(ReleaseConfig{High: 0.3, Low: 0.01, MinIdle: time.Minute, Interval: time.Hour})
	rep := chanReporter(make(chan *kvcv1.SessionEvent, 16))
	s.SetReporter(rep)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveBridge(t, s)
	rw := &releasingWorker{}
	done := make(chan struct{})
	go func() { defer close(done); rw.run(t, ctx, s, c) }()
	defer func() { cancel(); <-done }()
	var next int64
	idleSession(t, s, "a", 40, time.Hour, &next)
	idleSession(t, s, "b", 40, 30*time.Minute, &next)
	idleSession(t, s, "c", 40, 20*time.Minute, &next)
	for !s.att.Watcher().AttachAcked {
		select {
		case <-ctx.Done():
			t.Fatal("worker never attached")
		case <-time.After(5 * time.Millisecond):
		}
	}
	s.mu.Lock()
	p := s.planReleaseLocked(time.Now())
	s.mu.Unlock()
	if !slices.Equal(p.Release, []string{"a", "b", "c"}) {
		t.Fatalf("plan %+v", p)
	}
	// "a"'s turn commits while the pass waits for another release's ack.
	s.mu.Lock()
	pages := slices.Clone(s.sessions["a"].pages)
	s.mu.Unlock()
	if _, err := c.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 40, Pages: pages}); err != nil {
		t.Fatal(err)
	}
	for _, id := range p.Release {
		s.releaseOne(ctx, id, p.At, false)
	}
	rw.mu.Lock()
	released := slices.Clone(rw.released)
	rw.mu.Unlock()
	if !slices.Equal(released, []string{"b", "c"}) {
		t.Fatalf("released %v, want [b c]", released)
	}
	s.mu.Lock()
	a := s.sessions["a"]
	kept := a != nil && !a.releasing
	s.mu.Unlock()
	if !kept {
		t.Fatal("the committed session was dropped or left marked releasing")
	}
	if d := s.Demand(); d.SparedReleases != 1 {
		t.Fatalf("spared %d, want 1", d.SparedReleases)
	}
}

// TestReleaseRefusalReplansAtOnce: a release the worker refuses (the session's turn waits for
// pages) is passed over and the next idlest session — here one committed just now, taken for
// the deficit — is released in the same round, without waiting for the next tick or demand
// report.
func TestReleaseRefusalReplansAtOnce(t *testing.T) {
	s := newTestSidecar(t) // 256 tokens
	s.rel = newReleaser(ReleaseConfig{High: 0.9, Low: 0.5, MinIdle: time.Minute, Interval: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := serveBridge(t, s)
	rw := &releasingWorker{refuse: map[string]bool{"a": true}}
	done := make(chan struct{})
	go func() { defer close(done); rw.run(t, ctx, s, c) }()
	defer func() { cancel(); <-done }()
	var next int64
	idleSession(t, s, "a", 40, time.Hour, &next)
	idleSession(t, s, "b", 40, 0, &next) // committed just now: taken on demand
	for !s.att.Watcher().AttachAcked {
		select {
		case <-ctx.Done():
			t.Fatal("worker never attached")
		case <-time.After(5 * time.Millisecond):
		}
	}
	// 80 of 256 committed (under the high watermark), 20 tokens short: one session's worth.
	if _, err := c.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 196, FreeTokens: 176}); err != nil {
		t.Fatal(err)
	}
	<-s.relKick // the report's kick: this test runs the round itself
	s.releaseRounds(ctx)
	rw.mu.Lock()
	released, refused := slices.Clone(rw.released), slices.Clone(rw.refused)
	rw.mu.Unlock()
	if !slices.Equal(refused, []string{"a"}) || !slices.Equal(released, []string{"b"}) {
		t.Fatalf("refused %v, released %v; want a refused, then b released in the same round", refused, released)
	}
	s.mu.Lock()
	_, kept := s.sessions["a"]
	_, gone := s.sessions["b"]
	s.mu.Unlock()
	if !kept || gone {
		t.Fatalf("sessions after the round: a kept %v, b still held %v", kept, gone)
	}
	if d := s.Demand(); d.RefusedReleases != 1 || d.OnDemandReleases != 1 {
		t.Fatalf("demand stats %+v; want 1 refused (a), 1 on demand (b)", d)
	}
}
