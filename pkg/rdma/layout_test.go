package rdma

import (
	"errors"
	"testing"
)

func testLayout(layers int, ps int, tokenBytes uint64, pages int64, base uint64) Layout {
	l := Layout{PageSize: ps, ItemLen: uint64(ps) * tokenBytes, NumLayers: layers, PageCount: pages}
	for b := 0; b < 2*layers; b++ {
		l.BufferAddrs = append(l.BufferAddrs, base+uint64(b)*uint64(pages)*l.ItemLen)
	}
	return l
}

func TestLayoutValidate(t *testing.T) {
	good := testLayout(2, 16, 8, 10, 0x1000)
	tests := []struct {
		name string
		mod  func(*Layout)
		ok   bool
	}{
		{"good", func(*Layout) {}, true},
		{"zero page size", func(l *Layout) { l.PageSize = 0 }, false},
		{"item not multiple of page", func(l *Layout) { l.ItemLen = 17 }, false},
		{"zero item", func(l *Layout) { l.ItemLen = 0 }, false},
		{"no layers", func(l *Layout) { l.NumLayers = 0; l.BufferAddrs = nil }, false},
		{"missing V", func(l *Layout) { l.BufferAddrs = l.BufferAddrs[:3] }, false},
		{"zero pages", func(l *Layout) { l.PageCount = 0 }, false},
		{"wraps", func(l *Layout) { l.BufferAddrs[1] = ^uint64(0) - 10 }, false},
		{"overflow", func(l *Layout) { l.PageCount = 1 << 62 }, false},
		{"null buffer", func(l *Layout) { l.BufferAddrs[0] = 0 }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := good
			l.BufferAddrs = append([]uint64(nil), good.BufferAddrs...)
			tt.mod(&l)
			err := l.Validate()
			if (err == nil) != tt.ok {
				t.Fatalf("Validate() = %v, want ok=%v", err, tt.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalidRequest) {
				t.Fatalf("error %v does not wrap ErrInvalidRequest", err)
			}
		})
	}
}

func TestLayoutProtoRoundTrip(t *testing.T) {
	l := testLayout(3, 16, 32, 7, 0x7000_0000)
	got, err := LayoutFromProto(l.ToProto())
	if err != nil {
		t.Fatal(err)
	}
	if got.PageSize != l.PageSize || got.ItemLen != l.ItemLen || got.NumLayers != l.NumLayers || got.PageCount != l.PageCount || len(got.BufferAddrs) != len(l.BufferAddrs) {
		t.Fatalf("round trip: %+v != %+v", got, l)
	}
	for i := range l.BufferAddrs {
		if got.BufferAddrs[i] != l.BufferAddrs[i] {
			t.Fatalf("buffer %d: %x != %x", i, got.BufferAddrs[i], l.BufferAddrs[i])
		}
	}
	if _, err := LayoutFromProto(nil); err == nil {
		t.Fatal("nil proto accepted")
	}
	p := l.ToProto()
	p.ItemLen = -5
	if _, err := LayoutFromProto(p); err == nil {
		t.Fatal("negative item_len accepted")
	}
	if got := l.BytesPerToken(); got != 6*32 {
		t.Fatalf("BytesPerToken = %d", got)
	}
}

func TestLayoutCompatible(t *testing.T) {
	a := testLayout(2, 16, 8, 10, 0x1000)
	tests := []struct {
		name string
		b    Layout
		ok   bool
	}{
		{"same shape other pool", testLayout(2, 16, 8, 99, 0x9000000), true},
		{"page size", testLayout(2, 32, 4, 10, 0x1000), false},
		{"item len", testLayout(2, 16, 16, 10, 0x1000), false},
		{"layers", testLayout(3, 16, 8, 10, 0x1000), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := a.Compatible(tt.b)
			if (err == nil) != tt.ok || (err != nil && !errors.Is(err, ErrLayoutMismatch)) {
				t.Fatalf("Compatible = %v, want ok=%v", err, tt.ok)
			}
		})
	}
}

