package prefill

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/kvxfer/kvxfertest"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// guardPeer is a decode side: its own tcp engine and pool, holding sessions' KV.
type guardPeer struct {
	eng  rdma.Engine
	pool *kvxfer.Pool
	seg  rdma.SegmentID
}

func newGuardPeer(t *testing.T, ctx context.Context, store string) *guardPeer {
	t.Helper()
	eng, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	pool, err := kvxfer.NewArena(kvxfer.Shape{PageSize: 4, ItemLen: 32, PageCount: 16, NumLayers: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if err := pool.Register(eng, "host"); err != nil {
		t.Fatal(err)
	}
	seg, err := eng.OpenSegment(ctx, store)
	if err != nil {
		t.Fatal(err)
	}
	return &guardPeer{eng: eng, pool: pool, seg: seg}
}

// fill writes session's pattern for tokens [0, n) into pages.
func (p *guardPeer) fill(session string, pages []int64, n int64) {
	for b := 0; b < p.pool.Buffers(); b++ {
		for tok := int64(0); tok < n; tok++ {
			kvpool.FillToken(p.pool.TokenSlot(pages, tok, b), kvpool.SessionSeed(session), tok, b)
		}
	}
}

// plan writes tokens [from, to) of pages into a reservation, as a decode sidecar's push does.
func (p *guardPeer) plan(t *testing.T, pages []int64, res *kvcv1.ReserveSnapshotResponse, from, to int64) []rdma.Request {
	t.Helper()
	reqs, err := kvxfertest.Requests(kvxfer.PageMap{Layout: p.pool.Layout(), Pages: pages},
		kvxfer.PageMap{Layout: res.GetStoreLayout(), Pages: res.GetPages(), First: from / 4}, p.seg, from, to)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

// verifySnapshot checks every token of a session's snapshot against its pattern.
func verifySnapshot(t *testing.T, s *Sidecar, session string, seqlen int64) {
	t.Helper()
	st, arena, err := s.storeAndArena()
	if err != nil {
		t.Fatal(err)
	}
	v, ok := st.Get(session)
	if !ok || v.Seqlen != seqlen {
		t.Fatalf("snapshot of %s: %+v (found %v), want seqlen %d", session, v, ok, seqlen)
	}
	for b := 0; b < arena.Buffers(); b++ {
		for tok := int64(0); tok < seqlen; tok++ {
			if !kvpool.CheckToken(arena.TokenSlot(v.Pages, tok, b), kvpool.SessionSeed(session), tok, b) {
				t.Fatalf("snapshot of %s: token %d of buffer %d corrupted", session, tok, b)
			}
		}
	}
}

// TestWriteGuardRefusesForeignWrites: decode peers write into the store outside their own
// reservation — another session's reserved pages, committed snapshot pages, the committed tokens
// of the page an append shares, a free page, the prefill worker's pool. Every such task fails
// with the owner's refusal and nothing is written; the legitimate writes of the same batch land,
// and every snapshot verifies byte for byte afterwards.
func TestWriteGuardRefusesForeignWrites(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := newTestSidecar(t, true) // store: 16 pages of 4 tokens, 1 layer, 8 bytes a token per buffer
	st, arena, err := s.storeAndArena()
	if err != nil {
		t.Fatal(err)
	}
	storeName := s.eng.SegmentName()
	d1, d2 := newGuardPeer(t, ctx, storeName), newGuardPeer(t, ctx, storeName)
	pages1, pages2 := []int64{7, 3, 10, 0}, []int64{5, 9}
	d1.fill("s1", pages1, 15)
	d2.fill("s2", pages2, 8)
	const tb = 8
	xfer := func(p *guardPeer, reqs []rdma.Request) batchResult {
		t.Helper()
		return runBatch(t, ctx, p.eng, reqs)
	}
	reserve := func(session string, base, tokens int64, writer string) *kvcv1.ReserveSnapshotResponse {
		t.Helper()
		res, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: session, Generation: 1, BaseLen: base, Tokens: tokens,
			SourceLayout: d1.pool.Layout(), SourceWorkerId: "d", SourceTransferEndpoint: writer})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	commit := func(id uint64) {
		t.Helper()
		if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id}); err != nil {
			t.Fatal(err)
		}
	}

	// s1: tokens [0, 10) pushed by d1 and committed (store pages 0..2; page 2 holds tokens 8, 9).
	r1 := reserve("s1", 0, 10, "")
	if res := xfer(d1, d1.plan(t, pages1, r1, 0, 10)); res.Failed != 0 {
		t.Fatalf("push of s1: %+v", res.Tasks)
	}
	commit(r1.GetIngestId())
	verifySnapshot(t, s, "s1", 10)
	committed, _ := st.Get("s1")

	// In flight: d1 appends [10, 15) to s1 (the tail of the shared page, then a new page); d2
	// pushes s2 [0, 8) and writes it all before d1 misbehaves.
	r1b := reserve("s1", 10, 5, d1.eng.SegmentName())
	r2 := reserve("s2", 0, 8, "") // bound to d2 by its first write
	if res := xfer(d2, d2.plan(t, pages2, r2, 0, 8)); res.Failed != 0 {
		t.Fatalf("push of s2: %+v", res.Tasks)
	}

	storeAddr := func(b int, page, tok int64) uint64 {
		return arena.Layout().GetBufferAddrs()[b] + uint64(page*arena.ItemLen+tok*tb)
	}
	junk := d1.pool.Layout().GetBufferAddrs()[0] + uint64(12*d1.pool.ItemLen) // d1's pages 12..15 of buffer 0
	for i := range d1.pool.Buffer(0)[12*d1.pool.ItemLen:] {
		d1.pool.Buffer(0)[12*int(d1.pool.ItemLen)+i] = 0xee
	}
	s.mu.Lock()
	workerPool := s.pool
	s.mu.Unlock()
	workerBefore := append([]byte(nil), workerPool.Buffer(1)[:64]...)
	attacks := []struct {
		name string
		addr uint64
		n    uint64
	}{
		{"another session's reserved pages", storeAddr(1, r2.GetPages()[1], 0), 2 * tb},
		{"a committed snapshot page", storeAddr(0, committed.Pages[0], 0), 4 * tb},
		{"committed tokens of the shared page", storeAddr(1, committed.Pages[2], 1), tb},
		{"across base_len in the shared page", storeAddr(0, committed.Pages[2], 1), 2 * tb},
		{"a free page", storeAddr(0, 15, 0), tb},
		{"the prefill worker's pool", workerPool.Layout().GetBufferAddrs()[1], 64},
	}
	legit := d1.plan(t, pages1, r1b, 10, 15)
	var reqs []rdma.Request
	for i, a := range attacks {
		reqs = append(reqs, rdma.Request{Op: rdma.OpWrite, Source: junk, Target: d1.seg, TargetAddr: a.addr, Length: a.n})
		if i < len(legit) {
			reqs = append(reqs, legit[i])
		}
	}
	if len(legit) > len(attacks) {
		reqs = append(reqs, legit[len(attacks):]...)
	}
	res := xfer(d1, reqs)
	if res.Failed != len(attacks) {
		t.Fatalf("%d tasks failed, want the %d foreign writes: %+v", res.Failed, len(attacks), res.Tasks)
	}
	k := 0
	for i, ts := range res.Tasks {
		if reqs[i].Source != junk {
			if ts.State != rdma.TaskCompleted {
				t.Fatalf("legitimate write %d: %+v", i, ts)
			}
			continue
		}
		a := attacks[k]
		k++
		if ts.State != rdma.TaskFailed || !errors.Is(ts.Err, rdma.ErrOutOfBounds) || !strings.Contains(ts.Err.Error(), "write guard") {
			t.Fatalf("%s: %+v, want refused by the owner's write guard", a.name, ts)
		}
	}
	if !bytes.Equal(workerPool.Buffer(1)[:64], workerBefore) {
		t.Fatal("the prefill worker's pool was written")
	}
	verifySnapshot(t, s, "s1", 10) // the existing snapshot is intact, committed tokens of the shared page included

	// d2 is bound to s2's reservation: its own writes still land; d1's never do.
	if res := xfer(d2, d2.plan(t, pages2, r2, 0, 8)); res.Failed != 0 {
		t.Fatalf("rewrite of s2 by its pusher: %+v", res.Tasks)
	}
	commit(r1b.GetIngestId())
	commit(r2.GetIngestId())
	verifySnapshot(t, s, "s1", 15)
	verifySnapshot(t, s, "s2", 8)

	// A reservation naming its writer refuses every other peer, even before the writer's first byte.
	r3 := reserve("s3", 0, 8, d2.eng.SegmentName())
	d2.fill("s3", pages2, 8)
	res = xfer(d1, []rdma.Request{{Op: rdma.OpWrite, Source: junk, Target: d1.seg, TargetAddr: storeAddr(0, r3.GetPages()[0], 0), Length: 4 * tb}})
	if res.Failed != 1 || !strings.Contains(res.Tasks[0].Err.Error(), "belongs to peer "+strconv.Quote(d2.eng.SegmentName())) {
		t.Fatalf("write into a reservation named for another peer: %+v", res.Tasks)
	}
	if res := xfer(d2, d2.plan(t, pages2, r3, 0, 8)); res.Failed != 0 {
		t.Fatalf("push of s3 by its named writer: %+v", res.Tasks)
	}
	commit(r3.GetIngestId())
	verifySnapshot(t, s, "s3", 8)

	// Committed now: even the peer that pushed them cannot write them any more.
	v2, _ := st.Get("s2")
	res = xfer(d2, []rdma.Request{{Op: rdma.OpWrite, Source: d2.pool.Layout().GetBufferAddrs()[0], Target: d2.seg,
		TargetAddr: storeAddr(0, v2.Pages[0], 0), Length: 4 * tb}})
	if res.Failed != 1 || !strings.Contains(res.Tasks[0].Err.Error(), "not inside the reserved token range") {
		t.Fatalf("write into a committed snapshot by its pusher: %+v", res.Tasks)
	}
	verifySnapshot(t, s, "s1", 15)
	verifySnapshot(t, s, "s2", 8)
}

