package kvxfer

import (
	"context"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// BenchmarkSnapshotPush measures an incremental D→P push (the append only, as the decode sidecar
// sends it) against a full push of the whole context (the baseline), both over two real tcp
// engines in this process, and reports the time ratio full/incremental.
func BenchmarkSnapshotPush(b *testing.B) {
	const (
		page    = 16
		layers  = 8
		tokB    = 128 // bytes per token per buffer: 2 KiB per token over 16 buffers
		ctxLen  = 4096
		appendN = 512
	)
	pages := int64(ctxLen / page)
	src, err := NewArena(Shape{PageSize: page, ItemLen: page * tokB, PageCount: pages, NumLayers: layers})
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	dst, err := NewArena(Shape{PageSize: page, ItemLen: page * tokB, PageCount: pages, NumLayers: layers})
	if err != nil {
		b.Fatal(err)
	}
	defer dst.Close()
	ctx := context.Background()
	engS, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 2})
	if err != nil {
		b.Fatal(err)
	}
	defer engS.Close()
	engD, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 2})
	if err != nil {
		b.Fatal(err)
	}
	defer engD.Close()
	if err := src.Register(engS, "host"); err != nil {
		b.Fatal(err)
	}
	if err := dst.Register(engD, "host"); err != nil {
		b.Fatal(err)
	}
	seg, err := engS.OpenSegment(ctx, engD.SegmentName())
	if err != nil {
		b.Fatal(err)
	}
	pm := make([]int64, pages)
	for i := range pm {
		pm[i] = int64(i)
	}
	plan := func(from, to int64) []rdma.Request {
		r, err := planTokens(PageMap{Layout: src.Layout(), Pages: pm}, PageMap{Layout: dst.Layout(), Pages: pm}, seg, from, to)
		if err != nil {
			b.Fatal(err)
		}
		return r
	}
	incr, full := plan(ctxLen-appendN, ctxLen), plan(0, ctxLen)
	run := func(reqs []rdma.Request, n int) time.Duration {
		start := time.Now()
		for i := 0; i < n; i++ {
			if _, err := Transfer(ctx, engS, reqs); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	run(full, 1) // warm the connections
	b.SetBytes(int64(reqBytes(incr)))
	b.ResetTimer()
	ti := run(incr, b.N)
	b.StopTimer()
	tf := run(full, b.N)
	b.ReportMetric(float64(tf)/float64(ti), "full/incr")
	b.ReportMetric(float64(reqBytes(full))/float64(reqBytes(incr)), "bytes_full/incr")
}