func TestPlanPages(t *testing.T) {
	src := testLayout(1, 4, 2, 16, 0x10000) // item 8 bytes, 2 buffers
	dst := testLayout(1, 4, 2, 16, 0x20000)
	tests := []struct {
		name     string
		op       Opcode
		sp, dp   []int64
		want     []Request // for buffer 0 only; buffer 1 mirrors it
		wantErr  error
		unmerged int
	}{
		{"one run", OpWrite, []int64{0, 1, 2}, []int64{5, 6, 7},
			[]Request{{OpWrite, 0x10000, 3, 0x20000 + 5*8, 24}}, nil, 6},
		{"broken on source", OpWrite, []int64{0, 2, 3}, []int64{5, 6, 7},
			[]Request{{OpWrite, 0x10000, 3, 0x20000 + 40, 8}, {OpWrite, 0x10000 + 16, 3, 0x20000 + 48, 16}}, nil, 6},
		{"broken on destination", OpWrite, []int64{0, 1, 2}, []int64{5, 7, 8},
			[]Request{{OpWrite, 0x10000, 3, 0x20000 + 40, 8}, {OpWrite, 0x10000 + 8, 3, 0x20000 + 56, 16}}, nil, 6},
		{"backwards not merged", OpWrite, []int64{3, 2}, []int64{3, 2},
			[]Request{{OpWrite, 0x10000 + 24, 3, 0x20000 + 24, 8}, {OpWrite, 0x10000 + 16, 3, 0x20000 + 16, 8}}, nil, 4},
		{"read puts destination local", OpRead, []int64{4, 5}, []int64{0, 1},
			[]Request{{OpRead, 0x20000, 3, 0x10000 + 32, 16}}, nil, 4},
		{"empty", OpWrite, nil, nil, nil, nil, 0},
		{"length mismatch", OpWrite, []int64{1}, []int64{1, 2}, nil, ErrBadPages, 0},
		{"negative page", OpWrite, []int64{-1}, []int64{1}, nil, ErrBadPages, 0},
		{"page out of range", OpWrite, []int64{1}, []int64{16}, nil, ErrBadPages, 0},
		{"overlapping destination", OpWrite, []int64{1, 2}, []int64{3, 3}, nil, ErrBadPages, 0},
		{"overlapping source", OpWrite, []int64{2, 2}, []int64{3, 4}, nil, ErrBadPages, 0},
		{"bad op", Opcode(9), []int64{1}, []int64{1}, nil, ErrInvalidRequest, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reqs, st, err := PlanPagesStats(tt.op, src, dst, tt.sp, tt.dp, 3)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(reqs) != 2*len(tt.want) || st.Merged != len(reqs) || st.Unmerged != tt.unmerged {
				t.Fatalf("got %d requests (stats %+v), want %d", len(reqs), st, 2*len(tt.want))
			}
			for i, w := range tt.want {
				if reqs[i] != w {
					t.Fatalf("request %d = %+v, want %+v", i, reqs[i], w)
				}
				// Buffer 1 (V) is the same run shifted by each side's buffer stride.
				v := reqs[len(tt.want)+i]
				if v.Length != w.Length || v.Source-w.Source != 16*8 || v.TargetAddr-w.TargetAddr != 16*8 {
					t.Fatalf("V request %d = %+v, K %+v", i, v, w)
				}
			}
		})
	}
}

func TestPlanPagesLayoutMismatch(t *testing.T) {
	src := testLayout(1, 4, 2, 16, 0x10000)
	dst := testLayout(2, 4, 2, 16, 0x20000)
	if _, err := PlanPages(OpWrite, src, dst, []int64{1}, []int64{1}, 1); !errors.Is(err, ErrLayoutMismatch) {
		t.Fatalf("err = %v", err)
	}
}

