package kvstore

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/netproxy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// leader campaigns under the store's election prefix and returns its fence and session.
func leader(t *testing.T, s *Store, id string) (Fence, *concurrency.Session, *concurrency.Election) {
	t.Helper()
	sess, err := concurrency.NewSession(s.Client(), concurrency.WithTTL(5))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sess.Close() })
	el := concurrency.NewElection(sess, s.ElectionPrefix())
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := el.Campaign(ctx, id); err != nil {
		t.Fatal(err)
	}
	return Fence{Key: el.Key(), Rev: el.Rev()}, sess, el
}

func newStore(t *testing.T, cli *clientv3.Client, prefix string) *Store {
	t.Helper()
	s, err := New(cli, WithPrefix(prefix))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestNewValidatesPrefix(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	for _, tc := range []struct {
		prefix string
		ok     bool
	}{
		{"/kvc/v1/", true}, {"/x/", true}, {"kvc/", false}, {"/kvc", false}, {"/", false},
	} {
		_, err := New(cli, WithPrefix(tc.prefix))
		if (err == nil) != tc.ok {
			t.Errorf("prefix %q: err=%v, want ok=%v", tc.prefix, err, tc.ok)
		}
	}
	if _, err := New(nil); err == nil {
		t.Error("nil client accepted")
	}
}

func TestFencing(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/fence/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	f1, sess1, _ := leader(t, s, "a")
	rec := &kvcv1.SessionRecord{SessionId: "s1", DecodeWorker: "d0", Epoch: f1.Rev}
	b, _ := proto.Marshal(rec)
	if err := s.Apply(ctx, f1, []Op{{Key: s.SessionKey("s1"), Value: b}}); err != nil {
		t.Fatalf("leader write: %v", err)
	}
	// Depose leader 1: its lease goes away (as when it expires), leader 2 takes over.
	if err := sess1.Close(); err != nil {
		t.Fatal(err)
	}
	f2, _, _ := leader(t, s, "b")
	if f2.Rev <= f1.Rev {
		t.Fatalf("epoch did not grow: %d <= %d", f2.Rev, f1.Rev)
	}
	stale := &kvcv1.SessionRecord{SessionId: "s1", DecodeWorker: "STALE", Epoch: f1.Rev}
	b2, _ := proto.Marshal(stale)
	err := s.Apply(ctx, f1, []Op{{Key: s.SessionKey("s1"), Value: b2}, {Key: s.SessionKey("s2"), Value: b2}})
	if !errors.Is(err, ErrFenced) {
		t.Fatalf("deposed write: err = %v, want ErrFenced", err)
	}
	got, ok, err := s.GetSession(ctx, "s1")
	if err != nil || !ok || got.GetDecodeWorker() != "d0" {
		t.Fatalf("record after fenced write: %v %v %v", got, ok, err)
	}
	if _, ok, _ := s.GetSession(ctx, "s2"); ok {
		t.Fatal("fenced txn wrote part of its ops")
	}
	// The deposed leader's batcher fails terminally with ErrFenced too.
	bt := NewBatcher(s, f1)
	errc := make(chan error, 1)
	go func() { errc <- bt.Run(ctx) }()
	if err := bt.PutSession(stale); err != nil {
		t.Fatal(err)
	}
	if err := bt.Flush(ctx); !errors.Is(err, ErrFenced) {
		t.Fatalf("batcher flush: %v", err)
	}
	if err := <-errc; !errors.Is(err, ErrFenced) {
		t.Fatalf("batcher run: %v", err)
	}
	if err := bt.PutSession(stale); !errors.Is(err, ErrFenced) {
		t.Fatalf("put after fenced: %v", err)
	}
	// The new leader writes fine.
	if err := s.Apply(ctx, f2, []Op{{Key: s.SessionKey("s1"), Value: b2}}); err != nil {
		t.Fatal(err)
	}
	if err := s.Apply(ctx, Fence{}, nil); err == nil {
		t.Fatal("zero fence accepted")
	}
}

func TestSessionsSurviveLeaderLease(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/lease/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, sess, _ := leader(t, s, "a")
	bt := NewBatcher(s, f)
	go func() { _ = bt.Run(ctx) }()
	for i := range 10 {
		if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: fmt.Sprint("s", i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := bt.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sess.Close(); err != nil { // revokes the leader lease
		t.Fatal(err)
	}
	recs, next, err := s.ListSessions(ctx, "", 100, nil)
	if err != nil || len(recs) != 10 || next != "" {
		t.Fatalf("after lease revoke: %d records, next %q, err %v", len(recs), next, err)
	}
}

func TestBatcherCoalesces(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/coalesce/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	var mu sync.Mutex
	var infos []FlushInfo
	bt := NewBatcher(s, f, WithMaxDelay(time.Hour), WithOnTxn(func(i FlushInfo) {
		mu.Lock()
		infos = append(infos, i)
		mu.Unlock()
	}))
	go func() { _ = bt.Run(ctx) }()
	for i := range 500 {
		if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "hot", KvCommittedLen: int64(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "gone"}); err != nil {
		t.Fatal(err)
	}
	if err := bt.DeleteSession("gone"); err != nil {
		t.Fatal(err)
	}
	if got := bt.Pending(); got != 2 {
		t.Fatalf("pending = %d, want 2 (coalesced)", got)
	}
	if err := bt.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if len(infos) != 1 || infos[0].Ops != 2 {
		t.Fatalf("txns = %+v, want one txn of 2 ops", infos)
	}
	mu.Unlock()
	resp, err := cli.Get(ctx, s.SessionKey("hot"))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatal(err)
	}
	if resp.Kvs[0].Version != 1 {
		t.Fatalf("hot key written %d times, want 1", resp.Kvs[0].Version)
	}
	got, _, _ := s.GetSession(ctx, "hot")
	if got.GetKvCommittedLen() != 499 {
		t.Fatalf("latest value lost: %d", got.GetKvCommittedLen())
	}
	if _, ok, _ := s.GetSession(ctx, "gone"); ok {
		t.Fatal("deleted key present")
	}
}

func TestBatcherLimits(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name     string
		keys     int
		valBytes int
		maxOps   int // per txn
	}{
		{"many small", 1000, 100, DefaultMaxOps},
		{"large values", 40, 200 << 10, 7}, // 8 × 200 KiB would pass 1.5 MiB
		{"near limit", 3, DefaultMaxBytes - 200, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			prefix := "/limits/" + strings.ReplaceAll(tc.name, " ", "-") + "/"
			s := newStore(t, cli, prefix)
			f, _, _ := leader(t, s, "a")
			var mu sync.Mutex
			var infos []FlushInfo
			bt := NewBatcher(s, f, WithMaxDelay(time.Hour), WithOnTxn(func(i FlushInfo) {
				mu.Lock()
				infos = append(infos, i)
				mu.Unlock()
			}))
			rctx, rcancel := context.WithCancel(ctx)
			defer rcancel()
			go func() { _ = bt.Run(rctx) }()
			val := []byte(strings.Repeat("v", tc.valBytes))
			for i := range tc.keys {
				val[0] = 'a' + byte(i%26)
				if err := bt.Put(s.Prefix()+fmt.Sprintf("blob/%05d", i), &kvcv1.SessionRecord{SessionId: string(val)}); err != nil {
					t.Fatal(err)
				}
			}
			if err := bt.Flush(ctx); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			defer mu.Unlock()
			total := 0
			for _, in := range infos {
				if in.Err != nil {
					t.Fatalf("txn failed: %v", in.Err)
				}
				if in.Ops > DefaultMaxOps || in.Ops > tc.maxOps {
					t.Fatalf("txn of %d ops, limit %d", in.Ops, tc.maxOps)
				}
				if in.Bytes > DefaultMaxBytes {
					t.Fatalf("txn of %d bytes > %d", in.Bytes, DefaultMaxBytes)
				}
				total += in.Ops
			}
			if total != tc.keys {
				t.Fatalf("wrote %d ops, want %d", total, tc.keys)
			}
			resp, err := cli.Get(ctx, s.Prefix()+"blob/", clientv3.WithPrefix(), clientv3.WithCountOnly())
			if err != nil || resp.Count != int64(tc.keys) {
				t.Fatalf("etcd holds %d keys (err %v), want %d", resp.Count, err, tc.keys)
			}
		})
	}
	s := newStore(t, cli, "/limits/")
	bt := NewBatcher(s, Fence{Key: "x", Rev: 1})
	if err := bt.Put("k", &kvcv1.SessionRecord{SessionId: string(make([]byte, DefaultMaxBytes))}); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("oversized value: %v", err)
	}
}

