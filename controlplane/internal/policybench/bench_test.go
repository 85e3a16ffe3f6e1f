package policybench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/controlplane/internal/router"
	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

const (
	// streamWindow: queries in flight on the stream (a gateway pipelines this many).
	streamWindow = 4
	numP         = 8
	numD         = 32
	numSessions  = 100_000
	dCapacity    = 20_000_000 // tokens per decode worker
	realQueries  = 60_000     // queries timed on the real leader path, in process and over the stream
	oneAtATime   = 20_000     // queries on the real leader's stream with a window of 1 (its round trip)
	openRate     = 50_000     // queries/s offered on the real leader's stream open loop (issue 22's target)
)

// cluster builds 8 P, 32 D and 100,000 sessions resident on the Ds (snapshots on the Ps).
func cluster() (*routertest.Cluster, []string) {
	var ws []*kvcv1.Worker
	for i := range numP {
		ws = append(ws, routertest.Prefill(fmt.Sprintf("p%d", i)))
	}
	for i := range numD {
		ws = append(ws, routertest.Decode(fmt.Sprintf("d%02d", i), dCapacity, 0))
	}
	c := routertest.New(ws...)
	used := make([]int64, numD)
	ids := make([]string, numSessions)
	for i := range numSessions {
		ids[i] = fmt.Sprintf("sess-%06d", i)
		d := i % numD
		kv := int64(2000 + i%4000)
		used[d] += kv
		c.PutSession(&kvcv1.SessionRecord{
			SessionId: ids[i], DecodeWorker: fmt.Sprintf("d%02d", d), KvCommittedLen: kv, Turn: 3,
			LastSeenUnixMs: 1, Generation: 1,
			Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: fmt.Sprintf("p%d", i%numP), Seqlen: kv, Generation: 1,
				UpdatedUnixMs: time.Now().UnixMilli()},
		})
	}
	for d := range numD {
		c.UpdateWorker(fmt.Sprintf("d%02d", d), func(w *kvcv1.Worker) { w.Load.UsedTokens = used[d] })
	}
	return c, ids
}

// loadEvery is how often every worker reports its load (a sidecar reports about once a
// second); each report lets the router drop the tokens it settled before it.
const loadEvery = time.Second

// loads are a cluster's load reports: report(i) sends worker i's, for i in [0, n).
type loads struct {
	n      int
	report func(i int)
}

// all sends every worker's report once.
func (l loads) all() {
	for i := range l.n {
		l.report(i)
	}
}

// reportLoads has every worker report once per loadEvery, each at its own phase (worker i at
// i/n of the interval, as the sidecars' heartbeats are spread), until the returned stop is
// called. (All 40 at once each second, as before, made a burst of 40 state-lock holds and
// worker snapshots that no cluster of independent sidecars sends.)
func reportLoads(l loads) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(loadEvery / time.Duration(l.n))
		defer t.Stop()
		for i := 0; ; i = (i + 1) % l.n {
			select {
			case <-done:
				return
			case <-t.C:
				l.report(i)
			}
		}
	}()
	return func() { close(done); wg.Wait() }
}

// fakeReport refreshes each worker's heartbeat in the fake cluster (load unchanged: steady state).
func fakeReport(c *routertest.Cluster) loads {
	ws := c.Workers()
	return loads{n: len(ws), report: func(i int) {
		c.UpdateWorker(ws[i].WorkerId, func(w *kvcv1.Worker) { w.LastHeartbeatUnixMs = time.Now().UnixMilli() })
	}}
}

// workload: the trace's mix — mostly direct-to-D appends of resident sessions, some new
// sessions, some large appends — each query with its request span's traceparent, as the
// gateway always sends one (not sampled: a gateway exporting no traces).
type workload struct {
	ids  []string
	rng  *rand.Rand
	next int
}

// traceparents are the queries' request spans, one per query in turn (as many traces as a
// gateway's concurrent requests).
var traceparents = func() []string {
	tps := make([]string, 1024)
	for i := range tps {
		tps[i] = fmt.Sprintf("00-%032x-%016x-00", 0x4bf92f3577b34da6+i, 0x00f067aa0ba902b7+i)
	}
	return tps
}()

