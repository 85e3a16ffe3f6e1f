package store

import (
	"fmt"
	"testing"
)

// BenchmarkCheckWrite: CheckWrite over the per-buffer runs of a 50,000-token reservation
// (48 layers × K,V, page size 16, 128 bytes a token per buffer), from 4 goroutines at once as the
// tcp owner's connections call it; contiguous store or fragmented page by page.
func BenchmarkCheckWrite(b *testing.B) {
	for _, frag := range []bool{false, true} {
		b.Run(fmt.Sprintf("fragmented=%v", frag), func(b *testing.B) {
			const layers, ps, tb, tokens = 48, 16, 128, 50000
			pages := int64(2 * (tokens / ps))
			item := uint64(ps * tb)
			var bufs []uint64
			for i := 0; i < 2*layers; i++ {
				bufs = append(bufs, 1<<40+uint64(i)*item*uint64(pages))
			}
			s, err := New(Config{PageSize: ps, PageBytes: int64(item) * 2 * layers, PageCount: pages, Buffers: bufs})
			if err != nil {
				b.Fatal(err)
			}
			if frag {
				for i := int64(0); i < pages; i++ {
					r, _ := s.Reserve(fmt.Sprint("f", i), 1, 0, ps, "x")
					_, _ = s.Commit(r.ID)
				}
				for i := int64(0); i < pages; i += 2 {
					s.Release(fmt.Sprint("f", i))
				}
			}
			r, err := s.Reserve("s", 1, 0, tokens, "x")
			if err != nil {
				b.Fatal(err)
			}
			// Requests: runs of up to 2 pages, contiguous in the store, per buffer.
			type req struct{ a, n uint64 }
			var reqs []req
			for _, buf := range bufs {
				for i := 0; i < len(r.Pages); {
					k := 1
					if i+1 < len(r.Pages) && r.Pages[i+1] == r.Pages[i]+1 {
						k = 2
					}
					reqs = append(reqs, req{buf + uint64(r.Pages[i])*item, uint64(k) * item})
					i += k
				}
			}
			b.SetParallelism(2) // 2 × GOMAXPROCS goroutines
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					q := reqs[i%len(reqs)]
					if err := s.CheckWrite("p", q.a, q.n); err != nil {
						panic(err)
					}
					i += 7
				}
			})
		})
	}
}
