package store

import (
	"os"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
)

func TestNewArena(t *testing.T) {
	for _, backend := range []string{"cuda", "tcp"} {
		t.Run(backend, func(t *testing.T) {
			e := newRegEngine(backend)
			p, err := NewArena(e, MemoryHost, kvxfer.Shape{PageSize: 4, ItemLen: 64, PageCount: 8, NumLayers: 2})
			if err != nil {
				t.Fatal(err)
			}
			var path string
			if backend == "cuda" {
				// One shared-memory region over the whole store file, named by its path; another
				// process maps the same bytes by that path.
				if len(e.regs) != 1 {
					t.Fatalf("%d regions registered, want 1", len(e.regs))
				}
				r := e.regs[addrOf(p.Buffer(0))]
				stride := (uint64(64*8) + uint64(os.Getpagesize()) - 1) / uint64(os.Getpagesize()) * uint64(os.Getpagesize())
				if r.Kind != rdma.MemShared || r.Len != 4*stride || !strings.HasPrefix(r.Location, "/proc/") {
					t.Fatalf("region %+v", r)
				}
				for b := 0; b < p.Buffers(); b++ {
					if a := addrOf(p.Buffer(b)); !r.Contains(a, uint64(len(p.Buffer(b)))) {
						t.Fatalf("buffer %d at %#x outside the region", b, a)
					}
				}
				path = r.Location
			} else {
				if len(e.regs) != 4 {
					t.Fatalf("%d regions registered", len(e.regs))
				}
				for _, r := range e.regs {
					if r.Kind != rdma.MemHost || r.Len != 64*8 {
						t.Fatalf("region %+v", r)
					}
				}
			}
			if len(e.pinned) != 0 {
				t.Fatalf("%d pinned allocations", len(e.pinned))
			}
			// The store keeps a CPU view: what is written is read back through TokenSlot.
			pages := []int64{3, 5}
			copy(p.TokenSlot(pages, 5, 1), "0123456789abcdef")
			if got := string(p.Buffer(1)[5*64+16 : 5*64+32]); got != "0123456789abcdef" {
				t.Fatalf("token slot landed elsewhere: %q", got)
			}
			if path != "" {
				// What a peer sees through the path: the same bytes (buffer 1 at one stride).
				m, err := kvpool.Map(path, int64(addrOf(p.Buffer(1))-addrOf(p.Buffer(0))), 64*8)
				if err != nil {
					t.Fatal(err)
				}
				if got := string(m.Bytes()[5*64+16 : 5*64+32]); got != "0123456789abcdef" {
					t.Fatalf("mapped by path: %q", got)
				}
				_ = m.Close()
			}
			p.Close()
			if len(e.regs) != 0 || len(e.pinned) != 0 {
				t.Fatalf("after Close: %d regions, %d pinned allocations", len(e.regs), len(e.pinned))
			}
		})
	}
	if _, err := NewArena(newRegEngine("cuda"), MemoryHost, kvxfer.Shape{PageSize: 0, ItemLen: 64, PageCount: 8, NumLayers: 2}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad geometry: %v", err)
	}
	e := newRegEngine("cuda")
	e.failAt = 1
	if _, err := NewArena(e, MemoryHost, kvxfer.Shape{PageSize: 4, ItemLen: 64, PageCount: 8, NumLayers: 2}); err == nil || len(e.pinned) != 0 || len(e.regs) != 0 {
		t.Fatalf("failed registration: %v, %d pinned, %d regions left", err, len(e.pinned), len(e.regs))
	}
}
