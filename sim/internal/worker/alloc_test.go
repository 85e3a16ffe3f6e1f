package worker

import (
	"slices"
	"testing"
)

func TestAllocatorFragmentedAndConserving(t *testing.T) {
	const n = 1000
	a := newAllocator(n, 7)
	if a.available() != n {
		t.Fatalf("available %d", a.available())
	}
	got := a.take(n)
	if len(got) != n {
		t.Fatalf("took %d", len(got))
	}
	if slices.IsSorted(got) {
		t.Fatal("free list is sorted: allocation is not fragmented")
	}
	runs := 1
	for i := 1; i < len(got); i++ {
		if got[i] != got[i-1]+1 {
			runs++
		}
	}
	if runs < n/10 || runs > n*9/10 {
		t.Fatalf("%d contiguous runs in %d pages: want partial fragmentation", runs, n)
	}
	s := slices.Clone(got)
	slices.Sort(s)
	for i, p := range s {
		if p != int64(i) {
			t.Fatalf("page %d missing or duplicated", i)
		}
	}
	if a.take(1) != nil {
		t.Fatal("take from empty allocator must fail")
	}
	a.put(got[:10])
	if a.take(11) != nil || a.available() != 10 {
		t.Fatal("a failed take must take nothing")
	}
	if x := a.take(10); !slices.Equal(x, got[:10]) {
		t.Fatalf("LIFO reuse: got %v want %v", x, got[:10])
	}
}

func TestPagesFor(t *testing.T) {
	for _, tt := range []struct{ tokens, want int64 }{{0, 0}, {-3, 0}, {1, 1}, {16, 1}, {17, 2}, {32, 2}} {
		if got := pagesFor(tt.tokens, 16); got != tt.want {
			t.Errorf("pagesFor(%d) = %d, want %d", tt.tokens, got, tt.want)
		}
	}
}
