package rdma

import (
	"errors"
	"testing"
)

func TestCUDARouteRequest(t *testing.T) {
	local := cudaSpans{
		{addr: 0x1000, len: 0x1000, ptr: 0xa000, dev: 0},    // device 0 memory
		{addr: 0x4000, len: 0x1000, ptr: 0x4000, dev: -1},   // pinned host
		{addr: 0x8000, len: 0x100, err: errors.New("gone")}, // failed import
	}.sorted()
	remote := cudaSpans{
		{addr: 0x100000, len: 0x10000, ptr: 0xd00000, dev: 1},
		{addr: 0x200000, len: 0x100, dev: -1, err: errors.New("host of another process")},
	}.sorted()
	tests := []struct {
		name    string
		req     Request
		want    cudaRoute
		wantErr error
	}{
		{"write dev0->dev1", Request{Op: OpWrite, Source: 0x1010, TargetAddr: 0x100020, Length: 0x40},
			cudaRoute{src: 0xa010, dst: 0xd00020, n: 0x40, dev: 2, srcDev: 0, dstDev: 1}, nil},
		{"read dev1->host", Request{Op: OpRead, Source: 0x4000, TargetAddr: 0x10fff0, Length: 0x10},
			cudaRoute{src: 0xd0fff0, dst: 0x4000, n: 0x10, dev: 2, srcDev: 1, dstDev: -1}, nil},
		{"read dev1->dev0", Request{Op: OpRead, Source: 0x1ff0, TargetAddr: 0x100000, Length: 0x10},
			cudaRoute{src: 0xd00000, dst: 0xaff0, n: 0x10, dev: 2, srcDev: 1, dstDev: 0}, nil},
		{"local past end", Request{Op: OpWrite, Source: 0x1ff0, TargetAddr: 0x100000, Length: 0x11}, cudaRoute{}, ErrOutOfBounds},
		{"remote past end", Request{Op: OpWrite, Source: 0x1000, TargetAddr: 0x10fff0, Length: 0x20}, cudaRoute{}, ErrOutOfBounds},
		{"remote between regions", Request{Op: OpWrite, Source: 0x1000, TargetAddr: 0x1f0000, Length: 0x10}, cudaRoute{}, ErrOutOfBounds},
		{"local wraps", Request{Op: OpWrite, Source: ^uint64(0) - 1, TargetAddr: 0x100000, Length: 0x10}, cudaRoute{}, ErrOutOfBounds},
		{"zero length", Request{Op: OpWrite, Source: 0x1000, TargetAddr: 0x100000}, cudaRoute{}, ErrInvalidRequest},
		{"bad opcode", Request{Op: 9, Source: 0x1000, TargetAddr: 0x100000, Length: 1}, cudaRoute{}, ErrInvalidRequest},
		{"unreachable remote", Request{Op: OpWrite, Source: 0x1000, TargetAddr: 0x200000, Length: 0x10}, cudaRoute{}, ErrInvalidRequest},
		{"unusable local", Request{Op: OpWrite, Source: 0x8000, TargetAddr: 0x100000, Length: 0x10}, cudaRoute{}, ErrInvalidRequest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lh, rh := -1, -1
			got, err := cudaRouteRequest(&tt.req, local, remote, 2, &lh, &rh)
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err %v, want %v", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("got %+v %v, want %+v", got, err, tt.want)
			}
		})
	}
}

func TestCUDASpanLookupHint(t *testing.T) {
	var s cudaSpans
	for i := 0; i < 96; i++ {
		s = append(s, cudaSpan{addr: uint64(0x100000 * (i + 1)), len: 0x80000, ptr: 1})
	}
	h := -1
	for i := 95; i >= 0; i-- {
		a := uint64(0x100000*(i+1)) + 0x7fff0
		if sp := s.lookup(a, 0x10, &h); sp == nil || h != i {
			t.Fatalf("buffer %d: span %v hint %d", i, sp, h)
		}
		if sp := s.lookup(a, 0x11, &h); sp != nil {
			t.Fatalf("buffer %d: accepted a range past the end", i)
		}
	}
	if sp := s.lookup(0x10, 1, &h); sp != nil {
		t.Fatal("accepted an address below every span")
	}
}

// BenchmarkCUDARoute measures the host-side cost per request of resolving and bounds-checking
// (what Submit does before the copies start), for a Qwen3-30B-A3B-shaped layout.
func BenchmarkCUDARoute(b *testing.B) {
	var local, remote cudaSpans
	for i := 0; i < 96; i++ {
		local = append(local, cudaSpan{addr: uint64(0x10000000 * (i + 1)), len: 0x8000000, ptr: 0x1 << 40, dev: 0})
		remote = append(remote, cudaSpan{addr: uint64(0x10000000 * (i + 1)), len: 0x8000000, ptr: 0x2 << 40, dev: 1})
	}
	reqs := make([]Request, 0, 4096)
	for i := 0; i < cap(reqs); i++ {
		buf := uint64(i % 96)
		off := uint64(i/96) * 0x8000
		reqs = append(reqs, Request{Op: OpWrite, Source: 0x10000000*(buf+1) + off, TargetAddr: 0x10000000*(buf+1) + off, Length: 0x4000})
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		lh, rh := -1, -1
		for i := range reqs {
			if _, err := cudaRouteRequest(&reqs[i], local, remote, 0, &lh, &rh); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(reqs)), "ns/request")
}
