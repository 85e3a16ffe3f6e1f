package kvpool

import (
	"errors"
	"os"
	"testing"
)

func TestCreateMapShare(t *testing.T) {
	for _, dir := range []string{t.TempDir(), MemfdDir} {
		t.Run(dir, func(t *testing.T) {
			s := Spec{PageSize: 4, ItemLen: 4 * 24, NumLayers: 3, PageCount: 50}
			p, err := Create(dir, s)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			l := p.Layout()
			if err := l.Validate(); err != nil {
				t.Fatal(err)
			}
			if p.NumBuffers() != 6 || uint64(len(p.Buffer(5))) != 50*96 {
				t.Fatalf("%d buffers, last %d bytes", p.NumBuffers(), len(p.Buffer(5)))
			}
			seed := SessionSeed("s")
			pages := []int64{9, 3, 4, 49}
			if err := FillTokens(p, seed, pages, 0, 15); err != nil {
				t.Fatal(err)
			}
			// The "sidecar" maps each buffer separately (non page-aligned offsets included) and
			// sees the worker's bytes; it writes, the worker sees it.
			var bufs [][]byte
			var ms []*Mapping
			for i := 0; i < p.NumBuffers(); i++ {
				m, err := Map(p.Path(), p.Offset(i), int64(len(p.Buffer(i))))
				if err != nil {
					t.Fatal(err)
				}
				ms = append(ms, m)
				bufs = append(bufs, m.Bytes())
			}
			vl := l
			vl.BufferAddrs = nil
			for _, m := range ms {
				vl.BufferAddrs = append(vl.BufferAddrs, m.Addr())
			}
			v, err := NewView(vl, bufs)
			if err != nil {
				t.Fatal(err)
			}
			if n, err := CheckTokens(v, seed, pages, 0, 15); err != nil || n != 0 {
				t.Fatalf("mapped view: %d mismatches, %v", n, err)
			}
			if err := FillTokens(v, seed, pages, 15, 16); err != nil {
				t.Fatal(err)
			}
			if n, err := CheckTokens(p, seed, pages, 0, 16); err != nil || n != 0 {
				t.Fatalf("pool after sidecar write: %d mismatches, %v", n, err)
			}
			bufs[2][uint64(pages[1])*l.ItemLen] ^= 0xff // token 4 of buffer 2
			if n, _ := CheckTokens(p, seed, pages, 0, 16); n != 1 {
				t.Fatalf("corruption: %d mismatches, want 1", n)
			}
			m, err := Map(p.Path(), 7, 100)
			if err != nil {
				t.Fatal(err)
			}
			if m.Bytes()[0] != p.Buffer(0)[7] {
				t.Fatal("unaligned map sees other bytes")
			}
			for _, m := range append(ms, m) {
				if err := m.Close(); err != nil {
					t.Fatal(err)
				}
			}
			path := p.Path()
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if dir != MemfdDir {
				if _, err := os.Stat(path); !os.IsNotExist(err) {
					t.Fatalf("pool file left behind: %v", err)
				}
			}
		})
	}
}

func TestBadInput(t *testing.T) {
	good := Spec{PageSize: 4, ItemLen: 16, NumLayers: 1, PageCount: 4}
	specs := []Spec{
		{PageSize: 0, ItemLen: 16, NumLayers: 1, PageCount: 4},
		{PageSize: 4, ItemLen: 15, NumLayers: 1, PageCount: 4},
		{PageSize: 4, ItemLen: 16, NumLayers: 0, PageCount: 4},
		{PageSize: 4, ItemLen: 16, NumLayers: 1, PageCount: -1},
		{PageSize: 4, ItemLen: 1 << 40, NumLayers: 1, PageCount: 1 << 40},
	}
	for _, s := range specs {
		if _, err := Create(t.TempDir(), s); !errors.Is(err, ErrBadSpec) {
			t.Errorf("Create(%+v) = %v", s, err)
		}
	}
	p, err := Create(t.TempDir(), good)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	calls := []struct {
		name     string
		pages    []int64
		from, to int64
	}{
		{"not covered", []int64{0}, 0, 5},
		{"negative page", []int64{-1}, 0, 1},
		{"page beyond pool", []int64{4}, 0, 1},
		{"backwards", []int64{0}, 3, 1},
	}
	for _, c := range calls {
		if err := FillTokens(p, 1, c.pages, c.from, c.to); !errors.Is(err, ErrBadSpec) {
			t.Errorf("%s: FillTokens = %v", c.name, err)
		}
		if _, err := CheckTokens(p, 1, c.pages, c.from, c.to); !errors.Is(err, ErrBadSpec) {
			t.Errorf("%s: CheckTokens = %v", c.name, err)
		}
	}
	if _, err := Map(p.Path(), 0, 1<<20); !errors.Is(err, ErrBadSpec) {
		t.Errorf("Map beyond file = %v", err)
	}
	if _, err := Map(p.Path(), -1, 1); !errors.Is(err, ErrBadSpec) {
		t.Errorf("Map negative offset = %v", err)
	}
	if _, err := Map("/nonexistent/kvc", 0, 1); err == nil {
		t.Error("Map of a missing file succeeded")
	}
	if _, err := Arena(0); !errors.Is(err, ErrBadSpec) {
		t.Errorf("Arena(0) = %v", err)
	}
	a, err := Arena(12345)
	if err != nil {
		t.Fatal(err)
	}
	if a.Len() != 12345 || a.Addr()%uint64(os.Getpagesize()) != 0 {
		t.Fatalf("arena len %d addr %x", a.Len(), a.Addr())
	}
	a.Bytes()[12344] = 1
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
}
