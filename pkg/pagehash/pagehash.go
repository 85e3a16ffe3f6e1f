package pagehash

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sort"

	"github.com/cespare/xxhash/v2"
)

// Hasher computes chains for one page size and key. The zero value is not usable; a Hasher
// is immutable and safe for concurrent use.
type Hasher struct {
	pageSize int
	key      uint64
	root     uint64
}

// ErrPageSize is returned by New for a page size below 1 or above MaxPageSize.
var ErrPageSize = errors.New("pagehash: page size out of range")

// MaxPageSize bounds the page size (SGLang uses 1–256).
const MaxPageSize = 1 << 16

// New returns a Hasher for pages of pageSize tokens keyed with key.
func New(pageSize int, key uint64) (*Hasher, error) {
	if pageSize < 1 || pageSize > MaxPageSize {
		return nil, fmt.Errorf("%w: %d", ErrPageSize, pageSize)
	}
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(pageSize))
	d := xxhash.NewWithSeed(key)
	_, _ = d.Write(b[:])
	return &Hasher{pageSize: pageSize, key: key, root: d.Sum64()}, nil
}

// PageSize is the page size in tokens.
func (h *Hasher) PageSize() int { return h.pageSize }

// Root is h_root, the "previous hash" of page 0.
func (h *Hasher) Root() uint64 { return h.root }

// Next is one step of the chain: the hash of a page (of up to PageSize ids) after prev.
func (h *Hasher) Next(prev uint64, page []uint32) uint64 {
	var d xxhash.Digest
	return next(&d, make([]byte, 0, 4*len(page)), prev, page)
}

func next(d *xxhash.Digest, buf []byte, prev uint64, page []uint32) uint64 {
	buf = buf[:0]
	for _, id := range page {
		buf = binary.LittleEndian.AppendUint32(buf, id)
	}
	d.ResetWithSeed(prev)
	_, _ = d.Write(buf)
	return d.Sum64()
}

// Chain returns one hash per full page of ids (a partial last page is left out).
func (h *Hasher) Chain(ids []uint32) []uint64 {
	return h.AppendChain(make([]uint64, 0, len(ids)/h.pageSize), h.root, ids)
}

// AppendChain continues a chain whose last hash is prev (Root() for an empty chain) over ids,
// which must start at a page boundary; it appends one hash per full page of ids to dst.
func (h *Hasher) AppendChain(dst []uint64, prev uint64, ids []uint32) []uint64 {
	var d xxhash.Digest
	buf := make([]byte, 0, 4*h.pageSize)
	for len(ids) >= h.pageSize {
		prev = next(&d, buf, prev, ids[:h.pageSize])
		dst = append(dst, prev)
		ids = ids[h.pageSize:]
	}
	return dst
}

// PrefixHash is the hash of exactly the first n ids: the chain over ⌊n/P⌋ full pages, then
// the partial page when P does not divide n. n must not exceed len(ids).
func (h *Hasher) PrefixHash(ids []uint32, n int) uint64 {
	if n < 0 || n > len(ids) {
		panic(fmt.Sprintf("pagehash: PrefixHash n=%d of %d ids", n, len(ids)))
	}
	return h.Extend(h.root, ids[:n])
}

// Extend continues from prev (the hash of a page-aligned prefix) over ids, the last page
// possibly partial, and returns the final hash (prev when ids is empty).
func (h *Hasher) Extend(prev uint64, ids []uint32) uint64 {
	var d xxhash.Digest
	buf := make([]byte, 0, 4*h.pageSize)
	for len(ids) > 0 {
		k := min(h.pageSize, len(ids))
		prev = next(&d, buf, prev, ids[:k])
		ids = ids[k:]
	}
	return prev
}

// CommonPages returns the number of leading pages two chains share. It binary-searches,
// relying on the chaining (a[i] == b[i] implies a[j] == b[j] for all j < i).
func CommonPages(a, b []uint64) int {
	n := min(len(a), len(b))
	return sort.Search(n, func(i int) bool { return a[i] != b[i] })
}

// IsPrefix reports whether the chain prefix (of a resident session, say) is a prefix of chain:
// one comparison, at prefix's last page.
func IsPrefix(prefix, chain []uint64) bool {
	if len(prefix) == 0 {
		return true
	}
	k := len(prefix) - 1
	return k < len(chain) && chain[k] == prefix[k]
}
