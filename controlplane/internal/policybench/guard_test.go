//go:build !race

// The race detector changes allocation counts (sync.Pool drops items at random under it).

package policybench

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/controlplane/internal/router"
	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/rs/zerolog"
)

// Regression guards of the decision path that do not time anything (issue 22 item 5): the
// allocations of a query and its outcome through Service.Handle, and the Cluster calls that
// take the state's lock, on the benchmark's workload. A change that adds an allocation or a
// trip through the state lock per request fails here, whatever the machine's load.
const (
	// maxAllocsPerPair: a query and its outcome allocate the answer, one block that holds its
	// decision id and the outcome's ack too; the reservation and the policy's scratch are
	// recycled. (13 on this workload before issue 22 item 5; 3 before its sixth round: the id
	// and the ack were allocations of their own.)
	maxAllocsPerPair = 1
	// maxLockedCallsPerPair: UpdateSession once for the query (decided on the live record) and
	// at most once for its outcome; Session (a copy under the lock) never.
	maxLockedCallsPerPair = 2
	// maxLockedCallsPerQuery: a query reads its session and records the decision's effects in
	// one trip through the state lock (UpdateSession; the policy runs inside it), never a
	// Session copy first; maxLockedCallsPerOutcome: an outcome edits the record at most once.
	maxLockedCallsPerQuery   = 1
	maxLockedCallsPerOutcome = 1
)

// countingCluster counts the calls of routertest.Cluster that take the state's lock in the real
// state (state.State): UpdateSession, Session and SendCommand.
type countingCluster struct {
	*routertest.Cluster
	updates, sessions, commands atomic.Int64
}

func (c *countingCluster) UpdateSession(id string, fn func(rec *kvcv1.SessionRecord)) {
	c.updates.Add(1)
	c.Cluster.UpdateSession(id, fn)
}

func (c *countingCluster) Session(id string) (*kvcv1.SessionRecord, bool) {
	c.sessions.Add(1)
	return c.Cluster.Session(id)
}

func (c *countingCluster) SendCommand(workerID string, cmd *kvcv1.Command) error {
	c.commands.Add(1)
	return c.Cluster.SendCommand(workerID, cmd)
}

// guardCluster is cluster() with fewer sessions (the guard needs the mix, not the size).
func guardCluster(n int) (*countingCluster, []string) {
	var ws []*kvcv1.Worker
	for i := range numP {
		ws = append(ws, routertest.Prefill(fmt.Sprintf("p%d", i)))
	}
	for i := range numD {
		ws = append(ws, routertest.Decode(fmt.Sprintf("d%02d", i), dCapacity, 0))
	}
	c := &countingCluster{Cluster: routertest.New(ws...)}
	ids := make([]string, n)
	for i := range n {
		ids[i] = fmt.Sprintf("sess-%06d", i)
		kv := int64(2000 + i%4000)
		c.PutSession(&kvcv1.SessionRecord{
			SessionId: ids[i], DecodeWorker: fmt.Sprintf("d%02d", i%numD), KvCommittedLen: kv, Turn: 3,
			LastSeenUnixMs: 1, Generation: 1,
			Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: fmt.Sprintf("p%d", i%numP), Seqlen: kv, Generation: 1,
				UpdatedUnixMs: time.Now().UnixMilli()},
		})
	}
	fakeReport(c.Cluster).all()
	return c, ids
}

func TestDecisionPathBudget(t *testing.T) {
	c, ids := guardCluster(2000)
	s := router.New(c, zerolog.Nop(), nil)
	w := &workload{ids: ids, rng: rand.New(rand.NewPCG(1, 2))}
	const n = 4000
	reqs := make([]*kvcv1.RouteRequest, n)
	outs := make([]*kvcv1.RouteRequest, n)
	for i := range reqs {
		reqs[i] = wrapQ(w.query(i))
		outs[i] = wrapO("") // its decision id is set once decided (outside the counted work)
	}
	modes := map[kvcv1.RouteMode]int{}
	locked := func() int64 { return c.updates.Load() + c.sessions.Load() }
	var maxQuery, maxOutcome int64 // the most trips through the state lock of one query, one outcome
	pair := func(i int) {
		l0 := locked()
		d := s.Handle(reqs[i]).GetDecision()
		if d == nil {
			t.Fatalf("query %d got no decision", i)
		}
		l1 := locked()
		modes[d.GetMode()]++
		o := outs[i].GetOutcome()
		o.DecisionId = d.GetDecisionId()
		if s.Handle(outs[i]).GetOutcomeAck() == nil {
			t.Fatalf("outcome %d not acknowledged", i)
		}
		maxQuery, maxOutcome = max(maxQuery, l1-l0), max(maxOutcome, locked()-l1)
	}
	for i := range n / 2 { // warm up: pools, the ledger's tables, the settling lists
		pair(i)
	}
	clear(modes)
	maxQuery, maxOutcome = 0, 0
	u0, s0, c0 := c.updates.Load(), c.sessions.Load(), c.commands.Load()
	i := n / 2
	const runs = n/2 - 1 // AllocsPerRun calls f once more before counting
	allocs := testing.AllocsPerRun(runs, func() {
		pair(i)
		i++
	})
	pairs := int64(i - n/2)
	updates, sessions, commands := c.updates.Load()-u0, c.sessions.Load()-s0, c.commands.Load()-c0
	t.Logf("per query and outcome: %.2f allocations, %.2f UpdateSession, %.2f Session, %.3f SendCommand; at most %d trips through the state lock per query, %d per outcome (modes %v)",
		allocs, float64(updates)/float64(pairs), float64(sessions)/float64(pairs), float64(commands)/float64(pairs), maxQuery, maxOutcome, modes)
	if modes[kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D] == 0 || modes[kvcv1.RouteMode_ROUTE_MODE_SEED] == 0 {
		t.Fatalf("the workload's mix is missing (modes %v): the guard measures nothing representative", modes)
	}
	if allocs > maxAllocsPerPair {
		t.Errorf("a query and its outcome allocate %.2f times, budget %d: an allocation was added to the decision path", allocs, maxAllocsPerPair)
	}
	if lim := maxLockedCallsPerPair * pairs; updates+sessions > lim {
		t.Errorf("%d UpdateSession and %d Session calls for %d queries and outcomes, budget %d: a trip through the state lock was added",
			updates, sessions, pairs, lim)
	}
	if maxQuery > maxLockedCallsPerQuery || maxOutcome > maxLockedCallsPerOutcome {
		t.Errorf("a query took the state lock %d times (budget %d), an outcome %d times (budget %d): a trip through the state lock was added",
			maxQuery, maxLockedCallsPerQuery, maxOutcome, maxLockedCallsPerOutcome)
	}
}
