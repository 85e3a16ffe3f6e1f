package kvxfer

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/rdma"
)

func engines(t *testing.T) (src, dst *Pool, engS, engD rdma.Engine, seg rdma.SegmentID) {
	t.Helper()
	var err error
	if src, err = NewArena(Shape{PageSize: 4, ItemLen: 64, PageCount: 16, NumLayers: 1}); err != nil {
		t.Fatal(err)
	}
	if dst, err = NewArena(Shape{PageSize: 4, ItemLen: 64, PageCount: 16, NumLayers: 1}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { src.Close(); dst.Close() })
	for _, e := range []*rdma.Engine{&engS, &engD} {
		if *e, err = rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1}); err != nil {
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
			src.Buffer(b)[i] = byte(i*7 + b)
		}
	}
	return
}

func TestTransferAndAbort(t *testing.T) {
	src, dst, engS, _, seg := engines(t)
	scattered := []int64{0, 2, 4, 6, 8, 10, 12, 14} // one request per page per buffer
	reqs, err := planTokens(PageMap{Layout: src.Layout(), Pages: scattered}, PageMap{Layout: dst.Layout(), Pages: scattered}, seg, 0, 32)
	if err != nil || len(reqs) != 16 {
		t.Fatalf("plan: %d requests, %v", len(reqs), err)
	}
	slow := NewSlowEngine(engS, time.Hour) // nothing starts before the cancel
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := Transfer(ctx, slow, reqs)
		done <- err
	}()
	cancel()
	if err := <-done; !errors.Is(err, ErrAborted) {
		t.Fatalf("aborted transfer: %v", err)
	}
	for b := 0; b < dst.Buffers(); b++ {
		if !bytes.Equal(dst.Buffer(b), make([]byte, len(dst.Buffer(b)))) {
			t.Fatal("an aborted transfer wrote bytes")
		}
	}
	moved, err := Transfer(context.Background(), NewSlowEngine(engS, time.Millisecond), reqs)
	if err != nil || moved != reqBytes(reqs) {
		t.Fatalf("slow transfer: %d bytes, %v", moved, err)
	}
	for b := 0; b < dst.Buffers(); b++ {
		for _, p := range scattered {
			if !bytes.Equal(dst.Buffer(b)[p*64:(p+1)*64], src.Buffer(b)[p*64:(p+1)*64]) {
				t.Fatalf("buffer %d page %d differs", b, p)
			}
		}
		if !bytes.Equal(dst.Buffer(b)[64:128], make([]byte, 64)) {
			t.Fatal("a page outside the plan was written")
		}
	}
	// a request outside registered memory fails as a task, not a crash
	bad := []rdma.Request{{Op: rdma.OpWrite, Source: src.Layout().GetBufferAddrs()[0], Target: seg, TargetAddr: 64, Length: 64}}
	if _, err := Transfer(context.Background(), engS, bad); err == nil {
		t.Fatal("write outside the peer's memory succeeded")
	}
}