func TestBatcherFlushesAfterDelay(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/delay/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	const delay = 40 * time.Millisecond
	txns := make(chan FlushInfo, 16)
	bt := NewBatcher(s, f, WithMaxDelay(delay), WithOnTxn(func(i FlushInfo) { txns <- i }))
	go func() { _ = bt.Run(ctx) }()
	if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "a"}); err != nil {
		t.Fatal(err)
	}
	if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "b"}); err != nil {
		t.Fatal(err)
	}
	// No Flush call: the timer must write it.
	select {
	case in := <-txns:
		if in.Err != nil || in.Ops != 2 {
			t.Fatalf("flush %+v", in)
		}
		if in.OldestAge < delay {
			t.Fatalf("flushed after %s, before the %s coalescing window", in.OldestAge, delay)
		}
	case <-ctx.Done():
		t.Fatal("no flush without an explicit Flush")
	}
	if _, ok, _ := s.GetSession(ctx, "b"); !ok {
		t.Fatal("record not in etcd after the timed flush")
	}
}

func TestBatcherRetriesWhileEtcdDown(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/retry/")
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	bt := NewBatcher(s, f, WithMaxDelay(5*time.Millisecond), WithRetryDelay(20*time.Millisecond))
	go func() { _ = bt.Run(ctx) }()
	c.Member(0).Kill()
	if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "kept", Turn: 1}); err != nil {
		t.Fatal(err)
	}
	short, scancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := bt.Flush(short)
	scancel()
	if err == nil {
		t.Fatal("flush succeeded with etcd down")
	}
	if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "kept", Turn: 2}); err != nil {
		t.Fatal(err)
	}
	c.Member(0).Restart(t)
	if err := bt.Flush(ctx); err != nil {
		t.Fatalf("flush after restart: %v", err)
	}
	got, ok, err := s.GetSession(ctx, "kept")
	if err != nil || !ok || got.GetTurn() != 2 {
		t.Fatalf("after retry: %v %v %v", got, ok, err)
	}
}

