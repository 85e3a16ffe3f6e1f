package state

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestSmallest(t *testing.T) {
	cases := []struct {
		ids  []string
		k    int
		want []string
		more bool
	}{
		{nil, 3, nil, false},
		{[]string{"b", "a"}, 3, []string{"a", "b"}, false},
		{[]string{"c", "a", "b"}, 3, []string{"a", "b", "c"}, false},
		{[]string{"d", "c", "a", "b"}, 3, []string{"a", "b", "c"}, true},
		{[]string{"e", "d", "c", "b", "a"}, 1, []string{"a"}, true},
		{[]string{"a", "e", "b", "d", "c"}, 2, []string{"a", "b"}, true},
	}
	for _, tc := range cases {
		got, more := smallest(slices.Clone(tc.ids), tc.k)
		if !slices.Equal(got, tc.want) || more != tc.more {
			t.Errorf("smallest(%v, %d) = %v %v, want %v %v", tc.ids, tc.k, got, more, tc.want, tc.more)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		n, k := r.IntN(300), 1+r.IntN(50)
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("s-%06d", r.IntN(1_000_000))
		}
		want := slices.Clone(ids)
		slices.Sort(want)
		if len(want) > k {
			want = want[:k]
		}
		if got, more := smallest(ids, k); !slices.Equal(got, want) || more != (n > k) {
			t.Fatalf("n %d k %d: %v, want %v", n, k, got, want)
		}
	}
}
