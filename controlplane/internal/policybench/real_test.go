package policybench

import (
	"context"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/router"
	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// realEnv is the control plane's real leader path: a state.State leading under a fence won
// on an embedded etcd (its batcher flushing to it), with 8 P and 32 D attached the way the
// sidecar service attaches them and their residency reported the way sidecars report it.
type realEnv struct {
	cli   *clientv3.Client
	store *kvstore.Store
	reg   *prometheus.Registry // the store's and the state's metrics
	st    *state.State
	term  *state.Term
	fence kvstore.Fence
	ids   []string
	setup time.Duration // attach + reconcile + flush of the 100,000 sessions
	// report sends the workers' load reports (a sidecar sends one every loadEvery).
	report loads
}

// etcdWrites counts what the leader has written to etcd so far.
type etcdWrites struct {
	ops, txns, bytes float64 // the store's: every put and delete, fenced Txns, bytes
	// the state's volatile journal: keys put, keys deleted, session entries written
	journalKeys, journalDeletes, journalEntries float64
}

func (w etcdWrites) sub(o etcdWrites) etcdWrites {
	return etcdWrites{w.ops - o.ops, w.txns - o.txns, w.bytes - o.bytes,
		w.journalKeys - o.journalKeys, w.journalDeletes - o.journalDeletes, w.journalEntries - o.journalEntries}
}

// writes returns what the store and the state's journal have written to etcd so far.
func (e *realEnv) writes(tb testing.TB) (w etcdWrites) {
	tb.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		tb.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			v := m.GetCounter().GetValue()
			switch mf.GetName() {
			case "kvc_kvstore_ops_total":
				w.ops += v
			case "kvc_kvstore_txns_total":
				w.txns += v
			case "kvc_kvstore_bytes_total":
				w.bytes += v
			case "kvc_cp_volatile_journal_keys_written_total":
				w.journalKeys += v
			case "kvc_cp_volatile_journal_keys_deleted_total":
				w.journalDeletes += v
			case "kvc_cp_sessions_volatile_flushed_total":
				w.journalEntries += v
			}
		}
	}
	return w
}

// lead campaigns on store's election prefix and makes a new State lead under the won fence.
// The election session and the term end with tb's cleanup.
func lead(tb testing.TB, store *kvstore.Store, node string, reg prometheus.Registerer) (*state.State, *state.Term, kvstore.Fence) {
	tb.Helper()
	sess, err := concurrency.NewSession(store.Client(), concurrency.WithTTL(30))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = sess.Close() })
	el := concurrency.NewElection(sess, store.ElectionPrefix())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := el.Campaign(ctx, node); err != nil {
		tb.Fatal(err)
	}
	fence := kvstore.Fence{Key: el.Key(), Rev: el.Rev()}
	st := state.New(state.Config{NodeID: node, Store: store, Log: zerolog.Nop(), Reg: reg})
	term, err := st.Lead(ctx, fence)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { st.EndTerm(term) })
	return st, term, fence
}

// serveCommands plays the sidecar end of a stream's command queue: every command is acked
// (as a sidecar acks a command it accepted) until the state closes the stream.
func serveCommands(st *state.State, s *state.Stream) {
	for {
		select {
		case <-s.Done():
			return
		case m := <-s.Queue():
			if c := m.GetCommand(); c != nil {
				st.Ack(s, &kvcv1.CommandAck{CommandId: c.GetCommandId(), Ok: true})
			}
		}
	}
}