func TestListAndLoad(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/list/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	bt := NewBatcher(s, f)
	go func() { _ = bt.Run(ctx) }()
	for i := range 25 {
		w := "d0"
		if i%2 == 1 {
			w = "d1"
		}
		if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: fmt.Sprintf("s%02d", i), DecodeWorker: w}); err != nil {
			t.Fatal(err)
		}
	}
	if err := bt.PutWorker(&kvcv1.Worker{WorkerId: "d0", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE}); err != nil {
		t.Fatal(err)
	}
	if err := bt.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.PutPolicy(ctx, f, &kvcv1.Policy{SeedMinTurn: proto.Int32(2), Version: 3}); err != nil {
		t.Fatal(err)
	}
	// A malformed record must not break loading.
	if _, err := cli.Put(ctx, s.SessionKey("zz-bad"), "\xff\xff\xff"); err != nil {
		t.Fatal(err)
	}
	var ids []string
	tok := ""
	for {
		recs, next, err := s.ListSessions(ctx, tok, 4, func(r *kvcv1.SessionRecord) bool { return r.GetDecodeWorker() == "d1" })
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range recs {
			ids = append(ids, r.GetSessionId())
		}
		if next == "" {
			break
		}
		tok = next
	}
	if len(ids) != 12 || ids[0] != "s01" || ids[11] != "s23" {
		t.Fatalf("paged filter = %v", ids)
	}
	snap, err := s.LoadAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Sessions) != 25 || len(snap.Workers) != 1 || snap.Policy.GetSeedMinTurn() != 2 || snap.Malformed != 1 {
		t.Fatalf("load: %d sessions %d workers policy %v malformed %d", len(snap.Sessions), len(snap.Workers), snap.Policy, snap.Malformed)
	}
	ws, err := s.ListWorkers(ctx)
	if err != nil || len(ws) != 1 {
		t.Fatalf("workers %v %v", ws, err)
	}
}

