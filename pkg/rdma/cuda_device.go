package rdma

import (
	"fmt"
	"unsafe"

	"github.com/kvcentric/kvcentric/pkg/rdma/internal/cuda"
)

// device returns the state of device ord, preparing it on first use: primary context, stream,
// the copy kernel (JIT from PTX) and its completion goroutine.
func (e *CUDAEngine) device(ord int) (*cudaDev, error) {
	e.devMu.Lock()
	defer e.devMu.Unlock()
	if d, ok := e.devs[ord]; ok {
		return d, nil
	}
	if e.shut.Load() {
		return nil, ErrClosed
	}
	ctx, err := e.drv.PrimaryContext(ord)
	if err != nil {
		return nil, fmt.Errorf("%w: device %d: %v", ErrUnavailable, ord, err)
	}
	d := &cudaDev{ord: ord, ctx: ctx, pending: make(chan *cudaGroup, 4096)}
	if d.stream, err = ctx.StreamCreate(); err != nil {
		_ = ctx.Release()
		return nil, fmt.Errorf("rdma/cuda: device %d: %w", ord, err)
	}
	if d.up, err = ctx.StreamCreate(); err != nil {
		_ = ctx.StreamDestroy(d.stream)
		_ = ctx.Release()
		return nil, fmt.Errorf("rdma/cuda: device %d: %w", ord, err)
	}
	if d.mod, err = ctx.ModuleLoadData(cuda.CopyKernelPTX); err == nil {
		d.fn, err = ctx.ModuleFunction(d.mod, cuda.CopyKernelName)
		if err == nil {
			d.warpFn, err = ctx.ModuleFunction(d.mod, cuda.WarpKernelName)
		}
		if err == nil {
			d.sms, err = e.drv.DeviceAttribute(ord, cuda.DeviceAttrMultiprocessorCount)
		}
	}
	if err != nil {
		_ = ctx.StreamDestroy(d.up)
		_ = ctx.StreamDestroy(d.stream)
		_ = ctx.Release()
		return nil, fmt.Errorf("rdma/cuda: device %d: load copy kernel: %w", ord, err)
	}
	e.devs[ord] = d
	e.wg.Add(1)
	go e.completions(d)
	return d, nil
}

// completions finishes groups of d in submission order.
func (e *CUDAEngine) completions(d *cudaDev) {
	defer e.wg.Done()
	for g := range d.pending {
		g.err = d.ctx.EventSynchronize(g.ev)
		_ = d.ctx.EventDestroy(g.ev)
		d.queued.Add(-g.n)
		if g.buf != nil {
			d.putBuf(g.buf)
		}
		close(g.done)
	}
}

func (d *cudaDev) getBuf(n int) (*cudaDescBuf, error) {
	d.poolMu.Lock()
	defer d.poolMu.Unlock()
	for i := len(d.free) - 1; i >= 0; i-- {
		// buffers of a smaller group size (options changed) stay in the pool
		if b := d.free[i]; cap(b.descs) >= n {
			d.free = append(d.free[:i], d.free[i+1:]...)
			return b, nil
		}
	}
	size := uint64(n) * cuda.DescSize
	host, err := d.ctx.MemHostAlloc(size)
	if err != nil {
		return nil, err
	}
	dev, err := d.ctx.MemAlloc(size)
	if err != nil {
		_ = d.ctx.MemFreeHost(host)
		return nil, err
	}
	up, err := d.ctx.EventCreate(false)
	if err != nil {
		_ = d.ctx.MemFreeHost(host)
		_ = d.ctx.MemFree(dev)
		return nil, err
	}
	b := &cudaDescBuf{host: host, dev: dev, up: up}
	b.descs = unsafe.Slice((*cudaDesc)(unsafe.Add(unsafe.Pointer(nil), uintptr(host))), n)[:0]
	d.all = append(d.all, b)
	return b, nil
}

func (d *cudaDev) putBuf(b *cudaDescBuf) {
	d.poolMu.Lock()
	b.descs = b.descs[:0]
	d.free = append(d.free, b)
	d.poolMu.Unlock()
}

