package pagehash

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/cespare/xxhash/v2"
)

var update = flag.Bool("update", false, "rewrite testdata/vectors.json")

func ids(n int, seed uint64) []uint32 {
	r := rand.New(rand.NewPCG(seed, 7))
	out := make([]uint32, n)
	for i := range out {
		out[i] = r.Uint32N(151936)
	}
	return out
}

func mustNew(t testing.TB, p int, key uint64) *Hasher {
	t.Helper()
	h, err := New(p, key)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestDefinition recomputes the chain from the documented definition with the xxhash
// primitives directly.
func TestDefinition(t *testing.T) {
	for _, tc := range []struct {
		p   int
		key uint64
		n   int
	}{{1, 0, 5}, {16, 0, 100}, {16, 0xdeadbeef, 64}, {64, 1, 200}, {3, 0, 0}} {
		h := mustNew(t, tc.p, tc.key)
		var b8 [8]byte
		binary.LittleEndian.PutUint64(b8[:], uint64(tc.p))
		d := xxhash.NewWithSeed(tc.key)
		d.Write(b8[:])
		prev := d.Sum64()
		if h.Root() != prev {
			t.Fatalf("root %x, want %x", h.Root(), prev)
		}
		x := ids(tc.n, uint64(tc.n))
		var want []uint64
		for i := 0; i+tc.p <= len(x); i += tc.p {
			var buf []byte
			for _, id := range x[i : i+tc.p] {
				buf = binary.LittleEndian.AppendUint32(buf, id)
			}
			d := xxhash.NewWithSeed(prev)
			d.Write(buf)
			prev = d.Sum64()
			want = append(want, prev)
		}
		if got := h.Chain(x); !slices.Equal(got, want) {
			t.Fatalf("P=%d: chain differs", tc.p)
		}
		if len(want) > 0 && h.PrefixHash(x, len(want)*tc.p) != want[len(want)-1] {
			t.Fatalf("PrefixHash at a page boundary is not the chain entry")
		}
		if h.PrefixHash(x, 0) != h.Root() {
			t.Fatal("PrefixHash(0) != root")
		}
	}
}

func TestNewErrors(t *testing.T) {
	for _, p := range []int{0, -1, MaxPageSize + 1} {
		if _, err := New(p, 0); !errors.Is(err, ErrPageSize) {
			t.Errorf("New(%d): %v", p, err)
		}
	}
}

// TestChainProperties: incremental = whole, page size and key change every hash, an edit
// changes exactly the pages from the edited one on.
func TestChainProperties(t *testing.T) {
	h := mustNew(t, 16, 0)
	x := ids(1000, 1)
	full := h.Chain(x)
	if len(full) != 1000/16 {
		t.Fatalf("%d pages", len(full))
	}
	inc := h.AppendChain(nil, h.Root(), x[:160])
	inc = h.AppendChain(inc, inc[len(inc)-1], x[160:])
	if !slices.Equal(inc, full) {
		t.Fatal("incremental chain differs")
	}
	if h.Extend(full[9], x[160:170]) != h.PrefixHash(x, 170) {
		t.Fatal("Extend from a page boundary differs from PrefixHash")
	}
	if h2 := mustNew(t, 16, 1).Chain(x); h2[0] == full[0] {
		t.Fatal("key does not change the chain")
	}
	if h3 := mustNew(t, 8, 0).Chain(x); h3[1] == full[0] {
		t.Fatal("page size does not change the chain")
	}
	// Token 999 lies in the partial last page, which Chain leaves out.
	y := slices.Clone(x)
	y[999]++
	if !slices.Equal(h.Chain(y), full) || h.PrefixHash(y, 1000) == h.PrefixHash(x, 1000) {
		t.Fatal("partial last page: Chain must ignore it, PrefixHash must not")
	}
	for _, at := range []int{0, 15, 16, 500, 991} {
		y := slices.Clone(x)
		y[at]++
		other := h.Chain(y)
		want := at / 16
		if got := CommonPages(full, other); got != want {
			t.Errorf("edit at token %d: CommonPages = %d, want %d", at, got, want)
		}
		for i := range full {
			if (i < want) != (full[i] == other[i]) {
				t.Fatalf("edit at %d: page %d equality wrong", at, i)
			}
		}
		if IsPrefix(full, other) {
			t.Errorf("edited chain still has the original as a prefix")
		}
	}
	if !IsPrefix(full[:10], full) || !IsPrefix(nil, full) || IsPrefix(full, full[:10]) {
		t.Fatal("IsPrefix")
	}
	// A partial page's hash differs from the full page's.
	if h.PrefixHash(x, 15) == h.PrefixHash(x, 16) {
		t.Fatal("partial page hash equals the full page hash")
	}
}

type vectorFile struct {
	Definition string       `json:"definition"`
	XXH64      []xxh64Case  `json:"xxh64"`
	Cases      []vectorCase `json:"cases"`
}

type xxh64Case struct {
	DataHex string `json:"data_hex"`
	Seed    string `json:"seed"`
	Hash    string `json:"hash"`
}

type prefixCase struct {
	N    int    `json:"n"`
	Hash string `json:"hash"`
}

type vectorCase struct {
	PageSize    int          `json:"page_size"`
	Key         string       `json:"key"`
	IDs         []uint32     `json:"ids"`
	Root        string       `json:"root"`
	Chain       []string     `json:"chain"`
	Prefix      []prefixCase `json:"prefix"`
	EditedChain []string     `json:"edited_chain"`
	CommonPages int          `json:"common_pages"`
}

func hex64(v uint64) string { return fmt.Sprintf("%016x", v) }

func buildVectors(t *testing.T) vectorFile {
	vf := vectorFile{Definition: "pagehash v1: h_root = XXH64(LE64(page_size), seed=key); h_i = XXH64(LE32 ids of page i, seed=h_{i-1})"}
	for _, c := range []struct {
		data string
		seed uint64
	}{{"", 0}, {"a", 0}, {"abc", 0}, {"0123456789abcdefghijklmnopqrstuvwxyzABCDEF", 0}, {"abc", 0x9e3779b97f4a7c15}, {string(make([]byte, 100)), 1}} {
		d := xxhash.NewWithSeed(c.seed)
		d.Write([]byte(c.data))
		vf.XXH64 = append(vf.XXH64, xxh64Case{DataHex: fmt.Sprintf("%x", c.data), Seed: hex64(c.seed), Hash: hex64(d.Sum64())})
	}
	for k, c := range []struct {
		p   int
		key uint64
		n   int
	}{{1, 0, 7}, {4, 0, 17}, {16, 0, 0}, {16, 0, 15}, {16, 0, 16}, {16, 0, 100}, {16, 0x0123456789abcdef, 257}, {64, 0, 1000}, {256, 42, 600}} {
		h := mustNew(t, c.p, c.key)
		x := ids(c.n, uint64(k)+100)
		vc := vectorCase{PageSize: c.p, Key: hex64(c.key), IDs: x, Root: hex64(h.Root())}
		if vc.IDs == nil {
			vc.IDs = []uint32{}
		}
		chain := h.Chain(x)
		vc.Chain = []string{}
		for _, v := range chain {
			vc.Chain = append(vc.Chain, hex64(v))
		}
		for _, n := range []int{0, 1, c.p - 1, c.p, c.p + 1, c.n / 2, c.n} {
			if n >= 0 && n <= c.n {
				vc.Prefix = append(vc.Prefix, prefixCase{N: n, Hash: hex64(h.PrefixHash(x, n))})
			}
		}
		y := slices.Clone(x)
		if len(y) > 0 {
			y[len(y)*2/3]++
		}
		vc.EditedChain = []string{}
		for _, v := range h.Chain(y) {
			vc.EditedChain = append(vc.EditedChain, hex64(v))
		}
		vc.CommonPages = CommonPages(chain, h.Chain(y))
		vf.Cases = append(vf.Cases, vc)
	}
	return vf
}

// TestVectors: testdata/vectors.json (which the Python implementation also checks) matches.
func TestVectors(t *testing.T) {
	path := filepath.Join("testdata", "vectors.json")
	vf := buildVectors(t)
	got, err := json.MarshalIndent(vf, "", " ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Fatal("testdata/vectors.json differs from the implementation (go test -run TestVectors -update rewrites it)")
	}
}

// TestPythonVectors runs the Python implementation (integrations/sglang/kvcentric_sglang/
// pagehash.py) over the same vectors, in a real python3 process.
func TestPythonVectors(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed: the Python pagehash is not checked")
	}
	repo, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(py, filepath.Join("testdata", "check_vectors.py"), repo).CombinedOutput()
	if err != nil {
		t.Fatalf("check_vectors.py: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}

func TestSparse(t *testing.T) {
	h := mustNew(t, 16, 0)
	x := ids(16*300, 3)
	full := h.Chain(x)
	s, err := NewSparse(DefaultTail, DefaultStride)
	if err != nil {
		t.Fatal(err)
	}
	// Grow as a session does: commits of uneven sizes.
	for i := 0; i < len(full); {
		k := min(len(full)-i, 1+i%37)
		s.Append(full[i : i+k])
		i += k
	}
	if s.Pages() != len(full) {
		t.Fatalf("pages %d", s.Pages())
	}
	wantLen := DefaultTail
	for i := 0; i < len(full)-DefaultTail; i++ {
		if (i+1)%DefaultStride == 0 {
			wantLen++
		}
	}
	if s.Len() != wantLen {
		t.Fatalf("kept %d hashes, want %d", s.Len(), wantLen)
	}
	if !s.IsPrefixOf(full) || !s.IsPrefixOf(h.Chain(append(slices.Clone(x), ids(64, 9)...))) {
		t.Fatal("IsPrefixOf false for the session itself / an extension")
	}
	for _, at := range []int{0, 100, 16*200 + 5, 16 * 290, 16*299 + 15} {
		y := slices.Clone(x)
		y[at]++
		other := h.Chain(y)
		truth := CommonPages(full, other)
		got := s.CommonPages(other)
		if got > truth {
			t.Fatalf("edit at %d: sparse %d > true %d", at, got, truth)
		}
		if truth > len(full)-DefaultTail && got != truth {
			t.Fatalf("edit in the tail at %d: sparse %d, true %d", at, got, truth)
		}
		if truth-got >= DefaultStride {
			t.Fatalf("edit at %d: sparse %d lags true %d by a stride or more", at, got, truth)
		}
		if s.IsPrefixOf(other) {
			t.Fatalf("edit at %d: still a prefix", at)
		}
		// Truncate at the common prefix: the session is then a prefix of the edited prompt.
		c := *s
		c.idx, c.hash = slices.Clone(s.idx), slices.Clone(s.hash)
		c.Truncate(got)
		if !c.IsPrefixOf(other) {
			t.Fatalf("edit at %d: truncated to %d, not a prefix", at, got)
		}
	}
	// A shorter prompt than the session.
	if got := s.CommonPages(full[:50]); got > 50 || got < 50-DefaultStride {
		t.Fatalf("short prompt: %d", got)
	}
	// Round trip.
	b, err := s.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var d Sparse
	if err := d.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if d.Pages() != s.Pages() || !slices.Equal(d.idx, s.idx) || !slices.Equal(d.hash, s.hash) {
		t.Fatal("round trip differs")
	}
	t.Logf("300 pages: %d hashes, %d bytes encoded (full chain %d bytes)", s.Len(), len(b), 8*len(full))
	// The figure the type's comment quotes: a 32K-token session in 16-token pages.
	big, _ := NewSparse(DefaultTail, DefaultStride)
	big.Append(mustNew(t, 16, 0).Chain(ids(32768, 5)))
	bb, _ := big.MarshalBinary()
	if big.Len() != 79 || len(bb) > 800 {
		t.Fatalf("32K tokens: %d hashes, %d bytes", big.Len(), len(bb))
	}
	t.Logf("2048 pages: %d hashes, %d bytes encoded (full chain %d bytes)", big.Len(), len(bb), 8*2048)
	if _, err := NewSparse(0, 1); !errors.Is(err, ErrSparse) {
		t.Fatal("tail 0 accepted")
	}
}

func TestSparseDecodeErrors(t *testing.T) {
	s, _ := NewSparse(2, 4)
	s.Append([]uint64{1, 2, 3, 4, 5, 6, 7, 8, 9})
	good, _ := s.MarshalBinary()
	for name, b := range map[string][]byte{
		"empty":         nil,
		"version":       append([]byte{2}, good[1:]...),
		"truncated":     good[:len(good)-3],
		"trailing":      append(slices.Clone(good), 0),
		"header only":   good[:3],
		"huge count":    {1, 10, 2, 4, 0xff, 0xff, 0x03},
		"zero tail":     {1, 10, 0, 4, 0},
		"index overrun": append([]byte{1, 2, 1, 1, 1, 5}, make([]byte, 8)...),
	} {
		var d Sparse
		if err := d.UnmarshalBinary(b); !errors.Is(err, ErrSparse) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func FuzzSparseUnmarshal(f *testing.F) {
	s, _ := NewSparse(3, 5)
	s.Append(make([]uint64, 40))
	b, _ := s.MarshalBinary()
	f.Add(b)
	f.Add([]byte{1, 0, 1, 1, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		var d Sparse
		if err := d.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrSparse) {
				t.Fatalf("unclassified %v", err)
			}
			return
		}
		// Valid: re-encodes identically and answers queries without panicking.
		again, _ := d.MarshalBinary()
		if string(again) != string(b) {
			t.Fatalf("re-encoding differs")
		}
		_ = d.CommonPages(make([]uint64, 10))
		_ = d.IsPrefixOf(make([]uint64, 10))
		d.Append([]uint64{1, 2})
		d.Truncate(1)
	})
}

// FuzzSparseLCP: for random chains and edits, the sparse answer is a lower bound within a
// stride of the truth, exact in the tail.
func FuzzSparseLCP(f *testing.F) {
	f.Add(uint16(100), uint16(50), uint8(4), uint8(8), uint16(3))
	f.Fuzz(func(t *testing.T, n, at uint16, tail, stride uint8, grow uint16) {
		pages := int(n%600) + 1
		tl, st := int(tail%32)+1, int(stride%64)+1
		chain := make([]uint64, pages)
		for i := range chain {
			chain[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
		}
		other := slices.Clone(chain)
		e := int(at) % pages
		for i := e; i < pages; i++ {
			other[i] ^= 0xabcdef
		}
		s, err := NewSparse(tl, st)
		if err != nil {
			t.Fatal(err)
		}
		step := int(grow%50) + 1
		for i := 0; i < pages; i += step {
			s.Append(chain[i:min(pages, i+step)])
		}
		got := s.CommonPages(other)
		if got > e || e-got >= max(st, 1) && e < pages-tl {
			t.Fatalf("pages %d edit %d tail %d stride %d: got %d", pages, e, tl, st, got)
		}
		if e > pages-tl && got != e {
			t.Fatalf("tail edit %d: got %d", e, got)
		}
	})
}

func BenchmarkChain32K(b *testing.B) {
	for _, p := range []int{16, 64} {
		b.Run("page"+strconv.Itoa(p), func(b *testing.B) {
			h := mustNew(b, p, 0)
			x := ids(32768, 1)
			b.SetBytes(4 * 32768)
			for i := 0; i < b.N; i++ {
				_ = h.Chain(x)
			}
		})
	}
}
