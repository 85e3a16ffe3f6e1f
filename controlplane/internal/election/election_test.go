package election

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	"github.com/kvcentric/kvcentric/pkg/netproxy"
)

type replica struct {
	el     *Elector
	terms  chan kvstore.Fence // a term started (after serving)
	ended  chan kvstore.Fence // a term ended
	cancel context.CancelFunc
	done   chan struct{}
}

func startReplica(t *testing.T, cli *clientv3.Client, id string) *replica {
	t.Helper()
	el, err := New(Config{Client: cli, Prefix: "/e/leader/", NodeID: id, Addr: id + ":7400", TTL: 2 * time.Second, Log: zerolog.Nop(), Reg: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &replica{el: el, terms: make(chan kvstore.Fence, 8), ended: make(chan kvstore.Fence, 8), cancel: cancel, done: make(chan struct{})}
	go func() { _ = el.Observe(ctx) }()
	go func() {
		defer close(r.done)
		_ = el.Run(ctx, func(lctx context.Context, f kvstore.Fence, serving func()) error {
			serving()
			r.terms <- f
			<-lctx.Done()
			r.ended <- f
			return nil
		})
	}()
	t.Cleanup(func() { cancel(); <-r.done })
	return r
}

func recv(t *testing.T, ch chan kvstore.Fence, what string) kvstore.Fence {
	t.Helper()
	select {
	case f := <-ch:
		return f
	case <-time.After(15 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
	return kvstore.Fence{}
}

func TestElection(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	a := startReplica(t, cli, "a")
	fa := recv(t, a.terms, "a leads")
	if !a.el.IsLeader() {
		t.Fatal("a not leader after serving")
	}
	b := startReplica(t, cli, "b")
	var seen atomic.Bool
	deadline := time.Now().Add(10 * time.Second)
	for !seen.Load() && time.Now().Before(deadline) {
		l, ok := b.el.Current()
		seen.Store(ok && l.NodeID == "a" && l.Addr == "a:7400" && l.Epoch == fa.Rev)
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
	if !seen.Load() || b.el.IsLeader() {
		t.Fatal("standby does not observe a as leader")
	}
	if h := b.el.Hint(); h.GetLeaderAddr() != "a:7400" || h.GetEpoch() != fa.Rev {
		t.Fatalf("hint %v", h)
	}

	// Step down: a resigns, b takes over with a higher epoch.
	a.el.StepDown("test")
	recv(t, a.ended, "a's term ends")
	fb := recv(t, b.terms, "b leads")
	if fb.Rev <= fa.Rev || a.el.IsLeader() {
		t.Fatalf("epochs a %d b %d", fa.Rev, fb.Rev)
	}

	// Session loss: revoke b's lease behind its back; its term must end, and a replica leads
	// again with a higher epoch (b may win again: a waits one TTL after stepping down).
	resp, err := cli.Get(t.Context(), fb.Key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(resp.Kvs[0].Lease)); err != nil {
		t.Fatal(err)
	}
	recv(t, b.ended, "b's term ends after session loss")
	var next kvstore.Fence
	select {
	case next = <-a.terms:
	case next = <-b.terms:
	case <-time.After(15 * time.Second):
		t.Fatal("no leader after b's session was lost")
	}
	if next.Rev <= fb.Rev || next.Key == fb.Key {
		t.Fatalf("epoch did not grow: %d <= %d", next.Rev, fb.Rev)
	}
}

func TestNewValidates(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	for _, cfg := range []Config{
		{Prefix: "/p/", NodeID: "a", TTL: 2 * time.Second},
		{Client: cli, NodeID: "a", TTL: 2 * time.Second},
		{Client: cli, Prefix: "/p/", TTL: 2 * time.Second},
		{Client: cli, Prefix: "/p/", NodeID: "a", TTL: 100 * time.Millisecond},
		{Client: cli, Prefix: "/p/", NodeID: "a", TTL: 2 * time.Second, RenewDeadline: 2 * time.Second},
		{Client: cli, Prefix: "/p/", NodeID: "a", TTL: 2 * time.Second, RenewDeadline: -time.Second},
		{Client: cli, Prefix: "/p/", NodeID: "a", TTL: 2 * time.Second, RenewDeadline: time.Second, RenewInterval: time.Second},
	} {
		if _, err := New(cfg); err == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
}

// TestRenewDeadlineStepsDown cuts the leader off from etcd (a black hole, no connection
// closed): it must stop being leader on its own clock within the renew deadline, before etcd
// expires its lease; the other replica leads after the TTL; after Heal the first one is a
// standby observing the new leader.
func TestRenewDeadlineStepsDown(t *testing.T) {
	c := etcdtest.Start(t)
	px, err := netproxy.New(strings.TrimPrefix(c.Endpoints()[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	cutCli, err := clientv3.New(clientv3.Config{
		Endpoints: []string{"http://" + px.Addr()}, DialTimeout: 5 * time.Second,
		DialKeepAliveTime: time.Second, DialKeepAliveTimeout: time.Second, Logger: zap.NewNop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cutCli.Close() })

	a := startReplica(t, cutCli, "a")
	fa := recv(t, a.terms, "a leads")
	b := startReplica(t, c.Client(t), "b")
	waitCond(t, "b observes a", 10*time.Second, func() bool {
		l, ok := b.el.Current()
		return ok && l.NodeID == "a"
	})

	cut := time.Now()
	px.Blackhole()
	waitCond(t, "a stops leading", 2*time.Second, func() bool { return !a.el.IsLeader() })
	stepped := time.Since(cut)
	if l, ok := a.el.Current(); ok && l.NodeID == "a" {
		t.Fatalf("a names itself as leader after stepping down: %+v", l)
	}
	recv(t, a.ended, "a's term ends")
	if ttl := 2 * time.Second; stepped >= ttl {
		t.Fatalf("a stopped leading %s after the cut, want < TTL %s", stepped, ttl)
	}
	fb := recv(t, b.terms, "b leads")
	took := time.Since(cut)
	t.Logf("cut-off leader stepped down after %s (renew deadline %s); b leads after %s", stepped, a.el.RenewDeadline(), took)
	if fb.Rev <= fa.Rev {
		t.Fatalf("epoch %d after %d", fb.Rev, fa.Rev)
	}
	if took < 2*time.Second-a.el.RenewDeadline() {
		t.Fatalf("b led %s after the cut: before a's lease could expire", took)
	}
	if n := testutil.ToFloat64(a.el.lost.WithLabelValues("renew_deadline")); n != 1 {
		t.Fatalf("renew_deadline terms %v, want 1", n)
	}

	px.Heal()
	waitCond(t, "a observes b", 15*time.Second, func() bool {
		l, ok := a.el.Current()
		return ok && l.NodeID == "b" && l.Epoch == fb.Rev
	})
	if a.el.IsLeader() || !b.el.IsLeader() {
		t.Fatalf("after heal: a leader %v, b leader %v", a.el.IsLeader(), b.el.IsLeader())
	}
}

func waitCond(t *testing.T, what string, limit time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", limit, what)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
}

// TestCampaignSessionLost is reliability scenario 5: the standby's lease is revoked while it
// waits in Campaign. It must notice, create a new session and campaign again, never
// reporting leadership without its key; when the leader steps down it leads under the key of
// its new session.
func TestCampaignSessionLost(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	a := startReplica(t, cli, "a")
	fa := recv(t, a.terms, "a leads")
	b := startReplica(t, cli, "b")
	var first *mvccKV
	waitCond(t, "b campaigns", 10*time.Second, func() bool {
		first = campaignKey(t, cli, "b")
		return first != nil
	})
	if _, err := cli.Revoke(t.Context(), clientv3.LeaseID(first.lease)); err != nil {
		t.Fatal(err)
	}
	var second *mvccKV
	waitCond(t, "b campaigns again with a new session", 10*time.Second, func() bool {
		second = campaignKey(t, cli, "b")
		return second != nil && second.key != first.key
	})
	if b.el.IsLeader() {
		t.Fatal("b reports leadership while a leads")
	}
	a.el.StepDown("test")
	fb := recv(t, b.terms, "b leads")
	if fb.Key != second.key || fb.Rev != second.createRev || fb.Rev <= fa.Rev {
		t.Fatalf("b leads with %+v, want its new key %+v", fb, second)
	}
}

type mvccKV struct {
	key       string
	createRev int64
	lease     int64
}

// campaignKey returns node's election key (nil when it has none).
func campaignKey(t *testing.T, cli *clientv3.Client, node string) *mvccKV {
	t.Helper()
	resp, err := cli.Get(t.Context(), "/e/leader/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range resp.Kvs {
		if strings.Contains(string(kv.Value), `"node_id":"`+node+`"`) {
			return &mvccKV{key: string(kv.Key), createRev: kv.CreateRevision, lease: kv.Lease}
		}
	}
	return nil
}

// TestStandbyCutOffFromEtcd is issue 16 findings 3 and 6 at the elector: a standby whose etcd
// link is black-holed while it waits in Campaign stops naming the leader within the TTL (it
// cannot know whether that leader still leads), names it again after the link heals, and its
// Run returns within a second of its context ending although etcd still does not answer (a
// cancelled Campaign resigns through the client's own context, which never ends).
func TestStandbyCutOffFromEtcd(t *testing.T) {
	c := etcdtest.Start(t)
	px, err := netproxy.New(strings.TrimPrefix(c.Endpoints()[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	cutCli, err := clientv3.New(clientv3.Config{
		Endpoints: []string{"http://" + px.Addr()}, DialTimeout: 5 * time.Second,
		DialKeepAliveTime: time.Second, DialKeepAliveTimeout: time.Second, Logger: zap.NewNop(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cutCli.Close() })
	a := startReplica(t, c.Client(t), "a")
	recv(t, a.terms, "a leads")
	b := startReplica(t, cutCli, "b")
	waitCond(t, "b campaigns", 10*time.Second, func() bool { return campaignKey(t, c.Client(t), "b") != nil })
	waitCond(t, "b observes a", 10*time.Second, func() bool { l, ok := b.el.Current(); return ok && l.NodeID == "a" })

	cut := time.Now()
	px.Blackhole()
	waitCond(t, "b stops naming a", 2*time.Second+2*time.Second, func() bool { _, ok := b.el.Current(); return !ok })
	t.Logf("standby stopped naming the leader %s after its etcd link went dark (TTL 2s)", time.Since(cut))
	if !a.el.IsLeader() {
		t.Fatal("a lost leadership although it reaches etcd")
	}
	px.Heal()
	waitCond(t, "b names a again", 10*time.Second, func() bool { l, ok := b.el.Current(); return ok && l.NodeID == "a" })

	waitCond(t, "b waits in Campaign", 10*time.Second, func() bool { return campaignKey(t, c.Client(t), "b") != nil })
	px.Blackhole()
	stop := time.Now()
	b.cancel()
	select {
	case <-b.done:
	case <-time.After(3 * time.Second):
		t.Fatal("the standby's Run did not return within 3s of its stop while etcd is black-holed")
	}
	if took := time.Since(stop); took > campaignCleanup+500*time.Millisecond {
		t.Fatalf("Run returned %s after the stop, want ≤ %s", took, campaignCleanup+500*time.Millisecond)
	} else {
		t.Logf("standby Run returned %s after its stop with etcd black-holed", took)
	}
}

// TestRevokeOrphan: a lease an ended term could not revoke (etcd unreachable then) is revoked by
// the next term as soon as etcd answers, so its election key stops blocking every campaign.
func TestRevokeOrphan(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	el, err := New(Config{Client: cli, Prefix: "/e/leader/", NodeID: "a", TTL: 30 * time.Second, Log: zerolog.Nop(), Reg: prometheus.NewRegistry()})
	if err != nil {
		t.Fatal(err)
	}
	lease, err := cli.Grant(t.Context(), 30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(t.Context(), "/e/leader/old", "x", clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	el.revokeOrphan(t.Context()) // nothing orphaned: no call
	el.orphan.Store(int64(lease.ID))
	el.revokeOrphan(t.Context())
	resp, err := cli.Get(t.Context(), "/e/leader/old")
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 0 || el.orphan.Load() != 0 {
		t.Fatalf("old key %v, orphan %d after revokeOrphan", resp.Kvs, el.orphan.Load())
	}
	el.orphan.Store(int64(lease.ID)) // already gone: LeaseNotFound is done, not retried
	el.revokeOrphan(t.Context())
	if el.orphan.Load() != 0 {
		t.Fatal("a revoked lease stays orphaned")
	}
}