// newRealEnv starts etcd (removed by tb's cleanup), leads, attaches the workers, reports
// their load and their 100,000 resident sessions (D) and snapshots (P), and waits until
// every record is in etcd.
func newRealEnv(tb testing.TB) *realEnv {
	tb.Helper()
	c := etcdtest.Start(tb)
	cli := c.Client(tb)
	reg := prometheus.NewRegistry()
	store, err := kvstore.New(cli, kvstore.WithPrefix("/bench/"), kvstore.WithRegisterer(reg))
	if err != nil {
		tb.Fatal(err)
	}
	st, term, fence := lead(tb, store, "cp-bench", reg)
	env := &realEnv{cli: cli, store: store, reg: reg, st: st, term: term, fence: fence}
	start := time.Now()
	attach := func(h *kvcv1.Hello) *state.Stream {
		s, err := st.Attach(h)
		if err != nil {
			tb.Fatalf("attach %s: %v", h.WorkerId, err)
		}
		go serveCommands(st, s)
		return s
	}
	ps := make([]*state.Stream, numP)
	for i := range numP {
		id := fmt.Sprintf("p%d", i)
		ps[i] = attach(&kvcv1.Hello{WorkerId: id, Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, Node: "n" + id,
			WorkerUrl: "http://" + id, PeerAddr: id + ":7000", TransferEndpoint: id + ":7001", Transport: "tcp"})
	}
	ds := make([]*state.Stream, numD)
	for i := range numD {
		id := fmt.Sprintf("d%02d", i)
		ds[i] = attach(&kvcv1.Hello{WorkerId: id, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, Node: "n" + id,
			WorkerUrl: "http://" + id, PeerAddr: id + ":7000", TransferEndpoint: id + ":7001", Transport: "tcp",
			KvCapacityTokens: dCapacity})
	}
	used := make([]int64, numD)
	dRep := make([]*kvcv1.ResidentSessions, numD)
	pRep := make([]*kvcv1.ResidentSessions, numP)
	for i := range dRep {
		dRep[i] = &kvcv1.ResidentSessions{FullSync: true}
	}
	for i := range pRep {
		pRep[i] = &kvcv1.ResidentSessions{FullSync: true}
	}
	env.ids = make([]string, numSessions)
	for i := range numSessions {
		id := fmt.Sprintf("sess-%06d", i)
		env.ids[i] = id
		d, kv := i%numD, int64(2000+i%4000)
		used[d] += kv
		dRep[d].Sessions = append(dRep[d].Sessions, &kvcv1.ResidentSession{SessionId: id, KvCommittedLen: kv, Generation: 1})
		pRep[i%numP].Snapshots = append(pRep[i%numP].Snapshots, &kvcv1.SnapshotHeld{SessionId: id, Seqlen: kv, Generation: 1,
			Bytes: kv * 98_304})
	}
	// Steady state: each D's KV usage stays where it is (evictions balance growth), so its
	// reports carry the same figure; what the router settled since is pruned by each report.
	env.report = loads{n: len(ds) + len(ps), report: func(i int) {
		var err error
		if i < len(ds) {
			err = st.ApplyLoad(ds[i], &kvcv1.WorkerLoad{UsedTokens: used[i]})
		} else {
			err = st.ApplyLoad(ps[i-len(ds)], &kvcv1.WorkerLoad{SnapshotBytesCapacity: 1 << 40})
		}
		if err != nil {
			panic(err)
		}
	}}
	for i, s := range ds {
		if err := st.Reconcile(s, dRep[i]); err != nil {
			tb.Fatal(err)
		}
	}
	for i, s := range ps {
		if err := st.Reconcile(s, pRep[i]); err != nil {
			tb.Fatal(err)
		}
	}
	env.report.all()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := st.Flush(ctx); err != nil {
		tb.Fatal(err)
	}
	env.setup = time.Since(start)
	if n := st.SessionCount(); n != numSessions {
		tb.Fatalf("state holds %d sessions, want %d", n, numSessions)
	}
	return env
}

// stateMemory writes n realistic session records into etcd under their own prefix (as a
// previous leader's batcher left them), then measures the heap a new State leader holds
// after loading them (runtime.MemStats HeapAlloc after GC, before and after Lead). The etcd
// member runs in this process: its own memory grows while the records are written, before
// the first reading, and is not counted.
func stateMemory(tb testing.TB, cli *clientv3.Client, n int) (total uint64, loaded int, loadTime time.Duration) {
	tb.Helper()
	store, err := kvstore.New(cli, kvstore.WithPrefix("/bench-mem/"))
	if err != nil {
		tb.Fatal(err)
	}
	sess, err := concurrency.NewSession(cli, concurrency.WithTTL(30))
	if err != nil {
		tb.Fatal(err)
	}
	defer func() { _ = sess.Close() }()
	el := concurrency.NewElection(sess, store.ElectionPrefix())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := el.Campaign(ctx, "cp-mem"); err != nil {
		tb.Fatal(err)
	}
	fence := kvstore.Fence{Key: el.Key(), Rev: el.Rev()}
	now := time.Now().UnixMilli()
	const perTxn = kvstore.DefaultMaxOps
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(4)
	for lo := 0; lo < n; lo += perTxn {
		hi := min(lo+perTxn, n)
		g.Go(func() error {
			ops := make([]kvstore.Op, 0, hi-lo)
			for i := lo; i < hi; i++ {
				id := fmt.Sprintf("agent-run-%08d-session-%06d", i/7, i)
				b, err := proto.Marshal(&kvcv1.SessionRecord{
					SessionId: id, DecodeWorker: fmt.Sprintf("d%02d", i%numD),
					KvCommittedLen: int64(1000 + i%90_000), Turn: int32(i % 50), LastSeenUnixMs: now, CreatedUnixMs: now,
					Epoch: fence.Rev, Generation: 3,
					Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: fmt.Sprintf("p%d", i%numP), Seqlen: int64(1000 + i%90_000),
						Generation: 3, UpdatedUnixMs: now, Bytes: int64(1000+i%90_000) * 98_304},
				})
				if err != nil {
					return err
				}
				ops = append(ops, kvstore.Op{Key: store.SessionKey(id), Value: b})
			}
			return store.Apply(gctx, fence, ops)
		})
	}
	if err := g.Wait(); err != nil {
		tb.Fatal(err)
	}
	st := state.New(state.Config{NodeID: "cp-mem", Store: store, Log: zerolog.Nop()})
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	term, err := st.Lead(ctx, fence)
	if err != nil {
		tb.Fatal(err)
	}
	loadTime = time.Since(start)
	runtime.GC()
	runtime.ReadMemStats(&after)
	loaded = st.SessionCount()
	st.EndTerm(term)
	if after.HeapAlloc > before.HeapAlloc {
		total = after.HeapAlloc - before.HeapAlloc
	}
	// Leave etcd small again for whatever runs next in this process.
	if _, err := cli.Delete(ctx, store.Prefix(), clientv3.WithPrefix()); err != nil {
		tb.Fatal(err)
	}
	return total, loaded, loadTime
}

