package state

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

const (
	decodeRole  = kvcv1.WorkerRole_WORKER_ROLE_DECODE
	prefillRole = kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	ready       = kvcv1.WorkerState_WORKER_STATE_READY
	unreachable = kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
	workerDown  = kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN
)

// rec is a worker record as the state holds it.
func rec(id string, role kvcv1.WorkerRole, group string, rank, size int32, st kvcv1.WorkerState) *kvcv1.Worker {
	return &kvcv1.Worker{WorkerId: id, Role: role, TpGroup: group, TpRank: rank, TpSize: size, State: st,
		KvCapacityTokens: 1000, PeerAddr: id + ":peer", TransferEndpoint: id + ":xfer"}
}

func ids(ws []*kvcv1.Worker) string {
	var out []string
	for _, w := range ws {
		out = append(out, w.GetWorkerId()+"="+strings.TrimPrefix(w.GetState().String(), "WORKER_STATE_"))
	}
	return strings.Join(out, " ")
}

func TestGroupWorkers(t *testing.T) {
	withLoad := func(w *kvcv1.Worker, used, evictable int64, running int32) *kvcv1.Worker {
		w.Load = &kvcv1.WorkerLoad{UsedTokens: used, EvictableTokens: evictable, RunningRequests: running}
		return w
	}
	unevictableLoad := func(w *kvcv1.Worker, n int64) *kvcv1.Worker {
		w.Load.UnevictableTokens = n
		return w
	}
	tests := []struct {
		name     string
		raw      []*kvcv1.Worker
		routing  string // worker id = state of each routed record
		listing  string
		problems map[string]string // worker id -> a part of its tp_problem
		check    func(t *testing.T, v *tpView)
	}{
		{
			name:    "no tensor parallelism: the records themselves",
			raw:     []*kvcv1.Worker{rec("d0", decodeRole, "", 0, 0, ready), rec("p0", prefillRole, "g", 0, 1, ready)},
			routing: "d0=READY p0=READY", listing: "d0=READY p0=READY",
			check: func(t *testing.T, v *tpView) {
				if v.unit != nil || v.ranks != nil {
					t.Fatalf("maps built without a group: %v %v", v.unit, v.ranks)
				}
			},
		},
		{
			name: "a ready group of two is one worker",
			raw: []*kvcv1.Worker{unevictableLoad(withLoad(rec("d-a0", decodeRole, "A", 0, 2, ready), 100, 80, 2), 70),
				unevictableLoad(withLoad(rec("d-a1", decodeRole, "A", 1, 2, ready), 300, 250, 1), 40), rec("p0", prefillRole, "", 0, 0, ready),
				rec("p-b0", prefillRole, "B", 0, 2, ready), rec("p-b1", prefillRole, "B", 1, 2, ready)},
			routing: "d-a0=READY p-b0=READY p0=READY", listing: "d-a0=READY d-a1=READY p-b0=READY p-b1=READY p0=READY",
			problems: map[string]string{"p0": "no decode worker with tp_size 1 (theirs: 2)"},
			check: func(t *testing.T, v *tpView) {
				u := v.routing[0]
				if len(u.GetTpRanks()) != 2 || u.GetTpRanks()[1].GetWorkerId() != "d-a1" || u.GetTpRanks()[1].GetPeerAddr() != "d-a1:peer" ||
					u.GetTpRanks()[1].GetTransferEndpoint() != "d-a1:xfer" || u.GetTpRanks()[1].GetState() != ready {
					t.Fatalf("ranks %v", u.GetTpRanks())
				}
				// Occupancy: the fullest rank's used tokens and its unevictable part.
				// The workers' own reports: the rank with the most in use.
				if l := u.GetLoad(); l.GetUsedTokens() != 300 || l.GetUsedTokens()-l.GetEvictableTokens() != 50 || l.GetRunningRequests() != 2 ||
					l.GetUnevictableTokens() != 70 {
					t.Fatalf("group load %v", l)
				}
				if v.unit["d-a1"] != "d-a0" || v.unit["d-a0"] != "d-a0" || strings.Join(v.ranks["p-b0"], ",") != "p-b0,p-b1" {
					t.Fatalf("maps %v %v", v.unit, v.ranks)
				}
			},
		},
		{
			name:    "capacity is the smallest rank's",
			raw:     []*kvcv1.Worker{rec("a0", decodeRole, "A", 0, 2, ready), func() *kvcv1.Worker { w := rec("a1", decodeRole, "A", 1, 2, ready); w.KvCapacityTokens = 600; return w }()},
			routing: "a0=READY", listing: "a0=READY a1=READY",
			check: func(t *testing.T, v *tpView) {
				if c := v.routing[0].GetKvCapacityTokens(); c != 600 {
					t.Fatalf("capacity %d", c)
				}
			},
		},
		{
			name:    "a rank unreachable takes the group out",
			raw:     []*kvcv1.Worker{rec("a0", decodeRole, "A", 0, 2, ready), rec("a1", decodeRole, "A", 1, 2, unreachable)},
			routing: "a0=UNREACHABLE", listing: "a0=UNREACHABLE a1=UNREACHABLE",
			problems: map[string]string{"a0": "rank 1 (a1) unreachable"},
		},
		{
			name:    "a rank not registered",
			raw:     []*kvcv1.Worker{rec("a0", decodeRole, "A", 0, 4, ready), rec("a2", decodeRole, "A", 2, 4, ready), rec("a3", decodeRole, "A", 3, 4, ready)},
			routing: "a0=UNREACHABLE", listing: "a0=UNREACHABLE a2=READY a3=READY",
			problems: map[string]string{"a0": "rank 1 not registered"},
		},
		{
			name: "a rank's worker down",
			raw: []*kvcv1.Worker{rec("a0", decodeRole, "A", 0, 2, ready), func() *kvcv1.Worker {
				w := rec("a1", decodeRole, "A", 1, 2, workerDown)
				w.WorkerDownReason, w.WorkerDownSinceUnixMs = "bridge closed", 7
				return w
			}()},
			routing: "a0=WORKER_DOWN", listing: "a0=WORKER_DOWN a1=WORKER_DOWN",
			problems: map[string]string{"a0": "rank 1 (a1) worker down"},
			check: func(t *testing.T, v *tpView) {
				if u := v.routing[0]; u.GetWorkerDownReason() != "rank 1 (a1): bridge closed" || u.GetWorkerDownSinceUnixMs() != 7 {
					t.Fatalf("worker down of the group: %v", u)
				}
			},
		},
		{
			name: "a draining group",
			raw: []*kvcv1.Worker{func() *kvcv1.Worker {
				w := rec("a0", decodeRole, "A", 0, 2, kvcv1.WorkerState_WORKER_STATE_DRAINING)
				w.Draining = true
				return w
			}(), rec("a1", decodeRole, "A", 1, 2, ready)},
			routing: "a0=DRAINING", listing: "a0=DRAINING a1=READY",
		},
		{
			name:    "no rank 0: nothing routed",
			raw:     []*kvcv1.Worker{rec("a1", decodeRole, "A", 1, 2, ready), rec("d0", decodeRole, "", 0, 1, ready)},
			routing: "d0=READY", listing: "a1=READY d0=READY",
			problems: map[string]string{"a1": "rank 0 of group \"A\" is not registered"},
		},
		{
			name:    "a rank held twice: the connected record",
			raw:     []*kvcv1.Worker{rec("a0", decodeRole, "A", 0, 2, ready), rec("a1-gone", decodeRole, "A", 1, 2, unreachable), rec("a1-new", decodeRole, "A", 1, 2, ready)},
			routing: "a0=READY", listing: "a0=READY a1-gone=UNREACHABLE a1-new=READY",
			problems: map[string]string{"a1-gone": "held by the connected worker \"a1-new\""},
		},
		{
			name:    "a stale rank of another size",
			raw:     []*kvcv1.Worker{rec("a0", decodeRole, "A", 0, 2, ready), rec("a1", decodeRole, "A", 1, 2, ready), rec("a3", decodeRole, "A", 3, 4, unreachable)},
			routing: "a0=READY", listing: "a0=READY a1=READY a3=UNREACHABLE",
			problems: map[string]string{"a3": "stale rank of group \"A\": tp_size 4, the group's is 2"},
		},
		{
			name: "unequal TP on P and D: both sides say so",
			raw: []*kvcv1.Worker{rec("d-a0", decodeRole, "A", 0, 2, ready), rec("d-a1", decodeRole, "A", 1, 2, ready),
				rec("p-b0", prefillRole, "B", 0, 4, ready), rec("p-b1", prefillRole, "B", 1, 4, ready), rec("p-b2", prefillRole, "B", 2, 4, ready), rec("p-b3", prefillRole, "B", 3, 4, ready)},
			routing: "d-a0=READY p-b0=READY", listing: "d-a0=READY d-a1=READY p-b0=READY p-b1=READY p-b2=READY p-b3=READY",
			problems: map[string]string{"d-a0": "no prefill worker with tp_size 2 (theirs: 4)", "p-b0": "no decode worker with tp_size 4 (theirs: 2)"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := make([]*kvcv1.Worker, len(tt.raw))
			for i, w := range tt.raw {
				before[i] = proto.Clone(w).(*kvcv1.Worker)
			}
			sorted := slices.Clone(tt.raw) // sorted as the state publishes them
			slices.SortFunc(sorted, func(a, b *kvcv1.Worker) int { return strings.Compare(a.GetWorkerId(), b.GetWorkerId()) })
			v := groupWorkers(sorted)
			if got := ids(ListWorkers(tt.raw)); got != tt.listing {
				t.Fatalf("ListWorkers %q, want %q", got, tt.listing)
			}
			if got := ids(v.routing); got != tt.routing {
				t.Fatalf("routing %q, want %q", got, tt.routing)
			}
			if got := ids(v.listing); got != tt.listing {
				t.Fatalf("listing %q, want %q", got, tt.listing)
			}
			for _, w := range v.listing {
				want, ok := tt.problems[w.GetWorkerId()]
				if ok != (w.GetTpProblem() != "") || !strings.Contains(w.GetTpProblem(), want) {
					t.Fatalf("%s: tp_problem %q, want %q", w.GetWorkerId(), w.GetTpProblem(), want)
				}
			}
			for i, w := range tt.raw {
				if !proto.Equal(w, before[i]) {
					t.Fatalf("record %s modified: %v", w.GetWorkerId(), w)
				}
			}
			if tt.check != nil {
				tt.check(t, v)
			}
		})
	}
}

