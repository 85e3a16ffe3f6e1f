package worker

import "math/rand/v2"

// allocator is a page free list that is deliberately not sorted: it starts as short runs of
// contiguous pages in shuffled order and is used LIFO, so sessions get fragmented page lists the
// way SGLang's page allocator hands them out after churn. It is not safe for concurrent use (the
// worker's mutex guards it).
type allocator struct {
	free  []int64
	total int64
}

// newAllocator returns an allocator over pages [0, pageCount); seed makes the layout reproducible.
func newAllocator(pageCount int64, seed uint64) *allocator {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	// Runs of 1..8 contiguous pages, the runs shuffled.
	var runs [][2]int64
	for p := int64(0); p < pageCount; {
		n := min(int64(1+rng.IntN(8)), pageCount-p)
		runs = append(runs, [2]int64{p, n})
		p += n
	}
	rng.Shuffle(len(runs), func(i, j int) { runs[i], runs[j] = runs[j], runs[i] })
	free := make([]int64, 0, pageCount)
	// take() pops from the end, so store each run reversed to hand it out in ascending order.
	for i := len(runs) - 1; i >= 0; i-- {
		r := runs[i]
		for p := r[0] + r[1] - 1; p >= r[0]; p-- {
			free = append(free, p)
		}
	}
	return &allocator{free: free, total: pageCount}
}

// available is the number of free pages.
func (a *allocator) available() int64 { return int64(len(a.free)) }

// take removes n pages from the free list, or returns nil (taking nothing) when fewer are free.
func (a *allocator) take(n int64) []int64 {
	if n <= 0 {
		return []int64{}
	}
	if n > int64(len(a.free)) {
		return nil
	}
	out := make([]int64, n)
	for i := range out {
		out[i] = a.free[len(a.free)-1]
		a.free = a.free[:len(a.free)-1]
	}
	return out
}

// put returns pages to the free list (most recently freed pages are reused first).
func (a *allocator) put(pages []int64) {
	for i := len(pages) - 1; i >= 0; i-- {
		a.free = append(a.free, pages[i])
	}
}

// pagesFor is the number of pages covering tokens tokens.
func pagesFor(tokens int64, pageSize int) int64 {
	if tokens <= 0 {
		return 0
	}
	return (tokens + int64(pageSize) - 1) / int64(pageSize)
}
