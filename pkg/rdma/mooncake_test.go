package rdma

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"
)

// TestMooncakeUnavailable: asking for the mooncake backend without a usable library is a clear
// ErrUnavailable, never a fallback.
func TestMooncakeUnavailable(t *testing.T) {
	t.Setenv(MooncakeLibEnv, "")
	tests := []struct {
		name, lib, want string
	}{
		{"no path", "", MooncakeLibEnv},
		{"missing file", "/nonexistent/libtransfer_engine.so", "cannot load"},
		{"not mooncake", "libc.so.6", "does not export createTransferEngine"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e, err := New(context.Background(), Config{Backend: "mooncake", MooncakeLib: tt.lib})
			if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New = %v, %v; want ErrUnavailable mentioning %q", e, err, tt.want)
			}
		})
	}
}

// TestMooncakeTransfer moves fragmented pages between two Mooncake engines over Mooncake's own
// TCP transport, verifies every byte (WRITE and READ), and compares its throughput with the tcp
// backend on the same requests. It runs under `make test-mooncake` (KVC_MOONCAKE_TEST=1) and needs
// KVC_MOONCAKE_LIB pointing at a libtransfer_engine.so built from Mooncake (docs/transfer-engine.md).
func TestMooncakeTransfer(t *testing.T) {
	if os.Getenv("KVC_MOONCAKE_TEST") == "" {
		t.Skip("set KVC_MOONCAKE_TEST=1 and KVC_MOONCAKE_LIB (make test-mooncake)")
	}
	if os.Getenv(MooncakeLibEnv) == "" {
		t.Fatalf("KVC_MOONCAKE_TEST is set but %s is not: point it at libtransfer_engine.so (see docs/transfer-engine.md; the PyPI wheels do not ship Mooncake's C API)", MooncakeLibEnv)
	}
	const layers, ps, tb, pages = 8, 16, 256, 512
	size := 2 * layers * ps * tb * pages
	srcMem, dstMem, backMem := mmapArena(t, size), mmapArena(t, size), mmapArena(t, size)
	fillPattern(srcMem, 5)
	src, dst, back := poolIn(srcMem, layers, ps, tb, pages), poolIn(dstMem, layers, ps, tb, pages), poolIn(backMem, layers, ps, tb, pages)
	r := rand.New(rand.NewPCG(3, 4))
	srcPages, dstPages := fragmentedPages(r, pages/2, pages), fragmentedPages(r, pages/2, pages)

	run := func(backend string) time.Duration {
		ctx := waitCtx(t)
		a, err := New(ctx, Config{Backend: backend, ListenAddr: "127.0.0.1:0", MooncakeProtocol: "tcp"})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		b, err := New(ctx, Config{Backend: backend, ListenAddr: "127.0.0.1:0", MooncakeProtocol: "tcp"})
		if err != nil {
			t.Fatal(err)
		}
		defer b.Close()
		for _, reg := range append(src.Regions(MemHost, "cpu:0"), back.Regions(MemHost, "cpu:0")...) {
			if err := a.RegisterMemory(reg); err != nil {
				t.Fatal(err)
			}
		}
		for _, reg := range dst.Regions(MemHost, "cpu:0") {
			if err := b.RegisterMemory(reg); err != nil {
				t.Fatal(err)
			}
		}
		seg, err := a.OpenSegment(ctx, b.SegmentName())
		if err != nil {
			t.Fatal(err)
		}
		clear(dstMem)
		clear(backMem)
		w, err := PlanPages(OpWrite, src, dst, srcPages, dstPages, seg)
		if err != nil {
			t.Fatal(err)
		}
		res, err := TransferSync(ctx, a, w, Deadline{Base: 30 * time.Second, PerByte: time.Nanosecond})
		if err != nil {
			t.Fatalf("%s write: %v", backend, err)
		}
		rd, err := PlanPages(OpRead, dst, back, dstPages, srcPages, seg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := TransferSync(ctx, a, rd, Deadline{Base: 30 * time.Second, PerByte: time.Nanosecond}); err != nil {
			t.Fatalf("%s read: %v", backend, err)
		}
		for buf := 0; buf < src.NumBuffers(); buf++ {
			for i := range srcPages {
				s := memAt(src.BufferAddrs[buf]+uint64(srcPages[i])*src.ItemLen, src.ItemLen)
				if !bytes.Equal(s, memAt(dst.BufferAddrs[buf]+uint64(dstPages[i])*dst.ItemLen, dst.ItemLen)) ||
					!bytes.Equal(s, memAt(back.BufferAddrs[buf]+uint64(srcPages[i])*back.ItemLen, back.ItemLen)) {
					t.Fatalf("%s: buffer %d page %d differs", backend, buf, srcPages[i])
				}
			}
		}
		return res.Elapsed
	}
	mc, ours := run("mooncake"), run("tcp")
	bytesMoved := float64(len(srcPages)) * float64(src.ItemLen) * float64(src.NumBuffers())
	t.Logf("mooncake: mooncake tcp transport %.2f GB/s vs kvcentric tcp %.2f GB/s (%d requests, %.0f bytes)",
		bytesMoved/mc.Seconds()/1e9, bytesMoved/ours.Seconds()/1e9, len(srcPages)*src.NumBuffers(), bytesMoved)
}