func TestExpireIdleSessions(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/ttl/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	now := time.UnixMilli(10_000_000)
	ttl := time.Minute
	recs := []*kvcv1.SessionRecord{
		{SessionId: "fresh", LastSeenUnixMs: now.Add(-time.Second).UnixMilli()},
		{SessionId: "idle", LastSeenUnixMs: now.Add(-2 * time.Minute).UnixMilli()},
		{SessionId: "edge", LastSeenUnixMs: now.Add(-ttl).UnixMilli()},
		{SessionId: "never-seen-old", CreatedUnixMs: now.Add(-time.Hour).UnixMilli()},
	}
	var ops []Op
	for _, r := range recs {
		b, _ := proto.Marshal(r)
		ops = append(ops, Op{Key: s.SessionKey(r.GetSessionId()), Value: b})
	}
	if err := s.Apply(ctx, f, ops); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		id   string
		idle bool
	}{{"fresh", false}, {"idle", true}, {"edge", true}, {"never-seen-old", true}} {
		r, _, _ := s.GetSession(ctx, tc.id)
		if got := IsIdle(r, ttl, now); got != tc.idle {
			t.Errorf("IsIdle(%s) = %v", tc.id, got)
		}
		if IsIdle(r, 0, now) {
			t.Errorf("ttl 0 expired %s", tc.id)
		}
	}
	n, err := s.ExpireIdleSessions(ctx, f, ttl, now)
	if err != nil || n != 3 {
		t.Fatalf("expired %d, err %v; want 3", n, err)
	}
	left, _, _ := s.ListSessions(ctx, "", 10, nil)
	if len(left) != 1 || left[0].GetSessionId() != "fresh" {
		t.Fatalf("left %v", left)
	}
}

func TestWatchPolicy(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/watch/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	if err := s.PutPolicy(ctx, f, &kvcv1.Policy{Version: 1}); err != nil {
		t.Fatal(err)
	}
	got := make(chan int64, 8)
	wctx, wcancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = s.WatchPolicy(wctx, func(p *kvcv1.Policy) { got <- p.GetVersion() }, nil)
	}()
	if v := <-got; v != 1 {
		t.Fatalf("initial version %d", v)
	}
	if err := s.PutPolicy(ctx, f, &kvcv1.Policy{Version: 2}); err != nil {
		t.Fatal(err)
	}
	select {
	case v := <-got:
		if v != 2 {
			t.Fatalf("watched version %d", v)
		}
	case <-ctx.Done():
		t.Fatal("no watch event")
	}
	wcancel()
	<-done
}

func TestVolatileKeyNames(t *testing.T) {
	s := &Store{prefix: "/p/"}
	for _, seq := range []uint64{0, 1, 0xabc, 1 << 40, ^uint64(0)} {
		key := s.VolatileKey(seq)
		if !strings.HasPrefix(key, s.VolatilePrefix()) {
			t.Fatalf("%d: key %q outside %q", seq, key, s.VolatilePrefix())
		}
		got, ok := ParseVolatileName(strings.TrimPrefix(key, s.VolatilePrefix()))
		if !ok || got != seq {
			t.Fatalf("%d: parsed %d %v from %q", seq, got, ok, key)
		}
	}
	if s.VolatileKey(9) >= s.VolatileKey(10) || s.VolatileKey(0xff) >= s.VolatileKey(0x100) {
		t.Fatal("key order is not seq order")
	}
	for _, bad := range []string{"", "1", "000000000000000g", "000000000000000A", "0000000000000000/", "00000000000000000"} {
		if _, ok := ParseVolatileName(bad); ok {
			t.Fatalf("%q parsed", bad)
		}
	}
}

func FuzzParseVolatileName(f *testing.F) {
	for _, s := range []string{"", "0000000000000001", "ffffffffffffffff", "000000000000000G", "x"} {
		f.Add(s)
	}
	s := &Store{prefix: "/p/"}
	f.Fuzz(func(t *testing.T, name string) {
		seq, ok := ParseVolatileName(name)
		if !ok {
			return
		}
		if got := strings.TrimPrefix(s.VolatileKey(seq), s.VolatilePrefix()); got != name {
			t.Fatalf("%q parsed as %d, which names %q", name, seq, got)
		}
	})
}