// tpHello is a hello of rank rank of group g (tp_size size).
func tpHello(id string, role kvcv1.WorkerRole, g string, rank, size int32) *kvcv1.Hello {
	h := hello(id, role)
	h.TpGroup, h.TpRank, h.TpSize = g, rank, size
	h.PeerAddr, h.TransferEndpoint = id+":peer", id+":xfer"
	return h
}

func TestTPAttachRefusals(t *testing.T) {
	f := newFixture(t, Config{})
	st := f.st
	a0, err := st.Attach(tpHello("a0", decodeRole, "A", 0, 2))
	must(t, err)
	tests := []struct {
		name   string
		h      *kvcv1.Hello
		reason kvcv1.TPErrorReason
		msg    string
	}{
		{"size mismatch", tpHello("a1", decodeRole, "A", 1, 4), kvcv1.TPErrorReason_TP_ERROR_REASON_SIZE_MISMATCH, "says tp_size 4 for group \"A\", whose connected rank 0 (\"a0\") says 2"},
		{"tp 1 in a group of 2", tpHello("a1", decodeRole, "A", 0, 1), kvcv1.TPErrorReason_TP_ERROR_REASON_SIZE_MISMATCH, "says tp_size 1"},
		{"rank taken", tpHello("a0-bis", decodeRole, "A", 0, 2), kvcv1.TPErrorReason_TP_ERROR_REASON_RANK_TAKEN, "rank 0 of group \"A\" is already connected as worker \"a0\""},
		{"role mismatch", tpHello("a1", prefillRole, "A", 1, 2), kvcv1.TPErrorReason_TP_ERROR_REASON_ROLE_MISMATCH, "is a prefill rank of group \"A\""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := st.Attach(tt.h)
			var te *TPError
			if !errors.As(err, &te) || !errors.Is(err, ErrTP) || te.Detail.GetReason() != tt.reason || !strings.Contains(err.Error(), tt.msg) ||
				te.Detail.GetConflictingWorkerId() != "a0" || te.Detail.GetTpGroup() != "A" {
				t.Fatalf("attach: %v (detail %v)", err, te)
			}
			if _, known := st.Worker(tt.h.GetWorkerId()); known {
				t.Fatalf("refused worker %s was registered", tt.h.GetWorkerId())
			}
		})
	}
	// Once rank 0 is gone, nothing connected disagrees: the group can come back with another size.
	st.Detach(a0)
	_, err = st.Attach(tpHello("a1", decodeRole, "A", 1, 4))
	must(t, err)
	if w, _ := st.Worker("a1"); !strings.Contains(w.GetTpProblem(), "stale rank") && !strings.Contains(w.GetTpProblem(), "rank 0") {
		t.Fatalf("a1 listed as %v", w)
	}
}

