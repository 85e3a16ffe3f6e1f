package pagehash

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
)

// Sparse is the compact form of a session's chain: what the control plane keeps to find the
// longest common prefix between the KV a decode worker holds and a new prompt.
//
// It holds the chain's length and the hashes of
//
//   - the last Tail pages (exact answers for edits near the end: a stripped reasoning block,
//     a rewritten last tool result, the re-rendering seam of the previous answer), and
//   - every Stride-th page (index+1 a multiple of Stride) before that (compaction or
//     summarisation of old turns).
//
// Cost and precision: about Tail + Pages/Stride hashes, versus one per page for the full
// chain. IsPrefixOf is exact (one comparison at the last page). CommonPages is a lower bound
// of the true common prefix c: exact when the hash of page c-1 is kept (c > Pages-Tail: the
// prompt diverges inside the tail after its first page), otherwise rounded down to a multiple
// of Stride, so at most Stride-1 reusable pages are re-prefilled. With
// 16-token pages, Tail 16 and Stride 32, a 32K-token session keeps 79 hashes (under 800 bytes
// encoded) instead of 2,048 (16 KiB), and an early edit costs at most 496 extra prefill tokens.
// The extremes: the last hash alone (8 bytes) answers only "is the resident KV a prefix"; the
// full chain finds every common prefix exactly.
//
// Sparse grows incrementally (Append) without the full chain: a page dropped once is never
// needed again, because the kept set of a longer chain, below the old length, is a subset of
// the old kept set.
type Sparse struct {
	pages  int
	tail   int
	stride int
	idx    []uint32 // ascending kept page indices
	hash   []uint64 // hash[k] is the chain's entry idx[k]
}

// Default compaction parameters.
const (
	DefaultTail   = 16
	DefaultStride = 32
)

// Bounds that keep a decoded Sparse small.
const (
	maxTail   = 1 << 12
	maxStride = 1 << 20
	maxPages  = 1 << 26 // 2^26 pages: beyond any context length
)

// ErrSparse is the class of invalid Sparse parameters and encodings.
var ErrSparse = errors.New("pagehash: invalid sparse chain")

func keep(i, n, tail, stride int) bool {
	return i >= n-tail || (i+1)%stride == 0
}

// NewSparse returns an empty session chain with the given compaction (tail >= 1, stride >= 1).
func NewSparse(tail, stride int) (*Sparse, error) {
	if tail < 1 || tail > maxTail || stride < 1 || stride > maxStride {
		return nil, fmt.Errorf("%w: tail %d, stride %d", ErrSparse, tail, stride)
	}
	return &Sparse{tail: tail, stride: stride}, nil
}

// Pages is the length of the session's chain in pages.
func (s *Sparse) Pages() int { return s.pages }

// Len is the number of hashes kept.
func (s *Sparse) Len() int { return len(s.hash) }

// Append adds the hashes of the session's next pages (continuing its chain) and drops those
// that left the tail and are not on the stride.
func (s *Sparse) Append(pages []uint64) {
	if len(pages) == 0 {
		return
	}
	n := s.pages + len(pages)
	w := 0
	for k, i := range s.idx {
		if keep(int(i), n, s.tail, s.stride) {
			s.idx[w], s.hash[w] = i, s.hash[k]
			w++
		}
	}
	s.idx, s.hash = s.idx[:w], s.hash[:w]
	for j, h := range pages {
		if i := s.pages + j; keep(i, n, s.tail, s.stride) {
			s.idx = append(s.idx, uint32(i))
			s.hash = append(s.hash, h)
		}
	}
	s.pages = n
}

// Clone returns an independent copy of s.
func (s *Sparse) Clone() *Sparse {
	c := *s
	c.idx = append([]uint32(nil), s.idx...)
	c.hash = append([]uint64(nil), s.hash...)
	return &c
}

// Truncate cuts the session to its first n pages (the decode worker freed the rest). Cutting
// at a CommonPages result keeps the hash of the new last page, so IsPrefixOf stays exact.
func (s *Sparse) Truncate(n int) {
	if n >= s.pages {
		return
	}
	n = max(n, 0)
	k := sort.Search(len(s.idx), func(k int) bool { return int(s.idx[k]) >= n })
	s.idx, s.hash, s.pages = s.idx[:k], s.hash[:k], n
}