func TestLoadAllVolatile(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/vol/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	bt := NewBatcher(s, f)
	go func() { _ = bt.Run(ctx) }()
	for _, seq := range []uint64{0x11, 2, 0x100} {
		v, err := proto.Marshal(&kvcv1.VolatileBatch{Seq: 999, Epoch: 7, Entries: []*kvcv1.VolatileEntry{{SessionId: fmt.Sprint("s", seq), Turn: int32(seq)}}})
		if err != nil {
			t.Fatal(err)
		}
		if err := bt.PutBytes(s.VolatileKey(seq), v); err != nil {
			t.Fatal(err)
		}
	}
	if err := bt.PutBytes(s.VolatilePrefix()+"not-a-seq", []byte{}); err != nil {
		t.Fatal(err)
	}
	if err := bt.PutBytes(s.VolatileKey(5), []byte{0xff, 0xff}); err != nil {
		t.Fatal(err)
	}
	if err := bt.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	snap, err := s.LoadAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var seqs []uint64
	for _, b := range snap.Volatile {
		seqs = append(seqs, b.GetSeq())
		if b.GetEpoch() != 7 || len(b.GetEntries()) != 1 || b.GetEntries()[0].GetTurn() != int32(b.GetSeq()) {
			t.Fatalf("batch %v", b)
		}
	}
	if fmt.Sprint(seqs) != "[2 17 256]" {
		t.Fatalf("journal seqs %v, want [2 17 256] (key order, the name's seq)", seqs)
	}
	if snap.Malformed != 2 || len(snap.MalformedVolatile) != 2 {
		t.Fatalf("malformed %d %v", snap.Malformed, snap.MalformedVolatile)
	}
}