func (w *workload) query(i int) *kvcv1.RouteQuery {
	r := w.rng.IntN(100)
	tp := traceparents[i%len(traceparents)]
	switch {
	case r < 90: // resident, small append
		id := w.ids[w.rng.IntN(len(w.ids))]
		return &kvcv1.RouteQuery{RequestId: fmt.Sprint(i), SessionId: id, InputTokens: 6500, MaxOutputTokens: 256, Traceparent: tp}
	case r < 97: // new session
		w.next++
		return &kvcv1.RouteQuery{RequestId: fmt.Sprint(i), SessionId: fmt.Sprintf("new-%d", w.next), InputTokens: 3000, MaxOutputTokens: 256, MultiturnHint: true, Traceparent: tp}
	default: // large append
		id := w.ids[w.rng.IntN(len(w.ids))]
		return &kvcv1.RouteQuery{RequestId: fmt.Sprint(i), SessionId: id, InputTokens: 40_000, MaxOutputTokens: 256, Traceparent: tp}
	}
}

func wrapQ(q *kvcv1.RouteQuery) *kvcv1.RouteRequest {
	return &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: q}}
}

// wrapO is a successful outcome marked no_ack, as the gateway sends it (Handle answers it in
// process all the same; a Route stream sends nothing back for it).
func wrapO(id string) *kvcv1.RouteRequest {
	return &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{
		DecisionId: id, Success: true, ErrorKind: kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_NONE, TtftUs: 40_000, NoAck: true}}}
}

// outcomeSender sends a stream run's outcomes from its one sending goroutine: all no_ack but
// the n-th and last, whose acknowledgement tells the receiver that the stream's every message
// was handled (a stream's messages are handled in order).
type outcomeSender struct {
	b    *testing.B
	st   kvcv1.RouterService_RouteClient
	n, i int
}

func (o *outcomeSender) send(id string) {
	o.i++
	req := wrapO(id)
	req.GetOutcome().NoAck = o.i < o.n
	if err := o.st.Send(req); err != nil {
		o.b.Fatal(err)
	}
}

// inProcess measures Service.Handle on queries (validation, policy, reservation, session
// update), with each batch's outcomes reported untimed so reservations do not pile up.
func inProcess(s *router.Service, w *workload, n int) (nsPerDecision float64, modes map[string]int) {
	modes = map[string]int{}
	const batch = 1000
	reqs := make([]*kvcv1.RouteRequest, batch)
	decs := make([]*kvcv1.RouteDecision, batch)
	var total time.Duration
	for done := 0; done < n; done += batch {
		for i := range reqs {
			reqs[i] = wrapQ(w.query(done + i))
		}
		start := time.Now()
		for i, r := range reqs {
			decs[i] = s.Handle(r).GetDecision()
		}
		total += time.Since(start)
		for i, d := range decs {
			if d.GetDecisionId() == "" {
				panic(fmt.Sprintf("query %v got no decision", reqs[i]))
			}
			modes[router.ModeName(d.GetMode())+"/"+router.ReasonName(d.GetReason())]++
			resp := s.Handle(wrapO(d.GetDecisionId()))
			if resp.GetOutcomeAck() == nil {
				panic(fmt.Sprint(resp))
			}
		}
	}
	return float64(total.Nanoseconds()) / float64(n), modes
}

// pureDecide measures policy.Decide alone on the same cluster (no locks, no state).
func pureDecide(c *routertest.Cluster, w *workload, n int) float64 {
	k := policy.Compile(c.Policy())
	workers := c.Workers()
	led := emptyLedger{}
	ins := make([]policy.Input, 1000)
	var total time.Duration
	for done := 0; done < n; done += len(ins) {
		for i := range ins {
			q := w.query(i)
			rec, _ := c.Session(q.SessionId)
			ins[i] = policy.Input{Knobs: k, Query: policy.Query{SessionID: q.SessionId, InputTokens: q.InputTokens,
				MaxOutputTokens: q.MaxOutputTokens, MultiturnHint: q.MultiturnHint, Turn: 4}, Session: rec, Workers: workers, Ledger: led}
		}
		start := time.Now()
		for i := range ins {
			_ = policy.Decide(&ins[i])
		}
		total += time.Since(start)
	}
	return float64(total.Nanoseconds()) / float64(n)
}

