package rdma

import (
	"fmt"
	"os"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

// Shared-memory regions with the cuda backend. Another process's pinned host memory
// (cuMemHostAlloc) cannot be opened through CUDA IPC, so a host-side store that peers copy
// into one-sided lives in a shared-memory file instead: the owner maps it, registers it as
// MemShared with the file's path as Location, and page-locks and device-maps its mapping
// (cuMemHostRegister); the handshake advertises path and length; an opener maps the same file
// (offset 0, the advertised length), page-locks and device-maps its own mapping and then copies
// into it with the same kernel as into its own pinned memory. Both sides unregister and unmap
// on Close (the owner also on UnregisterMemory).

// cudaShm is a peer's shared-memory file mapped into this process and registered with the
// driver.
type cudaShm struct {
	ctx *cuda.Context
	mem []byte
	ptr uint64 // device pointer of mem[0]
}

// cudaShmPath checks that a MemShared region's Location names a file an opener can map.
func cudaShmPath(loc string) error {
	if !strings.HasPrefix(loc, "/") || strings.ContainsRune(loc, 0) {
		return fmt.Errorf("%w: shared-memory region location %q is not an absolute file path", ErrInvalidRequest, loc)
	}
	return nil
}

// cudaOpenShm opens path and checks that it is a regular file of at least n bytes. The key
// names the file (device and inode, so a path reused for another file is another key).
func cudaOpenShm(path string, n uint64) (*os.File, string, error) {
	if err := cudaShmPath(path); err != nil {
		return nil, "", err
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, "", fmt.Errorf("open shared memory: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, "", fmt.Errorf("stat shared memory: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.Mode().IsRegular() || !ok:
		err = fmt.Errorf("shared memory %s is not a regular file", path)
	case fi.Size() < 0 || uint64(fi.Size()) < n:
		err = fmt.Errorf("shared memory %s has %d bytes; the region advertises %d", path, fi.Size(), n)
	case n > 1<<46:
		err = fmt.Errorf("shared memory region of %d bytes is too large", n)
	}
	if err != nil {
		_ = f.Close()
		return nil, "", err
	}
	return f, fmt.Sprintf("shm/%d/%d/%d", st.Dev, st.Ino, n), nil
}

// cudaMapShm maps the first n bytes of f shared, read-write.
func cudaMapShm(f *os.File, n uint64) ([]byte, error) {
	mem, err := unix.Mmap(int(f.Fd()), 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap shared memory: %w", err)
	}
	return mem, nil
}

// importShared maps (once per file and length per engine) a peer's shared-memory region and
// registers the mapping with the driver; it returns the device pointer of its first byte.
// Copies are bounds-checked against the advertised region (Len) like every span.
func (e *CUDAEngine) importShared(r cudaWireRegion) (uint64, error) {
	f, key, err := cudaOpenShm(r.Location, r.Len)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	e.impMu.Lock()
	defer e.impMu.Unlock()
	if sh, ok := e.shms[key]; ok {
		return sh.ptr, nil
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return 0, err
	}
	mem, err := cudaMapShm(f, r.Len)
	if err != nil {
		return 0, err
	}
	addr := uint64(uintptr(unsafe.Pointer(&mem[0])))
	if err := d.ctx.MemHostRegister(addr, r.Len); err != nil {
		_ = unix.Munmap(mem)
		return 0, fmt.Errorf("rdma/cuda: page-lock shared memory %s: %w", r.Location, err)
	}
	dp, err := d.ctx.HostDevicePointer(addr)
	if err != nil {
		_ = d.ctx.MemHostUnregister(addr)
		_ = unix.Munmap(mem)
		return 0, fmt.Errorf("rdma/cuda: device pointer of shared memory %s: %w", r.Location, err)
	}
	e.shms[key] = &cudaShm{ctx: d.ctx, mem: mem, ptr: dp}
	return dp, nil
}

// registerShared page-locks and device-maps this process's mapping of a shared-memory file
// (unless it is pinned already) and returns its device pointer.
func (e *CUDAEngine) registerShared(r Region) (uint64, error) {
	if err := cudaShmPath(r.Location); err != nil {
		return 0, err
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return 0, err
	}
	if mt, _, err := d.ctx.PointerInfo(r.Addr); err != nil || mt != cuda.MemoryHost {
		if err := d.ctx.MemHostRegister(r.Addr, r.Len); err != nil {
			return 0, fmt.Errorf("%w: page-lock shared memory at %#x: %v", ErrInvalidRequest, r.Addr, err)
		}
		e.allocMu.Lock()
		e.hostRegs[r.Addr] = true
		e.allocMu.Unlock()
	}
	dp, err := d.ctx.HostDevicePointer(r.Addr)
	if err != nil {
		e.unregisterShared(r.Addr)
		return 0, fmt.Errorf("%w: %#x is not mapped pinned host memory (%v)", ErrInvalidRequest, r.Addr, err)
	}
	return dp, nil
}

// unregisterShared undoes registerShared's page-locking of the memory at addr, if it did any.
func (e *CUDAEngine) unregisterShared(addr uint64) {
	e.allocMu.Lock()
	reg := e.hostRegs[addr]
	delete(e.hostRegs, addr)
	e.allocMu.Unlock()
	if !reg {
		return
	}
	if d, err := e.device(e.defDev); err == nil {
		_ = d.ctx.MemHostUnregister(addr)
	}
}

// releaseShared unregisters and unmaps every imported shared-memory file and undoes the
// page-locking of this process's own shared regions (Close, after the copies drained).
func (e *CUDAEngine) releaseShared(d *cudaDev) {
	e.impMu.Lock()
	for k, sh := range e.shms {
		_ = sh.ctx.MemHostUnregister(uint64(uintptr(unsafe.Pointer(&sh.mem[0]))))
		_ = unix.Munmap(sh.mem)
		delete(e.shms, k)
	}
	e.impMu.Unlock()
	e.allocMu.Lock()
	for a := range e.hostRegs {
		if d != nil {
			_ = d.ctx.MemHostUnregister(a)
		}
		delete(e.hostRegs, a)
	}
	e.allocMu.Unlock()
}
