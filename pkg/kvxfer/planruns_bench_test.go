package kvxfer

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// BenchmarkPlanRuns plans the GPU benchmark's session shape (50,000 tokens, page 16, every
// other source page, 96 buffers) — the step of a push between ReserveSnapshot and the first
// copy.
func BenchmarkPlanRuns(b *testing.B) {
	const pages, tokens = 6250, 50000
	lay := func() *kvcv1.KVLayout {
		addrs := make([]uint64, 96)
		for i := range addrs {
			addrs[i] = uint64(i+1) << 32
		}
		return &kvcv1.KVLayout{PageSize: 16, ItemLen: 16 << 10, NumLayers: 48, PageCount: pages, BufferAddrs: addrs}
	}
	np := tokens / 16
	sp, dp := make([]int64, np), make([]int64, np)
	for i := range sp {
		// runs of one to three pages on the source, a contiguous store
		sp[i], dp[i] = int64(i+i/2+(i/3)%2), int64(i)
	}
	src, dst := PageMap{Layout: lay(), Pages: sp}, PageMap{Layout: lay(), Pages: dp}
	b.ReportAllocs()
	for b.Loop() {
		p, err := PlanRuns(src, dst, 0, tokens)
		if err != nil || p.Bytes() != tokens*1024*96 {
			b.Fatal(err)
		}
	}
}