type emptyLedger struct{}

func (emptyLedger) Reserved(string) policy.Reserved { return policy.Reserved{} }
func (emptyLedger) TransferPending(string) bool     { return false }

// streamLoad is how overStream offers its queries: closed loop (window > 0: at most window
// unanswered, the next sent when an answer frees a slot, so the rate is window / round trip)
// or open loop (rate > 0: query i sent at start + i/rate whatever the answers, as a gateway's
// stream carries the queries of many independent clients; at most openLoopCap unanswered).
type streamLoad struct {
	window int
	rate   float64
}

// openLoopCap bounds the unanswered queries of an open-loop run: a stream that cannot keep up
// makes the sender wait here, and the achieved rate falls below the offered one.
const openLoopCap = 4096

// overStream sends n queries on one Route stream over loopback as load says, reports every
// decision's outcome on the same stream, and measures decisions/s and the p99 of
// query-to-decision latency (from the query's Send to its decision's Recv).
func overStream(b *testing.B, s *router.Service, w *workload, n int, load streamLoad) (perSec float64, p99 time.Duration) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := grpcx.NewServer(zerolog.Nop(), grpcx.WithCallLogging(false))
	s.Register(srv)
	ctx, cancel := context.WithCancel(context.Background())
	var serveWG sync.WaitGroup
	serveWG.Add(1)
	go func() { defer serveWG.Done(); _ = srv.Serve(ctx, lis, time.Second) }()
	defer func() { cancel(); serveWG.Wait() }()
	conn, err := grpc.NewClient(lis.Addr().String(), append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	st, err := kvcv1.NewRouterServiceClient(conn).Route(ctx)
	if err != nil {
		b.Fatal(err)
	}
	reqs := make([]*kvcv1.RouteRequest, n)
	for i := range reqs {
		reqs[i] = wrapQ(w.query(i))
	}
	sent := make([]time.Time, n)
	lat := make([]time.Duration, 0, n)
	window := load.window
	if load.rate > 0 {
		window = openLoopCap
	}
	slots := make(chan struct{}, window)
	outcomes := make(chan string, n) // never blocks the receiver (no send/recv cycle through flow control)
	recvErr := make(chan error, 1)
	start := time.Now()
	go func() {
		got := 0
		acks := 0
		for got < n || acks < 1 { // the last outcome's acknowledgement (outcomeSender)
			resp, err := st.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			switch {
			case resp.GetDecision() != nil:
				d := resp.GetDecision()
				i, err := strconv.Atoi(d.RequestId) // the query's index (fmt.Sscan cost the receiver ~1 µs)
				if err != nil || i < 0 || i >= n {
					recvErr <- fmt.Errorf("decision for request %q, not one of ours", d.RequestId)
					return
				}
				lat = append(lat, time.Since(sent[i]))
				got++
				<-slots
				outcomes <- d.DecisionId
			case resp.GetOutcomeAck() != nil:
				acks++
			default:
				recvErr <- fmt.Errorf("error answer: %v", resp)
				return
			}
		}
		close(outcomes)
		recvErr <- nil
	}()
	i := 0
	out := &outcomeSender{b: b, st: st, n: n}
	if load.rate > 0 {
		openLoop(b, st, reqs, sent, slots, outcomes, out, start, load.rate)
		i = n
	}
	for i < n {
		select {
		case id := <-outcomes:
			out.send(id)
		case slots <- struct{}{}:
			sent[i] = time.Now()
			if err := st.Send(reqs[i]); err != nil {
				b.Fatal(err)
			}
			i++
		}
	}
	for id := range outcomes {
		out.send(id)
	}
	if err := <-recvErr; err != nil {
		b.Fatal(err)
	}
	elapsed := time.Since(start)
	_ = st.CloseSend()
	slices.Sort(lat)
	return float64(n) / elapsed.Seconds(), lat[len(lat)*99/100]
}

