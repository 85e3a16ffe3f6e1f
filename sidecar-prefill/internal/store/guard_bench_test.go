package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/kvxfer/kvxfertest"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

func envInt(name string, def int64) int64 {
	if v, err := strconv.ParseInt(os.Getenv(name), 10, 64); err == nil && v > 0 {
		return v
	}
	return def
}

// pool lays a pool of pages over anonymous memory.
func pool(tb testing.TB, layers, ps int, tokenBytes uint64, pages int64) (rdma.Layout, *kvpool.View) {
	tb.Helper()
	l := rdma.Layout{PageSize: ps, ItemLen: uint64(ps) * tokenBytes, NumLayers: layers, PageCount: pages}
	m, err := kvpool.Arena(int64(l.BufferLen()) * int64(l.NumBuffers()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = m.Close() })
	var bufs [][]byte
	for i := 0; i < l.NumBuffers(); i++ {
		bufs = append(bufs, m.Bytes()[uint64(i)*l.BufferLen():uint64(i+1)*l.BufferLen()])
		l.BufferAddrs = append(l.BufferAddrs, m.Addr()+uint64(i)*l.BufferLen())
	}
	v, err := kvpool.NewView(l, bufs)
	if err != nil {
		tb.Fatal(err)
	}
	return l, v
}

// BenchmarkGuardedPush pushes a 50,000-token session (the shape of BenchmarkTransfer in pkg/rdma:
// 48 layers × K,V, page size 16, 128 bytes a token per buffer, sender pages 50% fragmented) from
// one tcp engine into a store's reservation on another, alternating runs without and with the
// store's write guard installed on the owner, verifies every byte, and prints the guarded
// throughput as a ratio of the unguarded one measured in the same process. With
// KVC_BENCH_FRAGMENTED=1 the store is fragmented first (every other page held by another
// session), so the reservation is one span per page per buffer.
func BenchmarkGuardedPush(b *testing.B) {
	const layers, ps = 48, 16
	tokens := envInt("KVC_BENCH_TOKENS", 50000)
	tokenBytes := uint64(envInt("KVC_BENCH_TOKEN_BYTES", 128))
	reps := int(envInt("KVC_BENCH_REPS", 5))
	fragmented := os.Getenv("KVC_BENCH_FRAGMENTED") == "1"
	sessionPages := (tokens + ps - 1) / ps
	srcL, src := pool(b, layers, ps, tokenBytes, 2*sessionPages)
	dstL, dst := pool(b, layers, ps, tokenBytes, 2*sessionPages)
	r := rand.New(rand.NewPCG(2026, 11))
	srcPages := make([]int64, sessionPages)
	for i, p := range r.Perm(int(2 * sessionPages))[:sessionPages] {
		srcPages[i] = int64(p)
	}
	slices.Sort(srcPages)
	seed := kvpool.SessionSeed("bench-session")
	if err := kvpool.FillTokens(src, seed, srcPages, 0, tokens); err != nil {
		b.Fatal(err)
	}

	st, err := store.New(store.Config{PageSize: ps, PageBytes: int64(dstL.ItemLen) * int64(dstL.NumBuffers()), PageCount: 2 * sessionPages,
		Buffers: dstL.BufferAddrs, ReserveTimeout: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	if fragmented {
		for i := int64(0); i < 2*sessionPages; i++ {
			res, err := st.Reserve(fmt.Sprint("filler-", i), 1, 0, ps, "bench")
			if err == nil {
				_, err = st.Commit(res.ID)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		for i := int64(0); i < 2*sessionPages; i += 2 {
			st.Release(fmt.Sprint("filler-", i))
		}
	}
	res, err := st.Reserve("bench-session", 1, 0, tokens, "bench")
	if err != nil {
		b.Fatal(err)
	}

	ctx := context.Background()
	sender, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 4, Layout: &srcL})
	if err != nil {
		b.Fatal(err)
	}
	defer sender.Close()
	owner, err := rdma.New(ctx, rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 4, Layout: &dstL})
	if err != nil {
		b.Fatal(err)
	}
	defer owner.Close()
	for _, reg := range srcL.Regions(rdma.MemHost, "cpu:0") {
		if err := sender.RegisterMemory(reg); err != nil {
			b.Fatal(err)
		}
	}
	for _, reg := range dstL.Regions(rdma.MemHost, "cpu:0") {
		if err := owner.RegisterMemory(reg); err != nil {
			b.Fatal(err)
		}
	}
	seg, err := sender.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		b.Fatal(err)
	}
	reqs, err := kvxfertest.Requests(kvxfer.PageMap{Layout: srcL.ToProto(), Pages: srcPages}, kvxfer.PageMap{Layout: dstL.ToProto(), Pages: res.Pages}, seg, 0, tokens)
	if err != nil {
		b.Fatal(err)
	}
	var total uint64
	for _, q := range reqs {
		total += q.Length
	}
	guarded := owner.(rdma.WriteGuarded)

	// The guard alone, over the requests of the push, in this goroutine.
	t0 := time.Now()
	for _, q := range reqs {
		if err := st.CheckWrite(sender.SegmentName(), q.TargetAddr, q.Length); err != nil {
			b.Fatal(err)
		}
	}
	perCheck := time.Since(t0) / time.Duration(len(reqs))

	b.SetBytes(int64(total))
	b.ResetTimer()
	var best, bestGuarded time.Duration
	run := func(g rdma.WriteGuard) time.Duration {
		guarded.SetWriteGuard(g)
		t0 := time.Now()
		moved, err := kvxfer.Transfer(ctx, sender, reqs)
		if err != nil || moved != total {
			b.Fatalf("transfer: %v (%d of %d bytes)", err, moved, total)
		}
		return time.Since(t0)
	}
	for i := 0; i < b.N*reps; i++ {
		// Alternate which goes first: the machine is noisy.
		first, second := rdma.WriteGuard(nil), rdma.WriteGuard(st.CheckWrite)
		if i%2 == 1 {
			first, second = second, first
		}
		for _, g := range []rdma.WriteGuard{first, second} {
			d := run(g)
			if g == nil {
				if best == 0 || d < best {
					best = d
				}
			} else if bestGuarded == 0 || d < bestGuarded {
				bestGuarded = d
			}
		}
	}
	b.StopTimer()
	bad, err := kvpool.CheckTokens(dst, seed, res.Pages, 0, tokens)
	if err != nil || bad != 0 {
		b.Fatalf("verification: %d (token, buffer) slots wrong, %v", bad, err)
	}
	gbps := func(d time.Duration) float64 { return float64(total) / d.Seconds() / 1e9 }
	fmt.Printf("guarded push: %d tokens, %d bytes, %d requests, store fragmented %v, every byte verified, best of %d each\n",
		tokens, total, len(reqs), fragmented, reps)
	fmt.Printf("guard: %d ns per check (alone, %d requests)\n", perCheck.Nanoseconds(), len(reqs))
	fmt.Printf("guard-transfer: guarded %.2f GB/s vs unguarded %.2f GB/s = %.2f\n", gbps(bestGuarded), gbps(best), best.Seconds()/bestGuarded.Seconds())
}
