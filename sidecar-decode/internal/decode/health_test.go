package decode

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type recordingReporter struct {
	mu    sync.Mutex
	evs   []*kvcv1.SessionEvent
	kicks int // KickLoad calls
}

func (r *recordingReporter) Report(ev *kvcv1.SessionEvent) {
	r.mu.Lock()
	r.evs = append(r.evs, ev)
	r.mu.Unlock()
}

func (r *recordingReporter) KickLoad() {
	r.mu.Lock()
	r.kicks++
	r.mu.Unlock()
}

func (r *recordingReporter) kicked() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.kicks
}

func (r *recordingReporter) kinds(kind kvcv1.SessionEventKind) map[string]*kvcv1.SessionEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]*kvcv1.SessionEvent{}
	for _, ev := range r.evs {
		if ev.GetKind() == kind {
			out[ev.GetSessionId()] = ev
		}
	}
	return out
}

func TestWorkerDownDropsEverySession(t *testing.T) {
	s := newTestSidecar(t)
	rep := &recordingReporter{}
	s.SetReporter(rep)
	ctx := context.Background()
	for _, c := range []struct {
		id string
		n  int64
	}{{"a", 8}, {"b", 13}} {
		if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: c.id, CommittedLen: c.n, Pages: pages(int((c.n + 3) / 4))}); err != nil {
			t.Fatal(err)
		}
	}
	// A target named for a session not committed yet, and a room waiting for its transfer.
	if err := s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "c", PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}}); err != nil {
		t.Fatal(err)
	}
	room := &recvRoom{req: &kvcv1.PrepareReceiveRequest{Room: 7, SessionId: "e"}, created: time.Now(), done: make(chan struct{})}
	s.mu.Lock()
	s.rooms[7] = room
	s.mu.Unlock()

	s.WorkerHealth(true, "bridge closed")

	if got := s.Resync().GetSessions(); len(got) != 0 {
		t.Fatalf("resync after the worker died lists %v", got)
	}
	if l := s.Load(); l.GetResidentSessions() != 0 || l.GetUsedTokens() != 0 || l.GetTransferQueueDepth() != 0 {
		t.Fatalf("load after the worker died: %v", l)
	}
	ev := rep.kinds(kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED)
	if len(ev) != 2 || ev["a"].GetKvLen() != 8 || ev["b"].GetKvLen() != 13 || !strings.Contains(ev["a"].GetDetail(), "worker down: bridge closed") {
		t.Fatalf("evicted events %v", ev)
	}
	select {
	case <-room.done:
		if room.res.GetOk() || !strings.Contains(room.res.GetError(), "worker down") {
			t.Fatalf("room result %v", room.res)
		}
	default:
		t.Fatal("the waiting room was not failed")
	}
	s.mu.Lock()
	_, pending := s.targets["c"]
	s.mu.Unlock()
	if pending {
		t.Fatal("a pending target survived the worker")
	}
	// A worker that was only slow may still release what it held: OK, not NOT_FOUND.
	if _, err := s.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "a"}); err != nil {
		t.Fatalf("release of a dropped session: %v", err)
	}
	// Up again: nothing to do; new commits are tracked as before.
	s.WorkerHealth(false, "worker registered its KV pool")
	if _, err := s.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a", CommittedLen: 4, Pages: pages(1)}); err != nil {
		t.Fatal(err)
	}
	if got := s.Resync().GetSessions(); len(got) != 1 || got[0].GetSessionId() != "a" {
		t.Fatalf("resync after recovery %v", got)
	}
}

// gauges gathers the sidecar's collectors by metric name.
func gauges(t *testing.T, s *Sidecar) map[string]float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.Collectors()...)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if g := m.GetGauge(); g != nil {
				out[mf.GetName()] = g.GetValue()
			} else if c := m.GetCounter(); c != nil {
				out[mf.GetName()] = c.GetValue()
			}
		}
	}
	return out
}