// tpCluster is a decode group A (a0, a1) and a prefill group B (b0, b1) of two ranks, attached.
type tpCluster struct {
	f              *fixture
	a0, a1, b0, b1 *Stream
}

func newTPCluster(t *testing.T) *tpCluster {
	t.Helper()
	f := newFixture(t, Config{})
	c := &tpCluster{f: f}
	var err error
	for _, x := range []struct {
		s    **Stream
		id   string
		role kvcv1.WorkerRole
		g    string
		r    int32
	}{{&c.a0, "a0", decodeRole, "A", 0}, {&c.a1, "a1", decodeRole, "A", 1}, {&c.b0, "b0", prefillRole, "B", 0}, {&c.b1, "b1", prefillRole, "B", 1}} {
		if *x.s, err = f.st.Attach(tpHello(x.id, x.role, x.g, x.r, 2)); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// next is the next command queued on st (none: fail).
func next(t *testing.T, st *Stream) *kvcv1.Command {
	t.Helper()
	select {
	case m := <-st.Queue():
		return m.GetCommand()
	default:
		t.Fatalf("no command queued for %s", st.WorkerID)
		return nil
	}
}

func TestTPGroupRoutingAndCommands(t *testing.T) {
	c := newTPCluster(t)
	st := c.f.st
	if got := ids(st.Workers()); got != "a0=READY b0=READY" {
		t.Fatalf("routing view %q", got)
	}
	if got := ids(st.ListedWorkers()); got != "a0=READY a1=READY b0=READY b1=READY" {
		t.Fatalf("listing %q", got)
	}
	d := decide(st, "s1", 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || d.Decode.GetWorkerId() != "a0" || d.Prefill.GetWorkerId() != "b0" ||
		len(d.Decode.GetTpRanks()) != 2 || d.Prefill.GetTpRanks()[1].GetPeerAddr() != "b1:peer" {
		t.Fatalf("seed %s %s/%s %v", d.Mode, d.Prefill.GetWorkerId(), d.Decode.GetWorkerId(), d.Prefill.GetTpRanks())
	}

	// A command for the group reaches every rank, each naming the peer group's rank of its index.
	must(t, st.SendCommand("a0", &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "s1", PrefillWorkerId: "b0", PeerAddr: "b0:peer", TransferEndpoint: "b0:xfer", Generation: 1}}}))
	t0, t1 := next(t, c.a0), next(t, c.a1)
	if g := t0.GetSetSnapshotTarget(); g.GetPrefillWorkerId() != "b0" || g.GetPeerAddr() != "b0:peer" || g.GetTransferEndpoint() != "b0:xfer" {
		t.Fatalf("rank 0's target %v", g)
	}
	if g := t1.GetSetSnapshotTarget(); g.GetPrefillWorkerId() != "b1" || g.GetPeerAddr() != "b1:peer" || g.GetTransferEndpoint() != "b1:xfer" || g.GetGeneration() != 1 {
		t.Fatalf("rank 1's target %v", g)
	}
	if t0.GetCommandId() == t1.GetCommandId() || t0.GetEpoch() != st.Epoch() || t1.GetEpoch() != st.Epoch() {
		t.Fatalf("command ids %d %d", t0.GetCommandId(), t1.GetCommandId())
	}
	must(t, st.SendCommand("b0", &kvcv1.Command{Action: &kvcv1.Command_PushSnapshot{PushSnapshot: &kvcv1.PushSnapshotCommand{
		SessionId: "s1", DecodeWorkerId: "a0", DecodePeerAddr: "a0:peer", DecodeTransferEndpoint: "a0:xfer", Room: 7}}}))
	if p := next(t, c.b1).GetPushSnapshot(); p.GetDecodeWorkerId() != "a1" || p.GetDecodePeerAddr() != "a1:peer" || p.GetRoom() != 7 {
		t.Fatalf("rank 1's push %v", p)
	}
	if p := next(t, c.b0).GetPushSnapshot(); p.GetDecodeWorkerId() != "a0" || p.GetDecodePeerAddr() != "a0:peer" {
		t.Fatalf("rank 0's push %v", p)
	}
	// Plain commands: every rank, unchanged.
	must(t, st.SendCommand("a0", &kvcv1.Command{Action: &kvcv1.Command_ReleaseSession{ReleaseSession: &kvcv1.ReleaseSessionCommand{SessionId: "s1"}}}))
	if next(t, c.a0).GetReleaseSession().GetSessionId() != "s1" || next(t, c.a1).GetReleaseSession().GetSessionId() != "s1" {
		t.Fatal("release not on both ranks")
	}
	// A group is drained as a whole, through its rank 0.
	if _, err := st.Drain("a1", true); !errors.Is(err, ErrTPMember) {
		t.Fatalf("drain of rank 1: %v", err)
	}
	w, err := st.Drain("a0", true)
	if err != nil || w.GetState() != kvcv1.WorkerState_WORKER_STATE_DRAINING || len(w.GetTpRanks()) != 2 {
		t.Fatalf("drain: %v %v", w, err)
	}
	if !next(t, c.a0).GetDrain().GetDraining() || !next(t, c.a1).GetDrain().GetDraining() {
		t.Fatal("drain command not on both ranks")
	}
	_, err = st.Drain("a0", false)
	must(t, err)
	next(t, c.a0)
	next(t, c.a1)
	// A prefill group is drained too, but its sidecars are not told: nothing for them to do.
	w, err = st.Drain("b0", true)
	if err != nil || w.GetState() != kvcv1.WorkerState_WORKER_STATE_DRAINING || len(c.b0.Queue()) != 0 || len(c.b1.Queue()) != 0 {
		t.Fatalf("prefill drain: %v %v, %d and %d commands queued", w, err, len(c.b0.Queue()), len(c.b1.Queue()))
	}
	_, err = st.Drain("b0", false)
	must(t, err)

	// A command naming a peer of another tensor-parallel size is refused, nothing sent.
	_, err = st.Attach(hello("p-plain", prefillRole))
	must(t, err)
	err = st.SendCommand("a0", &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: "s1", PrefillWorkerId: "p-plain", PeerAddr: "x", TransferEndpoint: "y"}}})
	if !errors.Is(err, ErrTP) || len(c.a0.Queue()) != 0 || len(c.a1.Queue()) != 0 {
		t.Fatalf("unequal pairing: %v", err)
	}

	// One rank's stream drops: the group is not routable and takes no command.
	st.Detach(c.a1)
	if w, _ := st.Worker("a0"); w.GetState() != unreachable || !strings.Contains(w.GetTpProblem(), "rank 1 (a1) unreachable") {
		t.Fatalf("group after rank 1 dropped: %v", w)
	}
	if d := decide(st, "s2", 100); d.Mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK || d.Decode != nil {
		t.Fatalf("with a rank down: %s to %s", d.Mode, d.Decode.GetWorkerId())
	}
	if err := st.SendCommand("a0", &kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{}}}); !errors.Is(err, ErrNoStream) || len(c.a0.Queue()) != 0 {
		t.Fatalf("command with a rank down: %v", err)
	}
}