// ensurePeer enables access from device a to device b's memory.
func (e *CUDAEngine) ensurePeer(a, b int) error {
	if a < 0 || b < 0 || a == b {
		return nil
	}
	e.devMu.Lock()
	err, ok := e.peerOK[[2]int{a, b}]
	e.devMu.Unlock()
	if ok {
		return err
	}
	da, err := e.device(a)
	if err != nil {
		return err
	}
	db, err := e.device(b)
	if err != nil {
		return err
	}
	can, err := e.drv.CanAccessPeer(a, b)
	if err == nil && !can {
		err = fmt.Errorf("%w: device %d cannot access device %d (no peer access)", ErrUnavailable, a, b)
	}
	if err == nil {
		err = da.ctx.EnablePeerAccess(db.ctx)
	}
	e.devMu.Lock()
	e.peerOK[[2]int{a, b}] = err
	e.devMu.Unlock()
	return err
}

// importHandle opens (once per engine) the allocation behind an IPC handle in the context of
// the engine's device, with peer access enabled lazily when the memory lives on another GPU.
func (e *CUDAEngine) importHandle(m *CUDAMemory) (uint64, error) {
	if len(m.IPCHandle) != cuda.IPCHandleSize {
		return 0, fmt.Errorf("%w: IPC handle of %d bytes", ErrInvalidRequest, len(m.IPCHandle))
	}
	key := fmt.Sprintf("%d/%x", m.Device, m.IPCHandle)
	e.impMu.Lock()
	defer e.impMu.Unlock()
	if im, ok := e.imports[key]; ok {
		return im.ptr, nil
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return 0, err
	}
	var h cuda.IPCHandle
	copy(h[:], m.IPCHandle)
	p, err := d.ctx.IPCOpen(h)
	if err != nil {
		return 0, fmt.Errorf("rdma/cuda: import IPC handle on device %d: %w", m.Device, err)
	}
	e.imports[key] = cudaImport{ctx: d.ctx, ptr: p}
	return p, nil
}

// AllocDevice allocates n bytes of device memory on the engine's device, for a store or pool
// that this process owns; register it as a MemCUDA region without a handle. Close frees it.
func (e *CUDAEngine) AllocDevice(n uint64) (uint64, error) {
	return e.alloc(n, false)
}

// AllocPinned allocates n bytes of pinned, device-mapped host memory (a host-side snapshot
// store the copy kernel can reach); register it as a MemHost region. The slice views it and
// must not be used after FreeMemory or Close.
func (e *CUDAEngine) AllocPinned(n uint64) (uint64, []byte, error) {
	p, err := e.alloc(n, true)
	if err != nil {
		return 0, nil, err
	}
	return p, cuda.HostBytes(p, n), nil
}

func (e *CUDAEngine) alloc(n uint64, host bool) (uint64, error) {
	if n == 0 {
		return 0, fmt.Errorf("%w: zero-byte allocation", ErrInvalidRequest)
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return 0, err
	}
	var p uint64
	if host {
		p, err = d.ctx.MemHostAlloc(n)
	} else {
		p, err = d.ctx.MemAlloc(n)
	}
	if err != nil {
		return 0, fmt.Errorf("rdma/cuda: allocate %d bytes: %w", n, err)
	}
	e.allocMu.Lock()
	e.allocs[p] = host
	e.allocMu.Unlock()
	return p, nil
}

// FreeMemory frees memory from AllocDevice or AllocPinned. Unregister it first.
func (e *CUDAEngine) FreeMemory(p uint64) error {
	e.allocMu.Lock()
	host, ok := e.allocs[p]
	delete(e.allocs, p)
	e.allocMu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %#x was not allocated by this engine", ErrInvalidRequest, p)
	}
	d, err := e.device(e.defDev)
	if err != nil {
		return err
	}
	if host {
		return d.ctx.MemFreeHost(p)
	}
	return d.ctx.MemFree(p)
}
