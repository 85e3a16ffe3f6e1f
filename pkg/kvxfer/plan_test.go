package kvxfer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func layout(base uint64, pages int64) *kvcv1.KVLayout {
	// page size 4, 8 bytes per token per buffer, 1 layer (K, V)
	return &kvcv1.KVLayout{PageSize: 4, ItemLen: 32, NumLayers: 1, PageCount: pages, BufferAddrs: []uint64{base, base + 1<<20}}
}

func TestPlanRuns(t *testing.T) {
	src, dst := layout(0x10000, 64), layout(0x90000, 64)
	tests := []struct {
		name      string
		sp, dp    []int64
		dFirst    int64
		from, to  int64
		wantReqs  int
		wantBytes uint64
		wantErr   bool
	}{
		{"contiguous both sides", []int64{0, 1, 2}, []int64{5, 6, 7}, 0, 0, 12, 2, 12 * 8 * 2, false},
		{"scattered source", []int64{0, 2, 4}, []int64{5, 6, 7}, 0, 0, 12, 6, 12 * 8 * 2, false},
		{"partial tail page", []int64{0, 1, 2}, []int64{9, 10}, 1, 6, 11, 2, 5 * 8 * 2, false},
		{"partial and gap", []int64{0, 1, 2}, []int64{9, 20}, 1, 6, 11, 4, 5 * 8 * 2, false},
		{"empty", []int64{0}, []int64{0}, 0, 2, 2, 0, 0, false},
		{"source too short", []int64{0}, []int64{0, 1}, 0, 0, 8, 0, 0, true},
		{"target before its first page", []int64{0, 1}, []int64{3}, 1, 0, 8, 0, 0, true},
		{"page outside pool", []int64{0, 64}, []int64{0, 1}, 0, 0, 8, 0, 0, true},
		{"negative page", []int64{-1}, []int64{0}, 0, 0, 4, 0, 0, true},
		{"reversed range", []int64{0}, []int64{0}, 0, 3, 2, 0, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reqs, err := planTokens(PageMap{Layout: src, Pages: tt.sp}, PageMap{Layout: dst, Pages: tt.dp, First: tt.dFirst}, 7, tt.from, tt.to)
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v", err)
			}
			if err != nil {
				return
			}
			if len(reqs) != tt.wantReqs || reqBytes(reqs) != tt.wantBytes {
				t.Fatalf("%d requests, %d bytes; want %d, %d: %+v", len(reqs), reqBytes(reqs), tt.wantReqs, tt.wantBytes, reqs)
			}
			for _, r := range reqs {
				if r.Op != rdma.OpWrite || r.Target != 7 {
					t.Fatalf("bad request %+v", r)
				}
			}
		})
	}
	if _, err := planTokens(PageMap{Layout: src, Pages: []int64{0}}, PageMap{Layout: layout(1, 4)}, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	other := layout(0x90000, 64)
	other.ItemLen = 64
	if _, err := planTokens(PageMap{Layout: src, Pages: []int64{0}}, PageMap{Layout: other, Pages: []int64{0}}, 0, 0, 4); err == nil {
		t.Fatal("layout mismatch accepted")
	}
}

func FuzzPlanRuns(f *testing.F) {
	f.Add(int64(0), int64(5), int64(1), int64(3), int64(0), int64(9))
	f.Add(int64(63), int64(-1), int64(0), int64(2), int64(5), int64(4))
	f.Fuzz(func(t *testing.T, a, b, c, first, from, to int64) {
		src, dst := layout(0x10000, 64), layout(0x90000, 64)
		reqs, err := planTokens(PageMap{Layout: src, Pages: []int64{a, b, c}}, PageMap{Layout: dst, Pages: []int64{c, b, a}, First: first}, 1, from, to)
		if err != nil {
			return
		}
		for _, r := range reqs {
			if r.Source < 0x10000 || r.Source+r.Length > 0x10000+1<<20+64*32 || r.TargetAddr < 0x90000 || r.TargetAddr+r.Length > 0x90000+1<<20+64*32 {
				t.Fatalf("request outside the pools: %+v", r)
			}
		}
	})
}

// planTokensRef is the straightforward planner (token page by token page, buffer by buffer):
// PlanRuns(…).Requests must return exactly what it returns.
func planTokensRef(src, dst PageMap, seg rdma.SegmentID, from, to int64) ([]rdma.Request, error) {
	if err := CompatibleLayouts(src.Layout, dst.Layout); err != nil {
		return nil, err
	}
	if from < 0 || to < from {
		return nil, fmt.Errorf("bad token range")
	}
	ps := int64(src.Layout.GetPageSize())
	tb := uint64(src.Layout.GetItemLen() / ps)
	var reqs []rdma.Request
	for b := range src.Layout.GetBufferAddrs() {
		var cur *rdma.Request
		for t := from; t < to; {
			end := min((t/ps+1)*ps, to)
			s, err := src.Addr(b, t)
			if err != nil {
				return nil, err
			}
			d, err := dst.Addr(b, t)
			if err != nil {
				return nil, err
			}
			n := uint64(end-t) * tb
			if cur != nil && cur.Source+cur.Length == s && cur.TargetAddr+cur.Length == d {
				cur.Length += n
			} else {
				reqs = append(reqs, rdma.Request{Op: rdma.OpWrite, Source: s, Target: seg, TargetAddr: d, Length: n})
				cur = &reqs[len(reqs)-1]
			}
			t = end
		}
	}
	return reqs, nil
}

func TestPlanRunsMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	planned := 0
	for i := 0; i < 300; i++ {
		pages := int64(4 + rng.IntN(60))
		src, dst := layout(0x10000, 64), layout(0x90000, 64)
		pick := func(n int) []int64 {
			out := make([]int64, n)
			for j := range out {
				switch rng.IntN(3) {
				case 0:
					out[j] = int64(j) // runs
				case 1:
					if j > 0 {
						out[j] = out[j-1] + 1
					}
				default:
					out[j] = rng.Int64N(pages+2) - 1 // jumps, sometimes out of range
				}
			}
			return out
		}
		sp, dp := pick(8), pick(8)
		first := rng.Int64N(3)
		from := rng.Int64N(40)
		to := from + rng.Int64N(40) - 4
		got, err := planTokens(PageMap{Layout: src, Pages: sp}, PageMap{Layout: dst, Pages: dp, First: first}, 3, from, to)
		want, werr := planTokensRef(PageMap{Layout: src, Pages: sp}, PageMap{Layout: dst, Pages: dp, First: first}, 3, from, to)
		if (err != nil) != (werr != nil) {
			t.Fatalf("case %d (%v %v first %d [%d,%d)): err %v, reference %v", i, sp, dp, first, from, to, err, werr)
		}
		if err == nil && !slices.Equal(got, want) {
			t.Fatalf("case %d (%v %v first %d [%d,%d)):\n got %+v\nwant %+v", i, sp, dp, first, from, to, got, want)
		}
		if len(got) > 0 {
			planned++
		}
	}
	if planned < 30 {
		t.Fatalf("only %d of 300 random cases planned requests", planned)
	}
}

// planTokens is PlanRuns laid out as requests of one batch.
func planTokens(src, dst PageMap, seg rdma.SegmentID, from, to int64) ([]rdma.Request, error) {
	p, err := PlanRuns(src, dst, from, to)
	if err != nil {
		return nil, err
	}
	return p.Requests(seg), nil
}

// reqBytes sums the lengths of reqs.
func reqBytes(reqs []rdma.Request) uint64 {
	var n uint64
	for _, r := range reqs {
		n += r.Length
	}
	return n
}
