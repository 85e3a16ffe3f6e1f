package kvxfer

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// countingEngine records the size of every submission.
type countingEngine struct {
	rdma.Engine
	mu    sync.Mutex
	sizes []int
}

func (c *countingEngine) Submit(ctx context.Context, b rdma.BatchID, reqs []rdma.Request) error {
	c.mu.Lock()
	c.sizes = append(c.sizes, len(reqs))
	c.mu.Unlock()
	return c.Engine.Submit(ctx, b, reqs)
}

func streamPools(t *testing.T, layers int32, pages int64) (src, dst *Pool, engS rdma.Engine, seg rdma.SegmentID) {
	t.Helper()
	var err error
	if src, err = NewArena(Shape{PageSize: 4, ItemLen: 32, PageCount: pages, NumLayers: layers}); err != nil {
		t.Fatal(err)
	}
	if dst, err = NewArena(Shape{PageSize: 4, ItemLen: 32, PageCount: pages, NumLayers: layers}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close(); dst.Close() })
	var engD rdma.Engine
	for _, e := range []*rdma.Engine{&engS, &engD} {
		if *e, err = rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 2}); err != nil {
			t.Fatal(err)
		}
		eng := *e
		t.Cleanup(func() { _ = eng.Close() })
	}
	if err := src.Register(engS, "host"); err != nil {
		t.Fatal(err)
	}
	if err := dst.Register(engD, "host"); err != nil {
		t.Fatal(err)
	}
	if seg, err = engS.OpenSegment(context.Background(), engD.SegmentName()); err != nil {
		t.Fatal(err)
	}
	for b := 0; b < src.Buffers(); b++ {
		for i := range src.Buffer(b) {
			src.Buffer(b)[i] = byte(i*13 + b*7 + 1)
		}
	}
	return
}

func TestTokenPlanTransfer(t *testing.T) {
	tests := []struct {
		name        string
		layers      int32
		pages       int64 // pool pages; the session uses every other source page
		tokens      int64
		wantBatches int
	}{
		{"one batch", 2, 64, 100, 1},
		// 512 runs per buffer, 16 buffers: 8,192 requests in batches of 4 and 12 buffers
		{"streamed", 8, 1024, 2048, 2},
		// 64 buffers: 32,768 requests in batches of 4, 16 and 44 buffers (growth 4)
		{"streamed, three batches", 32, 1024, 2048, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			src, dst, engS, seg := streamPools(t, tt.layers, tt.pages)
			np := (tt.tokens + 3) / 4
			sp, dp := make([]int64, np), make([]int64, np)
			for i := range sp {
				sp[i], dp[i] = int64(2*i), int64(i) // fragmented source, contiguous target
			}
			sm, dm := PageMap{Layout: src.Layout(), Pages: sp}, PageMap{Layout: dst.Layout(), Pages: dp}
			plan, err := PlanRuns(sm, dm, 0, tt.tokens)
			if err != nil {
				t.Fatal(err)
			}
			ref, err := planTokens(sm, dm, seg, 0, tt.tokens)
			if err != nil || plan.Len() != len(ref) || plan.Bytes() != reqBytes(ref) {
				t.Fatalf("plan: %d requests %d bytes, PlanTokens %d requests %d bytes (%v)", plan.Len(), plan.Bytes(), len(ref), reqBytes(ref), err)
			}
			ce := &countingEngine{Engine: engS}
			for rep := 0; rep < 2; rep++ { // the second reuses the request memory
				clear(dst.Buffer(0))
				moved, err := plan.Transfer(context.Background(), ce, seg)
				if err != nil || moved != plan.Bytes() {
					t.Fatalf("transfer: %d of %d bytes, %v", moved, plan.Bytes(), err)
				}
			}
			sum := 0
			for _, n := range ce.sizes {
				sum += n
			}
			if len(ce.sizes) != 2*tt.wantBatches || sum != 2*plan.Len() {
				t.Fatalf("submissions %v, want %d per transfer covering %d requests", ce.sizes, tt.wantBatches, plan.Len())
			}
			tb := int64(8)
			for b := 0; b < dst.Buffers(); b++ {
				for tok := int64(0); tok < tt.tokens; tok++ {
					s := src.Buffer(b)[(sp[tok/4]*4+tok%4)*tb:][:tb]
					d := dst.Buffer(b)[(dp[tok/4]*4+tok%4)*tb:][:tb]
					if !bytes.Equal(s, d) {
						t.Fatalf("buffer %d token %d differs", b, tok)
					}
				}
				if rest := dst.Buffer(b)[np*4*tb:]; !bytes.Equal(rest, make([]byte, len(rest))) {
					t.Fatalf("buffer %d: bytes outside the plan were written", b)
				}
			}
		})
	}
}

