package pagehash

import "testing"

// A clone is independent of its original: appending to or truncating one leaves the other.
func TestSparseClone(t *testing.T) {
	s, _ := NewSparse(4, 8)
	chain := make([]uint64, 40)
	for i := range chain {
		chain[i] = uint64(i*7 + 1)
	}
	s.Append(chain[:30])
	c := s.Clone()
	c.Truncate(10)
	c.Append([]uint64{99})
	if s.Pages() != 30 || !s.IsPrefixOf(chain) {
		t.Fatalf("original changed: %d pages, prefix %v", s.Pages(), s.IsPrefixOf(chain))
	}
	s.Append(chain[30:])
	if c.Pages() != 11 || c.IsPrefixOf(chain) || c.CommonPages(chain) != 8 {
		t.Fatalf("clone: %d pages, prefix %v, common %d", c.Pages(), c.IsPrefixOf(chain), c.CommonPages(chain))
	}
}