// BenchmarkRealHandle is one query and its outcome through Service.Handle on the real leader
// (state.State under a fence, batcher flushing to embedded etcd), for profiling
// (go test -bench RealHandle -cpuprofile cpu.out).
func BenchmarkRealHandle(b *testing.B) {
	env := newRealEnv(b)
	s := router.New(env.st, zerolog.Nop(), nil)
	defer reportLoads(env.report)()
	w := &workload{ids: env.ids, rng: rand.New(rand.NewPCG(1, 2))}
	reqs := make([]*kvcv1.RouteRequest, 4096)
	for i := range reqs {
		reqs[i] = wrapQ(w.query(i))
	}
	stop := callgrindWindow()
	for i := 0; b.Loop(); i++ { // b.Loop: the set-up above runs once, also with -benchtime Nx
		handlePair(s, reqs[i%len(reqs)])
	}
	stop()
}

// handlePair is one query and its outcome through Service.Handle: the loop body of
// BenchmarkRealHandle and BenchmarkHandle in a function of its own, so that an instruction
// count can be confined to it (valgrind --tool=callgrind --toggle-collect='*policybench.handlePair').
//
//go:noinline
func handlePair(s *router.Service, req *kvcv1.RouteRequest) {
	id := s.Handle(req).GetDecision().GetDecisionId()
	s.Handle(wrapO(id))
}

// BenchmarkRealStream is the headline's stream part alone on the real leader: b.N queries
// pipelined on one Route stream (at most streamWindow unanswered), every outcome reported on
// the same stream, for profiling the stream path (go test -bench RealStream -cpuprofile cpu.out).
func BenchmarkRealStream(b *testing.B) { realStream(b, streamLoad{window: streamWindow}) }

// openRateFlag is BenchmarkRealStreamOpen's offered rate.
var openRateFlag = flag.Float64("policybench.open-rate", openRate, "BenchmarkRealStreamOpen's offered queries per second")

// BenchmarkRealStreamOpen is the headline's open-loop stream run alone on the real leader: b.N
// queries offered at -policybench.open-rate (default openRate) per second on one Route stream
// whatever the answers, every outcome on the same stream, for profiling what bounds the
// stream's rate.
func BenchmarkRealStreamOpen(b *testing.B) {
	if r := *openRateFlag; !(r > 0) || math.IsInf(r, 0) {
		b.Fatalf("-policybench.open-rate %v: want a finite rate above 0 queries/s", r)
	}
	realStream(b, streamLoad{rate: *openRateFlag})
}

// realStream runs b.N queries on one Route stream over the real leader as load says, after a
// closed-loop warm-up, and reports decisions/s and the p99.
func realStream(b *testing.B, load streamLoad) {
	env := newRealEnv(b)
	s := router.New(env.st, zerolog.Nop(), nil)
	defer reportLoads(env.report)()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = s.Run(ctx) }()
	w := &workload{ids: env.ids, rng: rand.New(rand.NewPCG(1, 2))}
	overStream(b, s, w, 5_000, streamLoad{window: streamWindow}) // warm up
	b.ResetTimer()
	perSec, p99 := overStream(b, s, w, max(b.N, 100), load)
	b.ReportMetric(perSec, "decisions/s")
	b.ReportMetric(float64(p99.Microseconds()), "p99-µs")
}
