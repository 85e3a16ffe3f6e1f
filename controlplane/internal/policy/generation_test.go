package policy

import (
	"math"
	"testing"
)

// TestNextGeneration: a new residency's generation is above the session's, and above every
// generation of an earlier term (the first one of a term is term << GenerationTermBits); term 0
// counts on by one.
func TestNextGeneration(t *testing.T) {
	const b = GenerationTermBits
	for _, tc := range []struct {
		name     string
		g, term  uint64
		want     uint64
		wantTerm uint64
	}{
		{"first seed, no term", 0, 0, 1, 0},
		{"no term counts on", 41, 0, 42, 0},
		{"first seed of term 1", 0, 1, 1 << b, 1},
		{"an earlier term's generation", 7<<b | 123, 9, 9 << b, 9},
		{"within the term", 9<<b | 4, 9, 9<<b | 5, 9},
		{"a pre-term generation", 5, 2, 2 << b, 2},
		{"a later term's generation is never lowered", 12<<b | 1, 9, 12<<b | 2, 12},
		{"the last term stays below 2^53", 0, MaxGenerationTerm, MaxGenerationTerm << b, MaxGenerationTerm},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := NextGeneration(tc.g, tc.term)
			if got != tc.want || got <= tc.g || GenerationTerm(got) != tc.wantTerm {
				t.Fatalf("NextGeneration(%#x, %d) = %#x (term %d), want %#x (term %d)", tc.g, tc.term, got, GenerationTerm(got), tc.want, tc.wantTerm)
			}
		})
	}
	for _, tc := range []struct {
		name    string
		g, term uint64
	}{
		{"2^60", 1 << 60, 3},
		{"2^64-1", math.MaxUint64, 3},
		{"MaxGeneration", MaxGeneration, 3},
		{"a term past the last", 5, MaxGenerationTerm + 1},
		{"term 2^64-1", 5, math.MaxUint64},
		{"term 2^40 (shifts past 64 bits)", 0, 1 << 40},
	} {
		t.Run("overflow: "+tc.name, func(t *testing.T) {
			if got := NextGeneration(tc.g, tc.term); got != MaxGeneration {
				t.Fatalf("NextGeneration(%#x, %#x) = %#x, want it saturated at %#x (never wrapped)", tc.g, tc.term, got, uint64(MaxGeneration))
			}
		})
	}
	if last := NextGeneration(MaxGenerationTerm<<b|(1<<b-2), MaxGenerationTerm); last >= 1<<53 {
		t.Fatalf("the last generation of the last term %#x is not below 2^53", last)
	}
}