func TestReserveEndpointTooLong(t *testing.T) {
	s := newTestSidecar(t, true)
	_, err := s.ReserveSnapshot(context.Background(), &kvcv1.ReserveSnapshotRequest{SessionId: "a", Tokens: 4, SourceLayout: layout(),
		SourceTransferEndpoint: strings.Repeat("x", maxEndpoint+1)})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("reserve with a %d-byte endpoint: %v", maxEndpoint+1, err)
	}
	if st, _, _ := s.storeAndArena(); st.Pending() != 0 {
		t.Fatal("a refused reserve left a reservation")
	}
}

// batchResult is the final status of each request of one batch and how many did not complete.
type batchResult struct {
	Tasks  []rdma.TaskStatus
	Failed int
}

// runBatch runs reqs as one batch on eng and waits for every task (at most 10 s): the guard
// tests look at each task's status, which kvxfer.Transfer folds into one error.
func runBatch(t *testing.T, ctx context.Context, eng rdma.Engine, reqs []rdma.Request) batchResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	b, err := eng.AllocateBatch(len(reqs))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = eng.FreeBatch(b) }()
	if err := eng.Submit(ctx, b, reqs); err != nil {
		t.Fatal(err)
	}
	st, err := eng.Wait(ctx, b)
	if err != nil {
		t.Fatal(err)
	}
	res := batchResult{Tasks: st}
	for _, ts := range st {
		if ts.State != rdma.TaskCompleted {
			res.Failed++
		}
	}
	return res
}