// TestPlanTokens checks token ranges against a byte-level reference: every byte of [from, to) of
// every buffer is covered exactly once, at the right place on both sides.
func TestPlanTokens(t *testing.T) {
	src := testLayout(2, 4, 3, 20, 0x100000)
	dst := testLayout(2, 4, 3, 20, 0x900000)
	sp := []int64{7, 8, 9, 2, 3, 15, 0}
	dp := []int64{1, 2, 3, 4, 10, 11, 19}
	tests := []struct {
		name     string
		from, to int64
		op       Opcode
		wantReqs int // per buffer
		wantErr  bool
	}{
		{"whole pages", 0, 28, OpWrite, 5, false},
		{"inside one page", 5, 7, OpWrite, 1, false},
		{"unaligned both ends", 3, 22, OpWrite, 4, false},
		{"tail of a run", 10, 12, OpRead, 1, false},
		{"incremental push", 13, 26, OpWrite, 4, false},
		{"beyond pages", 0, 29, OpWrite, 0, true},
		{"empty", 4, 4, OpWrite, 0, true},
		{"negative", -1, 4, OpWrite, 0, true},
	}
	tb := src.TokenBytes()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reqs, err := PlanTokens(tt.op, src, dst, sp, dp, tt.from, tt.to, 1)
			if tt.wantErr {
				if !errors.Is(err, ErrBadPages) {
					t.Fatalf("err = %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(reqs) != tt.wantReqs*src.NumBuffers() {
				t.Fatalf("%d requests, want %d per buffer", len(reqs), tt.wantReqs)
			}
			// Expected map: source byte address -> destination byte address.
			want := map[uint64]uint64{}
			for b := 0; b < src.NumBuffers(); b++ {
				for tok := tt.from; tok < tt.to; tok++ {
					pi, in := tok/4, uint64(tok%4)*tb
					for k := uint64(0); k < tb; k++ {
						s := src.BufferAddrs[b] + uint64(sp[pi])*src.ItemLen + in + k
						want[s] = dst.BufferAddrs[b] + uint64(dp[pi])*dst.ItemLen + in + k
					}
				}
			}
			got := 0
			for _, r := range reqs {
				s, d := r.Source, r.TargetAddr
				if tt.op == OpRead {
					s, d = r.TargetAddr, r.Source
				}
				for k := uint64(0); k < r.Length; k++ {
					w, ok := want[s+k]
					if !ok || w != d+k {
						t.Fatalf("request %+v maps byte %x to %x, want %x (ok=%v)", r, s+k, d+k, w, ok)
					}
					got++
				}
			}
			if got != len(want) {
				t.Fatalf("covered %d bytes, want %d", got, len(want))
			}
		})
	}
}

// FuzzPlanPages: whatever the page lists, a plan either fails with ErrBadPages or stays inside
// both layouts' buffers and never writes a destination byte twice.
func FuzzPlanPages(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3}, []byte{5, 6, 7, 8}, uint8(0), uint8(16))
	f.Add([]byte{3, 3}, []byte{1, 2}, uint8(1), uint8(2))
	f.Add([]byte{}, []byte{}, uint8(0), uint8(0))
	f.Add([]byte{200}, []byte{1}, uint8(0), uint8(1))
	src := testLayout(2, 4, 2, 32, 0x10000)
	dst := testLayout(2, 4, 2, 32, 0x90000)
	f.Fuzz(func(t *testing.T, sp, dp []byte, from, to uint8) {
		sPages, dPages := make([]int64, len(sp)), make([]int64, len(dp))
		for i, b := range sp {
			sPages[i] = int64(int8(b))
		}
		for i, b := range dp {
			dPages[i] = int64(int8(b))
		}
		check := func(reqs []Request, err error) {
			if err != nil {
				if !errors.Is(err, ErrBadPages) {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			written := map[uint64]bool{}
			for _, r := range reqs {
				inSrc, inDst := false, false
				for b := range src.BufferAddrs {
					inSrc = inSrc || (Region{Addr: src.BufferAddrs[b], Len: src.BufferLen()}).Contains(r.Source, r.Length)
					inDst = inDst || (Region{Addr: dst.BufferAddrs[b], Len: dst.BufferLen()}).Contains(r.TargetAddr, r.Length)
				}
				if !inSrc || !inDst {
					t.Fatalf("request %+v leaves the buffers", r)
				}
				for k := uint64(0); k < r.Length; k++ {
					if written[r.TargetAddr+k] {
						t.Fatalf("destination byte %#x written twice", r.TargetAddr+k)
					}
					written[r.TargetAddr+k] = true
				}
			}
		}
		check(PlanPages(OpWrite, src, dst, sPages, dPages, 1))
		check(PlanTokens(OpWrite, src, dst, sPages, dPages, int64(from), int64(to), 1))
	})
}