// IsPrefixOf reports whether the session's pages are a prefix of the prompt's chain. It is
// false when the session's last hash is not held (after a Truncate at another boundary).
func (s *Sparse) IsPrefixOf(prompt []uint64) bool {
	if s.pages == 0 {
		return true
	}
	if s.pages > len(prompt) || len(s.idx) == 0 || int(s.idx[len(s.idx)-1]) != s.pages-1 {
		return false
	}
	return prompt[s.pages-1] == s.hash[len(s.hash)-1]
}

// CommonPages returns how many leading pages the session provably shares with the prompt's
// chain (a lower bound of the true common prefix; see the type's comment).
func (s *Sparse) CommonPages(prompt []uint64) int {
	// Kept entries that the prompt covers, ascending; matches form a prefix of them.
	m := sort.Search(len(s.idx), func(k int) bool { return int(s.idx[k]) >= len(prompt) })
	k := sort.Search(m, func(k int) bool { return prompt[s.idx[k]] != s.hash[k] })
	if k == 0 {
		return 0
	}
	return int(s.idx[k-1]) + 1
}

// MarshalBinary encodes the Sparse: a version byte (1), then uvarints pages, tail, stride,
// count, then count entries of (uvarint index delta, 8-byte little-endian hash).
func (s *Sparse) MarshalBinary() ([]byte, error) {
	b := make([]byte, 0, 16+len(s.idx)*10)
	b = append(b, 1)
	b = binary.AppendUvarint(b, uint64(s.pages))
	b = binary.AppendUvarint(b, uint64(s.tail))
	b = binary.AppendUvarint(b, uint64(s.stride))
	b = binary.AppendUvarint(b, uint64(len(s.idx)))
	prev := uint32(0)
	for k, i := range s.idx {
		b = binary.AppendUvarint(b, uint64(i-prev))
		b = binary.LittleEndian.AppendUint64(b, s.hash[k])
		prev = i
	}
	return b, nil
}

// UnmarshalBinary decodes MarshalBinary's output; anything else is an ErrSparse.
func (s *Sparse) UnmarshalBinary(b []byte) error {
	bad := func(why string) error { return fmt.Errorf("%w: %s", ErrSparse, why) }
	if len(b) == 0 || b[0] != 1 {
		return bad("unknown version")
	}
	b = b[1:]
	var vals [4]uint64
	for i := range vals {
		v, n := uvarint(b)
		if n <= 0 {
			return bad("truncated or non-canonical header")
		}
		vals[i], b = v, b[n:]
	}
	pages, tail, stride, count := vals[0], vals[1], vals[2], vals[3]
	if pages > maxPages || tail < 1 || tail > maxTail || stride < 1 || stride > maxStride {
		return bad("parameters out of range")
	}
	if count > pages || count > uint64(len(b))/9 {
		return bad("more entries than pages or bytes")
	}
	idx := make([]uint32, 0, count)
	hash := make([]uint64, 0, count)
	next := uint64(0)
	for k := uint64(0); k < count; k++ {
		d, n := uvarint(b)
		if n <= 0 || len(b[n:]) < 8 {
			return bad("truncated entry")
		}
		if k > 0 && d == 0 {
			return bad("indices not ascending")
		}
		if d >= pages {
			return bad("index beyond the chain")
		}
		next += d
		if next >= pages {
			return bad("index beyond the chain")
		}
		idx = append(idx, uint32(next))
		hash = append(hash, binary.LittleEndian.Uint64(b[n:]))
		b = b[n+8:]
	}
	if len(b) != 0 {
		return bad("trailing bytes")
	}
	*s = Sparse{pages: int(pages), tail: int(tail), stride: int(stride), idx: idx, hash: hash}
	return nil
}

// uvarint is binary.Uvarint that also refuses non-minimal encodings (n = 0), so every value
// has exactly one encoding.
func uvarint(b []byte) (uint64, int) {
	v, n := binary.Uvarint(b)
	if n > 0 && n != len(binary.AppendUvarint(nil, v)) {
		return 0, 0
	}
	return v, n
}