func TestTPGroupResidencyAndSnapshots(t *testing.T) {
	c := newTPCluster(t)
	st := c.f.st
	resident := func(sid string) string { r, _ := st.Session(sid); return r.GetDecodeWorker() }
	commit := func(s *Stream, sid string, n int64) {
		t.Helper()
		must(t, st.ApplyEvent(s, &kvcv1.SessionEvent{SessionId: sid, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: n, Generation: 1}))
	}
	// Rank 0's commits drive the group's residency; another rank's do not.
	commit(c.a1, "s1", 100)
	if got := resident("s1"); got != "" {
		t.Fatalf("rank 1's commit made s1 resident on %q", got)
	}
	commit(c.a0, "s1", 100)
	commit(c.a1, "s1", 100)
	commit(c.a0, "s2", 200)
	commit(c.a1, "s2", 200)
	commit(c.a0, "s3", 300)
	if resident("s1") != "a0" || resident("s2") != "a0" {
		t.Fatalf("resident on %q %q", resident("s1"), resident("s2"))
	}
	if d := decide(st, "s1", 110); d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Decode.GetWorkerId() != "a0" {
		t.Fatalf("direct: %s %s", d.Mode, d.Decode.GetWorkerId())
	}
	// An eviction on any rank loses the session for the group.
	must(t, st.ApplyEvent(c.a1, &kvcv1.SessionEvent{SessionId: "s1", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED}))
	if r, _ := st.Session("s1"); r.GetDecodeWorker() != "" || r.GetPreviousDecodeWorker() != "a0" {
		t.Fatalf("s1 after rank 1 evicted it: %v", r)
	}
	// Another rank's full resync: what it does not hold is lost (s3), what it holds stays (s2).
	must(t, st.Reconcile(c.a1, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{{SessionId: "s2", KvCommittedLen: 200, Generation: 1}}}))
	if resident("s2") != "a0" || resident("s3") != "" {
		t.Fatalf("after rank 1's resync: s2 on %q, s3 on %q", resident("s2"), resident("s3"))
	}

	// A prefill group's snapshot is what every rank holds: same generation, the shortest seqlen.
	ingest := func(s *Stream, sid string, n int64, gen uint64) {
		t.Helper()
		must(t, st.ApplyEvent(s, &kvcv1.SessionEvent{SessionId: sid, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED, KvLen: n, Generation: gen, Bytes: n}))
	}
	snap := func(sid string) *kvcv1.SnapshotInfo { r, _ := st.Session(sid); return r.GetSnapshot() }
	ingest(c.b0, "s2", 192, 1)
	if sn := snap("s2"); sn != nil {
		t.Fatalf("snapshot with one rank: %v", sn)
	}
	ingest(c.b1, "s2", 128, 1)
	if sn := snap("s2"); sn.GetPrefillWorker() != "b0" || sn.GetSeqlen() != 128 || sn.GetGeneration() != 1 || sn.GetBytes() != 320 {
		t.Fatalf("group snapshot %v", sn)
	}
	ingest(c.b1, "s2", 192, 1)
	if sn := snap("s2"); sn.GetSeqlen() != 192 {
		t.Fatalf("group snapshot after rank 1 caught up: %v", sn)
	}
	// A newer generation on one rank only: no generation every rank holds.
	ingest(c.b0, "s2", 64, 2)
	if sn := snap("s2"); sn != nil {
		t.Fatalf("snapshot with ranks of two generations: %v", sn)
	}
	ingest(c.b1, "s2", 64, 2)
	// An eviction of an older generation is ignored; of the current one, the group loses it.
	must(t, st.ApplyEvent(c.b1, &kvcv1.SessionEvent{SessionId: "s2", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED, Generation: 1}))
	if sn := snap("s2"); sn.GetGeneration() != 2 {
		t.Fatalf("after an old eviction: %v", sn)
	}
	must(t, st.ApplyEvent(c.b1, &kvcv1.SessionEvent{SessionId: "s2", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED, Generation: 2}))
	if sn := snap("s2"); sn != nil {
		t.Fatalf("after rank 1 evicted it: %v", sn)
	}
	// A rank's full resync replaces its shards.
	must(t, st.Reconcile(c.b1, &kvcv1.ResidentSessions{FullSync: true, Snapshots: []*kvcv1.SnapshotHeld{{SessionId: "s2", Seqlen: 64, Generation: 2}}}))
	if sn := snap("s2"); sn.GetSeqlen() != 64 {
		t.Fatalf("after rank 1's resync: %v", sn)
	}
	must(t, st.Reconcile(c.b0, &kvcv1.ResidentSessions{FullSync: true}))
	if sn := snap("s2"); sn != nil {
		t.Fatalf("after rank 0's empty resync: %v", sn)
	}

	// A decode rank's worker dies: the group's sessions are lost, as a worker death.
	must(t, st.ApplyLoad(c.a1, &kvcv1.WorkerLoad{WorkerDown: true, WorkerDownReason: "rank 1 crashed"}))
	if r, _ := st.Session("s2"); r.GetDecodeWorker() != "" || r.GetPreviousDecodeWorker() != "a0" {
		t.Fatalf("s2 after rank 1's worker died: %v", r)
	}
	if w, _ := st.Worker("a0"); w.GetState() != workerDown || !strings.Contains(w.GetWorkerDownReason(), "rank 1 crashed") {
		t.Fatalf("group: %v", w)
	}
	if got := testutil.ToFloat64(st.m.tpProblems); got != 1 {
		t.Fatalf("kvc_cp_tp_problem_workers %v", got)
	}
}