// TestWorkerDownForgetsDemand: the worker reports its demand and dies. From the moment the
// sidecar sees it down until the restarted worker reports again nothing waits here: no release
// pass acts on the dead worker's deficit, the load report to the control plane carries no
// waiting or running requests nor unevictable KV, the demand gauges read 0 and
// kvc_sidecar_demand_reported 0; a report of the dead worker handled late (its caller gone) is
// not recorded. Before, the waiting tokens and free room stayed in the gauges, and a late report
// brought the whole demand back for the restarted worker's first moments.
func TestWorkerDownForgetsDemand(t *testing.T) {
	cases := []struct {
		name   string
		report *kvcv1.ReportDemandRequest // the dead worker's last (nil: none)
		late   bool                       // one more report of it handled after the down, its caller gone
		// before the death: the plan's deficit and the load's waiting requests
		deficit int64
	}{
		{name: "no report"},
		{name: "deficit", report: &kvcv1.ReportDemandRequest{WaitingRequests: 2, WaitingTokens: 200, FreeTokens: 136, RunningRequests: 1, UnevictableTokens: 40},
			deficit: 64},
		{name: "waiting within the free room", report: &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 40, FreeTokens: 136}},
		{name: "running only", report: &kvcv1.ReportDemandRequest{RunningRequests: 3, UnevictableTokens: 40}},
		{name: "late report of the dead worker", report: &kvcv1.ReportDemandRequest{WaitingRequests: 2, WaitingTokens: 200, FreeTokens: 136, RunningRequests: 1},
			late: true, deficit: 64},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t) // 64 pages of 4 tokens: 256 tokens
			s.rel = newReleaser(ReleaseConfig{High: 0.5, Low: 0.25, MinIdle: time.Second})
			ctx := context.Background()
			add := idleSessions(t, s, time.Now())
			// an idle session with its snapshot current: the release may take it
			commit := func(id string, kv int64) { add(id, kv, time.Hour, kv) }
			plan := func() ReleasePlan {
				s.mu.Lock()
				defer s.mu.Unlock()
				return s.planReleaseLocked(time.Now())
			}
			commit("old", 40)
			commit("mid", 40)
			if tc.report != nil {
				if _, err := s.ReportDemand(ctx, tc.report); err != nil {
					t.Fatal(err)
				}
			}
			// Before the death the demand counts (the test sees what it then checks is gone).
			if p := plan(); p.Deficit != tc.deficit {
				t.Fatalf("before the death: deficit %d, want %d", p.Deficit, tc.deficit)
			}
			if l := s.Load(); l.GetWaitingRequests() != tc.report.GetWaitingRequests() || l.GetRunningRequests() != tc.report.GetRunningRequests() {
				t.Fatalf("before the death: load %v", l)
			}
			if g := gauges(t, s); g["kvc_sidecar_demand_reported"] != b2f(tc.report != nil) || g["kvc_sidecar_prealloc_waiting_tokens"] != float64(tc.report.GetWaitingTokens()) {
				t.Fatalf("before the death: gauges %v", g)
			}

			s.WorkerHealth(true, "bridge closed")
			if tc.late {
				dead, cancel := context.WithCancel(ctx)
				cancel() // its bridge connection closed: gRPC cancelled the call
				if _, err := s.ReportDemand(dead, tc.report); status.Code(err) != codes.Canceled {
					t.Fatalf("late report of the dead worker: %v, want Canceled", err)
				}
			}
			// The worker restarts: its pool comes back, its sessions are committed anew (idle,
			// snapshots current), and it has not reported its demand yet.
			s.WorkerHealth(false, "worker registered its KV pool")
			commit("new-a", 40)
			commit("new-b", 40)
			for _, when := range []string{"down", "restarted, no report yet"} {
				if p := plan(); p.Deficit != 0 || len(p.Release) != 0 || len(p.Waiting) != 0 {
					t.Fatalf("%s: a release for the dead worker's deficit: %+v", when, p)
				}
				l := s.Load()
				if l.GetWaitingRequests() != 0 || l.GetPreallocQueueDepth() != 0 || l.GetRunningRequests() != 0 || l.GetUnevictableTokens() != 0 {
					t.Fatalf("%s: the load report carries the dead worker's demand: %v", when, l)
				}
				g := gauges(t, s)
				for _, name := range []string{"kvc_sidecar_demand_reported", "kvc_sidecar_prealloc_waiting_requests", "kvc_sidecar_prealloc_waiting_tokens",
					"kvc_sidecar_prealloc_free_tokens", "kvc_sidecar_worker_running_requests", "kvc_sidecar_worker_unevictable_tokens"} {
					if g[name] != 0 {
						t.Fatalf("%s: %s = %v, want 0", when, name, g[name])
					}
				}
				if g["kvc_sidecar_demand_forgotten_total"] != b2f(tc.report != nil) || g["kvc_sidecar_demand_reports_discarded_total"] != b2f(tc.late) ||
					g["kvc_sidecar_demand_reports_total"] != b2f(tc.report != nil) {
					t.Fatalf("%s: counters %v", when, g)
				}
			}

			// The restarted worker reports: its demand counts, and its deficit is released for.
			if _, err := s.ReportDemand(ctx, &kvcv1.ReportDemandRequest{WaitingRequests: 1, WaitingTokens: 200, FreeTokens: 176, RunningRequests: 2}); err != nil {
				t.Fatal(err)
			}
			if p := plan(); p.Deficit != 24 || len(p.Release) != 1 {
				t.Fatalf("the restarted worker's deficit: %+v, want 24 and one release", p)
			}
			if l := s.Load(); l.GetWaitingRequests() != 1 || l.GetRunningRequests() != 2 {
				t.Fatalf("the restarted worker's load: %v", l)
			}
			if g := gauges(t, s); g["kvc_sidecar_demand_reported"] != 1 || g["kvc_sidecar_prealloc_waiting_tokens"] != 200 {
				t.Fatalf("the restarted worker's gauges: %v", g)
			}
		})
	}
}
