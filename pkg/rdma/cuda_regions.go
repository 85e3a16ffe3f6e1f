package rdma

import (
	"fmt"
	"time"

	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

// RegisterMemory implements Engine. Kinds:
//   - MemCUDA with r.CUDA.IPCHandle set: another process's device memory (a worker's KV pool);
//     it is imported here and Addr is the owner's address, used only as the region's name.
//   - MemCUDA without a handle: device memory allocated by this process at Addr; its IPC
//     handle is derived so that peers can import it.
//   - MemHost: pinned host memory of this process (cuMemHostAlloc or registered); usable as a
//     local source or target, not importable by other processes.
//   - MemShared: this process's mapping of a shared-memory file whose absolute path is
//     Location (a /dev/shm file, or a memfd as /proc/<pid>/fd/<n>), mapped from offset 0 over
//     Len bytes; it is page-locked and device-mapped here (cuMemHostRegister) unless pinned
//     already, and peers that open this segment map the file by its path and copy into it
//     one-sided (cuda_shm.go).
func (e *CUDAEngine) RegisterMemory(r Region) error {
	if r.Len == 0 || r.Addr+r.Len < r.Addr {
		return fmt.Errorf("%w: region [%#x,+%d)", ErrInvalidRequest, r.Addr, r.Len)
	}
	sp := cudaSpan{addr: r.Addr, len: r.Len}
	adv := cudaWireRegion{Region: r}
	switch {
	case r.Kind == MemCUDA && r.CUDA != nil && len(r.CUDA.IPCHandle) > 0:
		if r.CUDA.Device < 0 {
			return fmt.Errorf("%w: device %d", ErrInvalidRequest, r.CUDA.Device)
		}
		base, err := e.importHandle(r.CUDA)
		if err != nil {
			return err
		}
		sp.ptr, sp.dev = base+r.CUDA.Offset, r.CUDA.Device
		c := *r.CUDA
		c.IPCHandle = append([]byte(nil), r.CUDA.IPCHandle...)
		adv.CUDA = &c
	case r.Kind == MemCUDA:
		d, err := e.device(e.defDev)
		if err != nil {
			return err
		}
		mt, ord, err := d.ctx.PointerInfo(r.Addr)
		if err != nil || mt != cuda.MemoryDevice {
			return fmt.Errorf("%w: %#x is not device memory of this process (%v)", ErrInvalidRequest, r.Addr, err)
		}
		od, err := e.device(ord)
		if err != nil {
			return err
		}
		base, size, err := od.ctx.AddressRange(r.Addr)
		if err != nil {
			return fmt.Errorf("%w: %v", ErrInvalidRequest, err)
		}
		if r.Addr+r.Len > base+size {
			return fmt.Errorf("%w: region [%#x,+%d) exceeds its allocation", ErrInvalidRequest, r.Addr, r.Len)
		}
		h, err := od.ctx.IPCGetHandle(base)
		if err != nil {
			return fmt.Errorf("rdma/cuda: IPC handle: %w", err)
		}
		sp.ptr, sp.dev = r.Addr, ord
		adv.CUDA = &CUDAMemory{Device: ord, IPCHandle: h[:], Offset: r.Addr - base}
		if adv.Location == "" {
			adv.Location = fmt.Sprintf("cuda:%d", ord)
		}
	case r.Kind == MemHost:
		d, err := e.device(e.defDev)
		if err != nil {
			return err
		}
		mt, _, err := d.ctx.PointerInfo(r.Addr)
		if err != nil || mt != cuda.MemoryHost {
			return fmt.Errorf("%w: %#x is not pinned host memory (%v)", ErrInvalidRequest, r.Addr, err)
		}
		dp, err := d.ctx.HostDevicePointer(r.Addr)
		if err != nil {
			return fmt.Errorf("%w: %#x is not mapped pinned host memory (%v)", ErrInvalidRequest, r.Addr, err)
		}
		sp.ptr, sp.dev = dp, -1
		adv.CUDA = nil
		if adv.Location == "" {
			adv.Location = "cpu"
		}
	case r.Kind == MemShared:
		dp, err := e.registerShared(r)
		if err != nil {
			return err
		}
		sp.ptr, sp.dev = dp, -1
		adv.CUDA = nil
	default:
		return fmt.Errorf("%w: the cuda backend takes MemCUDA, pinned MemHost or MemShared regions, not kind %d", ErrInvalidRequest, r.Kind)
	}
	adv.Ptr = sp.ptr
	if err := e.addRegion(sp, adv); err != nil {
		if r.Kind == MemShared {
			e.unregisterShared(r.Addr)
		}
		return err
	}
	return nil
}

// addRegion records a resolved local region and advertises it to connected peers.
func (e *CUDAEngine) addRegion(sp cudaSpan, adv cudaWireRegion) error {
	r := adv.Region
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	for _, s := range e.local {
		if r.Addr < s.addr+s.len && s.addr < r.Addr+r.Len {
			return fmt.Errorf("%w: region [%#x,+%d) overlaps a registered one", ErrInvalidRequest, r.Addr, r.Len)
		}
	}
	local := append(append(cudaSpans(nil), e.local...), sp).sorted()
	e.local = local
	e.adv = append(e.adv, adv)
	e.broadcastLocked()
	return nil
}

// UnregisterMemory implements Engine. Peers learn it from the next snapshot; the caller must
// make sure no copy into or out of the region is still running.
func (e *CUDAEngine) UnregisterMemory(addr uint64) error {
	if err := e.unregisterLocal(addr); err != nil {
		return err
	}
	e.unregisterShared(addr)
	return nil
}

func (e *CUDAEngine) unregisterLocal(addr uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i, s := range e.local {
		if s.addr == addr {
			local := append(append(cudaSpans(nil), e.local[:i]...), e.local[i+1:]...)
			e.local = local
			for j, a := range e.adv {
				if a.Addr == addr {
					e.adv = append(e.adv[:j:j], e.adv[j+1:]...)
					break
				}
			}
			e.broadcastLocked()
			return nil
		}
	}
	return fmt.Errorf("%w: no region at %#x", ErrInvalidRequest, addr)
}

func (e *CUDAEngine) broadcastLocked() {
	msg := cudaEncodeRegions(e.pid, e.adv)
	for c := range e.conns {
		c.send(msg)
	}
}

func (c *cudaConn) send(msg []byte) {
	c.wm.Lock()
	defer c.wm.Unlock()
	_ = c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if err := cudaWriteFrame(c.c, msg); err != nil {
		_ = c.c.Close()
	}
}