func TestTPResendTargetsPerRank(t *testing.T) {
	c := newTPCluster(t)
	st := c.f.st
	must(t, st.ApplyEvent(c.a0, &kvcv1.SessionEvent{SessionId: "s1", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: 100, Generation: 1}))
	// Rank 1's sidecar restarted: its resync lists s1 without a target; it is named prefill
	// rank 1, with the group's snapshot as the valid base.
	for _, s := range []*Stream{c.b0, c.b1} {
		must(t, st.ApplyEvent(s, &kvcv1.SessionEvent{SessionId: "s1", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED, KvLen: 64, Generation: 1}))
	}
	rs := &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{{SessionId: "s1", KvCommittedLen: 100, Generation: 1}}}
	must(t, st.Reconcile(c.a1, rs))
	n, err := st.ResendTargets(c.a1, rs)
	if err != nil || n != 1 {
		t.Fatalf("resent %d: %v", n, err)
	}
	g := next(t, c.a1).GetSetSnapshotTarget()
	if g.GetPrefillWorkerId() != "b1" || g.GetPeerAddr() != "b1:peer" || g.GetValidBaseLen() != 64 || g.GetBaseGeneration() != 1 {
		t.Fatalf("rank 1's target %v", g)
	}
	if len(c.a0.Queue()) != 0 {
		t.Fatal("rank 0 got rank 1's target")
	}
}