// openLoop is overStream's sender at an offered rate: query i is due at start + i/rate and is
// sent as soon as it is due, with every query already due before it (a late sender catches up
// in a burst, so the offered rate holds on average); outcomes go out between queries. It waits
// for the next due time by yielding (runtime.Gosched), not by sleeping: a Go timer shorter than
// a millisecond fires up to a millisecond late on an idle machine, which would turn 20 µs
// spacing into bursts of fifty.
func openLoop(b *testing.B, st kvcv1.RouterService_RouteClient, reqs []*kvcv1.RouteRequest, sent []time.Time,
	slots chan struct{}, outcomes <-chan string, out *outcomeSender, start time.Time, rate float64) {
	interval := float64(time.Second) / rate
	for i := 0; i < len(reqs); {
		select {
		case id := <-outcomes:
			out.send(id)
			continue
		default:
		}
		now := time.Now()
		if now.Sub(start) < time.Duration(float64(i)*interval) {
			runtime.Gosched()
			continue
		}
		slots <- struct{}{}
		sent[i] = now
		if err := st.Send(reqs[i]); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// modeMix formats a count of decisions by mode as percentages, modes in name order.
func modeMix(m map[string]int) string {
	total := 0
	names := make([]string, 0, len(m))
	for k, n := range m {
		total += n
		names = append(names, k)
	}
	slices.Sort(names)
	parts := make([]string, len(names))
	for i, k := range names {
		parts[i] = fmt.Sprintf("%s %.1f%%", k, 100*float64(m[k])/float64(total))
	}
	return strings.Join(parts, ", ")
}

// BenchmarkPolicy is `make bench-policy`. It prints, in order: the fake-cluster lines
// (routertest.Cluster: the policy and the router's ledger with no state behind them), the
// memory of 1,000,000 sessions held by a real state.State leader, and last the headline
// measured on the real leader path (state.State leading under a fence on embedded etcd, its
// write-behind batcher flushing every change, workers attached and reporting residency
// through the state's sidecar API, the router served by pkg/grpcx on a loopback listener).
func BenchmarkPolicy(b *testing.B) {
	// Fake cluster: isolates the policy and the router from the state.
	c, ids := cluster()
	fs := router.New(c, zerolog.Nop(), nil)
	fakeReport(c).all()
	stopFake := reportLoads(fakeReport(c))
	fw := &workload{ids: ids, rng: rand.New(rand.NewPCG(1, 2))}
	inProcess(fs, fw, 20_000) // warm up
	fakeNs, fakeModes := inProcess(fs, fw, 100_000)
	pure := pureDecide(c, fw, 100_000)
	fakePerSec, fakeP99 := overStream(b, router.New(c, zerolog.Nop(), nil), fw, 100_000, streamLoad{window: streamWindow})
	stopFake()
	c, fs = nil, nil //nolint:ineffassign // dropped so that runtime.GC below frees them
	runtime.GC()

	// Real leader path.
	env := newRealEnv(b)
	rs := router.New(env.st, zerolog.Nop(), nil)
	stopReal := reportLoads(env.report)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = rs.Run(ctx) }()
	w := &workload{ids: env.ids, rng: rand.New(rand.NewPCG(1, 2))}
	inProcess(rs, w, 20_000) // warm up
	fctx, fcancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer fcancel()
	if err := env.st.Flush(fctx); err != nil {
		b.Fatal(err)
	}
	w0 := env.writes(b)
	ns, realModes := inProcess(rs, w, realQueries)
	perSec, p99 := overStream(b, rs, w, realQueries, streamLoad{window: streamWindow})
	if err := env.st.Flush(fctx); err != nil { // every change of the run reached etcd under the fence
		b.Fatal(err)
	}
	stopReal()
	wr := env.writes(b).sub(w0)
	sessions := env.st.SessionCount()
	// The same stream one query at a time: its round trip with nothing queued (the query's
	// decision, then its outcome sent with the next query), what a window of 4 pipelines.
	stopOne := reportLoads(env.report)
	onePerSec, oneP99 := overStream(b, rs, w, oneAtATime, streamLoad{window: 1})
	// The same stream open loop: queries offered at openRate whatever the answers, as a
	// gateway's stream carries many clients' turns; the closed loop's rate above is bounded by
	// window / round trip, this one by what the stream and the router sustain.
	openPerSec, openP99 := overStream(b, rs, w, realQueries, streamLoad{rate: openRate})
	stopOne()

	// 1,000,000 records take about 35 s to write into etcd on 2 cores; measure a quarter
	// of them held by the real state and scale (the tables grow linearly).
	const memN = 250_000
	memTotal, loaded, loadTime := stateMemory(b, env.cli, memN)
	if loaded != memN {
		b.Fatalf("state loaded %d of %d sessions", loaded, memN)
	}

	b.ReportMetric(ns, "ns/decision")
	b.ReportMetric(perSec, "decisions/s")
	b.ReportMetric(float64(p99.Microseconds()), "p99-µs")
	fmt.Printf("policy-detail: fake cluster (routertest.Cluster, no state): policy.Decide alone %.0f ns/decision; router %.0f ns/decision in-process, %.0f decisions/s over one Route stream, p99 %d µs\n",
		pure, fakeNs, fakePerSec, fakeP99.Microseconds())
	fmt.Printf("policy-detail: real leader: state.State under an etcd fence, write-behind batcher; 8 P, 32 D attached, %d resident sessions reported (setup+flush %.1f s, %d sessions after the run); %d CPUs\n",
		numSessions, env.setup.Seconds(), sessions, runtime.GOMAXPROCS(0))
	fmt.Printf("policy-detail: decisions in process: fake cluster %s; real leader %s\n", modeMix(fakeModes), modeMix(realModes))
	fmt.Printf("policy-detail: real leader wrote %.0f records, %.0f volatile journal keys (%.0f sessions' volatile changes) and %.0f journal deletes to etcd, %.1f MB, in %.0f fenced Txns for the %d timed decisions (in process and over the stream) with their outcomes: %.3f writes/decision\n",
		wr.ops-wr.journalKeys-wr.journalDeletes, wr.journalKeys, wr.journalEntries, wr.journalDeletes, wr.bytes/1e6, wr.txns,
		2*realQueries, wr.ops/float64(2*realQueries))
	fmt.Printf("policy-detail: Route stream: %d queries (fake: %d) pipelined (at most %d unanswered), each outcome reported on the same stream, no_ack as the gateway sends it (the last acknowledged); grpcx server on 127.0.0.1:0\n",
		realQueries, 100_000, streamWindow)
	fmt.Printf("policy-detail: Route stream one query at a time (window 1, %d queries, after the run above): %.0f decisions/s, a round trip of %.0f µs (the query's decision, then its outcome and the next query), p99 %d µs\n",
		oneAtATime, onePerSec, 1e6/onePerSec, oneP99.Microseconds())
	fmt.Printf("policy-detail: Route stream open loop (%d queries offered at %d/s, each sent when due whatever the answers, after the runs above): %.0f decisions/s, p99 %d µs\n",
		realQueries, openRate, openPerSec, openP99.Microseconds())
	per := float64(memTotal) / float64(memN)
	fmt.Printf("policy-memory: %d sessions held by a state.State leader (loaded from etcd in %.1f s) take %.0f MiB, %.0f bytes/session: 1,000,000 sessions ≈ %.0f MiB (target <= 1024 MiB)\n",
		memN, loadTime.Seconds(), float64(memTotal)/(1<<20), per, per*1e6/(1<<20))
	fmt.Printf("policy: %.0f ns/decision in-process, %.0f decisions/s over one Route stream, p99 %d µs; open loop at %d/s: %.0f decisions/s, p99 %d µs\n",
		ns, perSec, p99.Microseconds(), openRate, openPerSec, openP99.Microseconds())
}

// BenchmarkHandle is one query and its outcome through Service.Handle, for profiling
// (go test -bench Handle -cpuprofile cpu.out).
func BenchmarkHandle(b *testing.B) {
	c, ids := cluster()
	s := router.New(c, zerolog.Nop(), nil)
	w := &workload{ids: ids, rng: rand.New(rand.NewPCG(1, 2))}
	reqs := make([]*kvcv1.RouteRequest, 4096)
	for i := range reqs {
		reqs[i] = wrapQ(w.query(i))
	}
	stop := callgrindWindow()
	for i := 0; b.Loop(); i++ {
		handlePair(s, reqs[i%len(reqs)])
	}
	stop()
}