func TestTokenPlanTransferAbortAndFailure(t *testing.T) {
	src, dst, engS, seg := streamPools(t, 8, 1024)
	pages := make([]int64, 512)
	for i := range pages {
		pages[i] = int64(2 * i)
	}
	plan, err := PlanRuns(PageMap{Layout: src.Layout(), Pages: pages}, PageMap{Layout: dst.Layout(), Pages: pages}, 0, 2048)
	if err != nil {
		t.Fatal(err)
	}
	// canceled while several batches are submitted and none has started: nothing is written
	ctx, cancel := context.WithCancelCause(context.Background())
	slow := NewSlowEngine(engS, time.Hour)
	done := make(chan error, 1)
	go func() {
		_, err := plan.Transfer(ctx, slow, seg)
		done <- err
	}()
	cancel(errors.New("released"))
	select {
	case err := <-done:
		if !errors.Is(err, ErrAborted) {
			t.Fatalf("canceled transfer: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("canceled transfer did not return")
	}
	for b := 0; b < dst.Buffers(); b++ {
		if !bytes.Equal(dst.Buffer(b), make([]byte, len(dst.Buffer(b)))) {
			t.Fatal("an aborted transfer wrote bytes")
		}
	}
	// an unknown segment: every task fails, the error says so, nothing crashes
	if moved, err := plan.Transfer(context.Background(), engS, seg+100); err == nil || moved != 0 {
		t.Fatalf("transfer to an unknown segment: %d bytes, %v", moved, err)
	}
	// a plan that moves nothing submits nothing
	empty, err := PlanRuns(PageMap{Layout: src.Layout(), Pages: pages}, PageMap{Layout: dst.Layout(), Pages: pages}, 8, 8)
	if err != nil {
		t.Fatal(err)
	}
	ce := &countingEngine{Engine: engS}
	if moved, err := empty.Transfer(context.Background(), ce, seg); err != nil || moved != 0 || len(ce.sizes) != 0 {
		t.Fatalf("empty plan: %d bytes, %v, submissions %v", moved, err, ce.sizes)
	}
}

func TestRequestFreeList(t *testing.T) {
	reqMu.Lock()
	saved := reqFree
	reqFree = nil
	reqMu.Unlock()
	t.Cleanup(func() { reqMu.Lock(); reqFree = saved; reqMu.Unlock() })
	a := getReqs(100)
	if len(*a) < 100 {
		t.Fatalf("got %d requests", len(*a))
	}
	putReqs(a)
	if b := getReqs(50); b != a {
		t.Fatal("a free slice large enough was not reused")
	} else {
		putReqs(b)
	}
	if c := getReqs(1000); c == a || len(*c) < 1000 { // a holds only 100
		t.Fatal("a slice too small was handed out")
	} else {
		putReqs(c)
	}
	for range 2 * reqFreeMax {
		putReqs(getReqsNew(10))
	}
	reqMu.Lock()
	n := len(reqFree)
	reqMu.Unlock()
	if n > reqFreeMax {
		t.Fatalf("free list holds %d slices", n)
	}
}

func getReqsNew(n int) *[]rdma.Request {
	s := make([]rdma.Request, n)
	return &s
}

// orderEngine logs Submit and Wait calls.
type orderEngine struct {
	rdma.Engine
	mu  sync.Mutex
	log []string
	ids []rdma.BatchID
}

func (o *orderEngine) Submit(ctx context.Context, b rdma.BatchID, reqs []rdma.Request) error {
	o.mu.Lock()
	o.log = append(o.log, "submit")
	o.ids = append(o.ids, b)
	o.mu.Unlock()
	return o.Engine.Submit(ctx, b, reqs)
}

func (o *orderEngine) Wait(ctx context.Context, b rdma.BatchID) ([]rdma.TaskStatus, error) {
	o.mu.Lock()
	o.log = append(o.log, "wait")
	o.mu.Unlock()
	return o.Engine.Wait(ctx, b)
}

func TestTokenPlanTransferThen(t *testing.T) {
	src, dst, engS, seg := streamPools(t, 32, 1024)
	const tokens = 2048
	np := int64(tokens / 4)
	sp, dp := make([]int64, np), make([]int64, np)
	for i := range sp {
		sp[i], dp[i] = int64(2*i), int64(i)
	}
	plan, err := PlanRuns(PageMap{Layout: src.Layout(), Pages: sp}, PageMap{Layout: dst.Layout(), Pages: dp}, 0, tokens)
	if err != nil {
		t.Fatal(err)
	}
	oe := &orderEngine{Engine: engS}
	var got [][]rdma.BatchID
	moved, err := plan.TransferThen(context.Background(), oe, seg, func(b []rdma.BatchID) {
		oe.mu.Lock()
		oe.log = append(oe.log, "hook")
		oe.mu.Unlock()
		got = append(got, b)
	})
	if err != nil || moved != plan.Bytes() {
		t.Fatalf("transfer: %d of %d bytes, %v", moved, plan.Bytes(), err)
	}
	want := []string{"submit", "submit", "submit", "hook", "wait", "wait", "wait"}
	if len(oe.log) != len(want) {
		t.Fatalf("calls %v, want %v", oe.log, want)
	}
	for i := range want {
		if oe.log[i] != want[i] {
			t.Fatalf("calls %v, want %v", oe.log, want)
		}
	}
	if len(got) != 1 || len(got[0]) != len(oe.ids) {
		t.Fatalf("hook got %v, submitted %v", got, oe.ids)
	}
	for i := range oe.ids {
		if got[0][i] != oe.ids[i] {
			t.Fatalf("hook got %v, submitted %v", got, oe.ids)
		}
	}

	// ctx ended before the first submission: no hook
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	called := false
	if _, err := plan.TransferThen(ctx, engS, seg, func([]rdma.BatchID) { called = true }); !errors.Is(err, ErrAborted) || called {
		t.Fatalf("canceled transfer: %v, hook called %v", err, called)
	}
}