// TestBatcherTxnTimeout: a Txn sent over a connection that goes dark (black-holed, not closed)
// is abandoned after the Txn timeout and retried, so writes resume as soon as etcd is
// reachable again instead of after the client's own request timeout.
func TestBatcherTxnTimeout(t *testing.T) {
	c := etcdtest.Start(t)
	px, err := netproxy.New(strings.TrimPrefix(c.Endpoints()[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{px.Addr()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	s := newStore(t, cli, "/txntimeout/")
	direct := newStore(t, c.Client(t), "/txntimeout/")
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	f, _, _ := leader(t, direct, "a") // the fence's lease is kept alive around the proxy
	timedOut := make(chan struct{}, 1)
	bt := NewBatcher(s, f, WithMaxDelay(5*time.Millisecond), WithRetryDelay(20*time.Millisecond), WithTxnTimeout(300*time.Millisecond),
		WithOnTxn(func(fi FlushInfo) {
			if errors.Is(fi.Err, context.DeadlineExceeded) || status.Code(fi.Err) == codes.DeadlineExceeded {
				select {
				case timedOut <- struct{}{}:
				default:
				}
			}
		}))
	go func() { _ = bt.Run(ctx) }()
	if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "before", Turn: 1}); err != nil {
		t.Fatal(err)
	}
	if err := bt.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	px.Blackhole()
	if err := bt.PutSession(&kvcv1.SessionRecord{SessionId: "during", Turn: 1}); err != nil {
		t.Fatal(err)
	}
	select { // a Txn was abandoned on its timeout while the connection is dark
	case <-timedOut:
	case <-time.After(20 * time.Second):
		t.Fatal("no Txn timed out while etcd was black-holed")
	}
	px.Heal()
	if err := bt.Flush(ctx); err != nil {
		t.Fatalf("flush after heal: %v", err)
	}
	got, ok, err := direct.GetSession(ctx, "during")
	if err != nil || !ok || got.GetTurn() != 1 {
		t.Fatalf("after heal: %v %v %v", got, ok, err)
	}
}

// TestCallTimeout is issue 16 finding 3 at the store: with etcd black-holed every read and
// write returns ErrUnavailable within the call timeout even when the caller's context has no
// deadline; a caller's own shorter deadline keeps its error; an oversized write is refused
// before anything is sent.
func TestCallTimeout(t *testing.T) {
	c := etcdtest.Start(t)
	px, err := netproxy.New(strings.TrimPrefix(c.Endpoints()[0], "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = px.Close() })
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{px.Addr()}, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	const bound = 300 * time.Millisecond
	s, err := New(cli, WithPrefix("/calltimeout/"), WithCallTimeout(bound))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(cli, WithCallTimeout(0)); err == nil {
		t.Fatal("zero call timeout accepted")
	}
	f, _, _ := leader(t, newStore(t, c.Client(t), "/calltimeout/"), "a")
	if err := s.PutPolicy(t.Context(), f, &kvcv1.Policy{SeedMinTurn: proto.Int32(1)}); err != nil {
		t.Fatal(err)
	}
	big := Op{Key: s.PolicyKey(), Value: make([]byte, DefaultMaxBytes)}
	px.Blackhole()
	for _, tc := range []struct {
		name string
		call func(ctx context.Context) error
	}{
		{"GetPolicy", func(ctx context.Context) error { _, _, err := s.GetPolicy(ctx); return err }},
		{"GetWorker", func(ctx context.Context) error { _, _, err := s.GetWorker(ctx, "w"); return err }},
		{"GetSession", func(ctx context.Context) error { _, _, err := s.GetSession(ctx, "s"); return err }},
		{"ListWorkers", func(ctx context.Context) error { _, err := s.ListWorkers(ctx); return err }},
		{"ListSessions", func(ctx context.Context) error { _, _, err := s.ListSessions(ctx, "", 10, nil); return err }},
		{"LoadAll", func(ctx context.Context) error { _, err := s.LoadAll(ctx); return err }},
		{"PutPolicy", func(ctx context.Context) error { return s.PutPolicy(ctx, f, &kvcv1.Policy{}) }},
		{"ExpireIdleSessions", func(ctx context.Context) error {
			_, err := s.ExpireIdleSessions(ctx, f, time.Hour, time.Now())
			return err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := time.Now()
			err := tc.call(context.Background()) // no deadline: the store's bound must hold
			if el := time.Since(start); !errors.Is(err, ErrUnavailable) || el > bound+time.Second {
				t.Fatalf("after %s: %v, want ErrUnavailable within %s", el, err, bound)
			}
			ctx, cancel := context.WithTimeout(t.Context(), bound/3)
			defer cancel()
			if err := tc.call(ctx); errors.Is(err, ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) && status.Code(err) != codes.DeadlineExceeded {
				t.Fatalf("caller deadline: %v, want the caller's DeadlineExceeded", err)
			}
		})
	}
	// Refused before it is sent: through the blackholed link a sent Txn could only end in the
	// store's bound (ErrUnavailable), so ErrTooLarge itself shows nothing was sent (no wall
	// time asserted: the machine may be slow).
	if err := s.Apply(t.Context(), f, []Op{big}); !errors.Is(err, ErrTooLarge) || errors.Is(err, ErrUnavailable) {
		t.Fatalf("oversized Txn: %v, want ErrTooLarge without reaching etcd", err)
	}
}

// TestNextGenerationTerm: every call advances the durable counter past both its stored value
// and the caller's floor; a deposed leader cannot advance it; a value that is not a number is
// refused, and once the key is deleted the count goes on from the floor.
func TestNextGenerationTerm(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/gterm/")
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	fa, sessA, _ := leader(t, s, "a")
	stored := func() string {
		t.Helper()
		r, err := cli.Get(ctx, s.GenerationTermKey())
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Kvs) == 0 {
			return ""
		}
		return string(r.Kvs[0].Value)
	}
	var fb Fence
	for _, st := range []struct {
		name   string
		before func()
		fence  *Fence
		floor  uint64
		want   uint64 // 0: refused
		fenced bool   // refused with ErrFenced
		max    uint64 // the caller's limit (0: 1<<29 - 1)
		exhaus bool   // refused with ErrGenerationTermExhausted
	}{
		{"first term, no key", nil, &fa, 0, 1, false, 0, false},
		{"counts on", nil, &fa, 0, 2, false, 0, false},
		{"a floor above the stored term", nil, &fa, 5, 6, false, 0, false},
		{"a floor below it", nil, &fa, 2, 7, false, 0, false},
		{"deposed leader", func() {
			if err := sessA.Close(); err != nil {
				t.Fatal(err)
			}
			fb, _, _ = leader(t, s, "b")
		}, &fa, 0, 0, true, 0, false},
		{"the new leader", nil, &fb, 0, 8, false, 0, false},
		{"not a number", func() {
			if _, err := cli.Put(ctx, s.GenerationTermKey(), "eight"); err != nil {
				t.Fatal(err)
			}
		}, &fb, 0, 0, false, 0, false},
		{"key deleted: on from the floor", func() {
			if _, err := cli.Delete(ctx, s.GenerationTermKey()); err != nil {
				t.Fatal(err)
			}
		}, &fb, 3, 4, false, 0, false},
		{"at the limit", nil, &fb, 0, 0, false, 4, true},
		{"a floor at the limit", nil, &fb, 9, 0, false, 9, true},
		{"below the limit", nil, &fb, 0, 5, false, 5, false},
		{"stored 2^64-1 does not wrap", func() {
			if _, err := cli.Put(ctx, s.GenerationTermKey(), strconv.FormatUint(math.MaxUint64, 10)); err != nil {
				t.Fatal(err)
			}
		}, &fb, 0, 0, false, math.MaxUint64, true},
		{"stored 2^64-1 under the usual limit", nil, &fb, 0, 0, false, 0, true},
		{"floor 2^64-1", func() {
			if _, err := cli.Delete(ctx, s.GenerationTermKey()); err != nil {
				t.Fatal(err)
			}
		}, &fb, math.MaxUint64, 0, false, 0, true},
	} {
		if st.before != nil {
			st.before()
		}
		was := stored()
		got, err := s.NextGenerationTerm(ctx, *st.fence, st.floor, cmp.Or(st.max, 1<<29-1))
		switch {
		case st.want != 0 && (err != nil || got != st.want):
			t.Fatalf("%s: term %d, err %v; want %d", st.name, got, err, st.want)
		case st.want != 0 && stored() != strconv.FormatUint(st.want, 10):
			t.Fatalf("%s: stored %q, want %d", st.name, stored(), st.want)
		case st.want == 0 && (err == nil || errors.Is(err, ErrFenced) != st.fenced || errors.Is(err, ErrGenerationTermExhausted) != st.exhaus):
			t.Fatalf("%s: term %d, err %v; want a refusal (fenced: %v, exhausted: %v)", st.name, got, err, st.fenced, st.exhaus)
		case st.want == 0 && stored() != was:
			t.Fatalf("%s: stored %q after the refusal, was %q", st.name, stored(), was)
		}
	}
}

// TestWatchPolicyCorrupt: a stored policy that does not decode is reported to bad, not to fn
// (so the watcher keeps what it has, issue 23 item 6); a valid one after it is reported again.
func TestWatchPolicyCorrupt(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/watchpolicy/")
	ctx, cancel := context.WithCancel(t.Context())
	got := make(chan *kvcv1.Policy, 8)
	bad := make(chan error, 8)
	done := make(chan error, 1)
	go func() { done <- s.WatchPolicy(ctx, func(p *kvcv1.Policy) { got <- p }, func(err error) { bad <- err }) }()
	defer func() { cancel(); <-done }()
	put := func(v string) {
		t.Helper()
		if _, err := cli.Put(ctx, s.PolicyKey(), v); err != nil {
			t.Fatal(err)
		}
	}
	b, err := proto.Marshal(&kvcv1.Policy{Version: 1})
	if err != nil {
		t.Fatal(err)
	}
	put(string(b))
	if p := <-got; p.GetVersion() != 1 {
		t.Fatalf("first policy %v", p)
	}
	put("\xff\xff\xff not a policy")
	select {
	case err := <-bad:
		if !strings.Contains(err.Error(), s.PolicyKey()) {
			t.Fatalf("bad: %v (want the key named)", err)
		}
	case p := <-got:
		t.Fatalf("a corrupt record reached fn as %v", p)
	case <-time.After(10 * time.Second):
		t.Fatal("the corrupt record was not reported")
	}
	b, _ = proto.Marshal(&kvcv1.Policy{Version: 2})
	put(string(b))
	if p := <-got; p.GetVersion() != 2 {
		t.Fatalf("after the corrupt record: %v", p)
	}
}

// TestTxnDurationMetric: every fenced write transaction, committed or fenced, is one observation
// of kvc_kvstore_txn_duration_seconds.
func TestTxnDurationMetric(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	reg := prometheus.NewRegistry()
	s, err := New(cli, WithPrefix("/lat/"), WithRegisterer(reg))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	f, _, _ := leader(t, s, "a")
	for i := range 3 {
		if err := s.Apply(ctx, f, []Op{{Key: s.SessionKey(fmt.Sprint("s", i)), Value: []byte("x")}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Apply(ctx, Fence{Key: f.Key, Rev: f.Rev + 1000}, []Op{{Key: s.SessionKey("z"), Value: []byte("x")}}); !errors.Is(err, ErrFenced) {
		t.Fatalf("wrong fence: %v", err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "kvc_kvstore_txn_duration_seconds" {
			if h := mf.GetMetric()[0].GetHistogram(); h.GetSampleCount() != 4 || h.GetSampleSum() <= 0 {
				t.Fatalf("histogram count %d sum %v, want 4 observations", h.GetSampleCount(), h.GetSampleSum())
			}
			return
		}
	}
	t.Fatal("kvc_kvstore_txn_duration_seconds not registered")
}
