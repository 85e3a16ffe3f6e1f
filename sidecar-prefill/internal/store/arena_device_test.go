package store

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// AllocDevice hands out host memory standing in for device memory (the real allocation is
// exercised on the GPU machine by sidecar-decode/internal/gpubench).
func (e *regEngine) AllocDevice(n uint64) (uint64, error) {
	if e.failAt < 0 && len(e.pinned) >= -e.failAt {
		return 0, errors.New("out of device memory")
	}
	p, _, err := e.AllocPinned(n)
	return p, err
}

func TestNewDeviceArena(t *testing.T) {
	e := newRegEngine("cuda")
	p, err := NewArena(e, MemoryCUDA, kvxfer.Shape{PageSize: 4, ItemLen: 64, PageCount: 8, NumLayers: 2})
	if err != nil {
		t.Fatal(err)
	}
	if p.HostVisible() || len(e.regs) != 4 || len(e.pinned) != 4 {
		t.Fatalf("host visible %v, %d regions, %d allocations", p.HostVisible(), len(e.regs), len(e.pinned))
	}
	l := p.Layout()
	for i, a := range l.GetBufferAddrs() {
		r, ok := e.regs[a]
		if !ok || r.Kind != rdma.MemCUDA || r.Len != 8*64 || r.CUDA != nil {
			t.Fatalf("buffer %d at %#x registered as %+v", i, a, r)
		}
	}
	p.Close()
	if len(e.regs) != 0 || len(e.pinned) != 0 {
		t.Fatalf("after Close: %d regions, %d allocations", len(e.regs), len(e.pinned))
	}

	cases := []struct {
		name string
		eng  *regEngine
		ps   int32
	}{
		{"tcp backend", newRegEngine("tcp"), 4},
		{"bad geometry", newRegEngine("cuda"), 0},
		{"registration fails", &regEngine{backend: "cuda", regs: map[uint64]rdma.Region{}, pinned: map[uint64][]byte{}, failAt: 3}, 4},
		{"allocation fails", &regEngine{backend: "cuda", regs: map[uint64]rdma.Region{}, pinned: map[uint64][]byte{}, failAt: -2}, 4},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if _, err := NewArena(c.eng, MemoryCUDA, kvxfer.Shape{PageSize: c.ps, ItemLen: 64, PageCount: 8, NumLayers: 2}); err == nil {
				t.Fatal("accepted")
			}
			if len(c.eng.regs) != 0 || len(c.eng.pinned) != 0 {
				t.Fatalf("left %d regions, %d allocations", len(c.eng.regs), len(c.eng.pinned))
			}
		})
	}
	if (&kvxfer.Pool{}).HostVisible() != true {
		t.Fatal("an arena of host memory is host visible")
	}
}

// TestReader reads a fragmented snapshot through the engine (tcp here, cuda on the GPU
// machine) and compares it with the CPU view, for bounce buffers smaller than a page, of a few
// pages and larger than the snapshot.
func TestReader(t *testing.T) {
	const ps, tb, pages, layers = 4, 16, 32, 2
	src, err := kvxfer.NewArena(kvxfer.Shape{PageSize: ps, ItemLen: ps * tb, PageCount: pages, NumLayers: layers})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.Close)
	eng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	if err := src.Register(eng, "host"); err != nil {
		t.Fatal(err)
	}
	for b := 0; b < src.Buffers(); b++ {
		for i := range src.Buffer(b) {
			src.Buffer(b)[i] = byte(i*13 + b*7 + i>>8)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pm := []int64{7, 8, 9, 2, 30, 31, 0, 15} // runs and jumps
	m := kvxfer.PageMap{Layout: src.Layout(), Pages: pm}
	for _, c := range []struct {
		name     string
		bounce   int
		from, to int64
	}{
		{"bounce of 3 slots", 3 * tb, 0, 29},
		{"bounce of 2 pages", 2 * ps * tb, 0, 32},
		{"bounce larger than the snapshot", 1 << 12, 5, 31},
		{"empty range", 64, 9, 9},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, err := NewReader(ctx, eng, c.bounce)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			for b := 0; b < src.Buffers(); b++ {
				var got, want bytes.Buffer
				if err := r.Tokens(ctx, m, b, c.from, c.to, &got); err != nil {
					t.Fatal(err)
				}
				for tok := c.from; tok < c.to; tok++ {
					want.Write(src.TokenSlot(pm, tok, b))
				}
				if !bytes.Equal(got.Bytes(), want.Bytes()) {
					t.Fatalf("buffer %d: %d bytes differ from the CPU view (%d)", b, got.Len(), want.Len())
				}
			}
		})
	}
	r, err := NewReader(ctx, eng, 8)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	for _, c := range []struct {
		name     string
		b        int
		from, to int64
	}{
		{"bounce below one slot", 0, 0, 4},
		{"bad buffer", 9, 0, 4},
		{"tokens past the map", 0, 0, 40},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.name != "bounce below one slot" {
				r2, err := NewReader(ctx, eng, 64)
				if err != nil {
					t.Fatal(err)
				}
				defer r2.Close()
				if err := r2.Tokens(ctx, m, c.b, c.from, c.to, &bytes.Buffer{}); err == nil {
					t.Fatal("accepted")
				}
				return
			}
			if err := r.Tokens(ctx, m, c.b, c.from, c.to, &bytes.Buffer{}); err == nil {
				t.Fatal("accepted")
			}
		})
	}
	if _, err := NewReader(ctx, eng, 0); err == nil {
		t.Fatal("zero-byte bounce accepted")
	}
}
