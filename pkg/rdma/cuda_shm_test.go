package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// newShmFile creates a shared-memory file of n bytes: a memfd reached by its /proc path (what
// the prefill store uses) or a file under dir.
func newShmFile(t *testing.T, memfd bool, n int64) (string, *os.File) {
	t.Helper()
	var f *os.File
	if memfd {
		fd, err := unix.MemfdCreate("kvc-test", unix.MFD_CLOEXEC)
		if err != nil {
			t.Skipf("memfd: %v", err)
		}
		f = os.NewFile(uintptr(fd), "kvc-test")
	} else {
		var err error
		if f, err = os.OpenFile(filepath.Join(t.TempDir(), "store"), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _ = f.Close() })
	if err := f.Truncate(n); err != nil {
		t.Fatal(err)
	}
	if memfd {
		return filepathProcFD(f), f
	}
	return f.Name(), f
}

func filepathProcFD(f *os.File) string { return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), f.Fd()) }

// TestCUDAShmOpenMap covers the opener's side of a shared-memory region without a GPU: path
// and size checks, the key that names the file, and that the mapping shows the owner's bytes
// (and the owner sees what is written through it).
func TestCUDAShmOpenMap(t *testing.T) {
	const n = 3 << 16
	for _, memfd := range []bool{true, false} {
		path, owner := newShmFile(t, memfd, n)
		own, err := unix.Mmap(int(owner.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		copy(own[n-16:], "owner wrote this")
		f, key, err := cudaOpenShm(path, n)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		mem, err := cudaMapShm(f, n)
		_ = f.Close()
		if err != nil {
			t.Fatal(err)
		}
		if got := string(mem[n-16:]); got != "owner wrote this" {
			t.Fatalf("%s: opener reads %q", path, got)
		}
		copy(mem[:6], "opener")
		if string(own[:6]) != "opener" {
			t.Fatalf("%s: owner reads %q", path, own[:6])
		}
		// The same file by the same path and length is the same key; a shorter region of it is
		// another mapping; another file is another key.
		f2, key2, err := cudaOpenShm(path, n)
		if err != nil || key2 != key {
			t.Fatalf("reopen: %q vs %q, %v", key2, key, err)
		}
		_ = f2.Close()
		if f3, key3, err := cudaOpenShm(path, n/3); err != nil || key3 == key {
			t.Fatalf("shorter: %q %v", key3, err)
		} else {
			_ = f3.Close()
		}
		other, _ := newShmFile(t, memfd, n)
		if f4, key4, err := cudaOpenShm(other, n); err != nil || key4 == key {
			t.Fatalf("other file: %q %v", key4, err)
		} else {
			_ = f4.Close()
		}
		_ = unix.Munmap(mem)
		_ = unix.Munmap(own)
	}
	path, _ := newShmFile(t, false, 4096)
	for _, tt := range []struct {
		path string
		n    uint64
	}{
		{"", 1}, {"relative/path", 1}, {"/dev/shm/\x00x", 1},
		{path, 4097},            // larger than the file
		{filepath.Dir(path), 1}, // not a regular file
		{path + ".missing", 1},  // gone
		{path, 1 << 47},         // absurd
	} {
		if f, _, err := cudaOpenShm(tt.path, tt.n); err == nil {
			_ = f.Close()
			t.Fatalf("cudaOpenShm(%q, %d) accepted", tt.path, tt.n)
		}
	}
	if err := cudaShmPath("cpu"); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("location cpu: %v", err)
	}
}

// TestCUDAShmCrossProcess pushes from a device buffer of one engine into another engine's
// shared-memory region the way a decode sidecar pushes into a prefill sidecar's host store:
// the opener treats the owner as another process (testForeign), so it maps the file by its
// path and page-locks its own mapping. It also checks that the opener refuses copies outside
// the advertised region and reports the pinned (non-shared) host region unreachable.
func TestCUDAShmCrossProcess(t *testing.T) {
	cudaTestDriver(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	owner, err := NewCUDA(ctx, Config{Backend: "cuda"}, CUDAOptions{})
	if err != nil {
		t.Skipf("no cuda engine: %v", err)
	}
	defer owner.Close()
	opener, err := NewCUDA(ctx, Config{Backend: "cuda"}, CUDAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer opener.Close()
	opener.testForeign = true

	const size = 4 << 20
	path, f := newShmFile(t, true, size)
	own, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(own)
	base := uint64(uintptr(unsafe.Pointer(&own[0])))
	if err := owner.RegisterMemory(Region{Addr: base, Len: size, Kind: MemShared, Location: "shm"}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("location without a path: %v", err)
	}
	if err := owner.RegisterMemory(Region{Addr: base, Len: size, Kind: MemShared, Location: path}); err != nil {
		t.Fatal(err)
	}
	pinned, _, err := owner.AllocPinned(1 << 16)
	if err != nil {
		t.Fatal(err)
	}
	if err := owner.RegisterMemory(Region{Addr: pinned, Len: 1 << 16, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}

	src, err := opener.AllocDevice(size)
	if err != nil {
		t.Fatal(err)
	}
	if err := opener.RegisterMemory(Region{Addr: src, Len: size, Kind: MemCUDA}); err != nil {
		t.Fatal(err)
	}
	d, err := opener.device(opener.defDev)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, size)
	for i := range want {
		want[i] = byte(i*13 + i>>9)
	}
	if err := d.ctx.MemcpyHtoD(src, unsafe.Pointer(&want[0]), size); err != nil {
		t.Fatal(err)
	}
	seg, err := opener.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	regs, err := opener.RemoteRegions(seg)
	if err != nil {
		t.Fatal(err)
	}
	var sawShm bool
	for _, r := range regs {
		if r.Kind == MemShared {
			sawShm = r.Addr == base && r.Len == size && r.Location == path
		}
	}
	if !sawShm {
		t.Fatalf("handshake regions %+v lack the shared region", regs)
	}
	run := func(reqs []Request) []TaskStatus {
		t.Helper()
		b, err := opener.AllocateBatch(len(reqs))
		if err != nil {
			t.Fatal(err)
		}
		defer opener.FreeBatch(b)
		if err := opener.Submit(ctx, b, reqs); err != nil {
			return []TaskStatus{{State: TaskFailed}}
		}
		st, err := opener.Wait(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	// Two halves in swapped order, so that a wrong offset shows.
	h := uint64(size / 2)
	st := run([]Request{
		{Op: OpWrite, Source: src, Target: seg, TargetAddr: base + h, Length: h},
		{Op: OpWrite, Source: src + h, Target: seg, TargetAddr: base, Length: h},
	})
	for i, s := range st {
		if s.State != TaskCompleted {
			t.Fatalf("push %d: %+v", i, s)
		}
	}
	if !bytes.Equal(own[h:], want[:h]) || !bytes.Equal(own[:h], want[h:]) {
		t.Fatal("the owner's mapping does not hold the pushed bytes")
	}
	for _, r := range []Request{
		{Op: OpWrite, Source: src, Target: seg, TargetAddr: base + size - 8, Length: 16}, // past the end
		{Op: OpWrite, Source: src, Target: seg, TargetAddr: pinned, Length: 64},          // pinned, not shared
	} {
		if st := run([]Request{r}); st[0].State == TaskCompleted {
			t.Fatalf("request %+v completed", r)
		}
	}
	if err := owner.UnregisterMemory(base); err != nil {
		t.Fatal(err)
	}
	if err := owner.RegisterMemory(Region{Addr: base, Len: size, Kind: MemShared, Location: path}); err != nil {
		t.Fatalf("register again after unregister: %v", err)
	}
}
