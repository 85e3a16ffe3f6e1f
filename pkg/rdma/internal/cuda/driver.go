package cuda

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// ErrNoDriver means libcuda could not be loaded or initialised, or there is no device: the
// caller should report the cuda backend as unavailable (tests skip).
var ErrNoDriver = errors.New("cuda: driver not available")

// Error is a CUDA driver error: the call that failed and the driver's code, name and message.
type Error struct {
	Call string
	Code int
	Name string
	Msg  string
}

func (e *Error) Error() string {
	return fmt.Sprintf("cuda: %s: %s (%d): %s", e.Call, e.Name, e.Code, e.Msg)
}

// Driver result codes used by callers.
const (
	codeNotReady                  = 600
	codePeerAccessAlreadyEnabled  = 704
	codeNoDevice                  = 100
	memHostAllocPortable          = 0x01
	memHostAllocDeviceMap         = 0x02
	memHostRegisterPortable       = 0x01
	memHostRegisterDeviceMap      = 0x02
	ipcMemLazyEnablePeerAccess    = 0x1
	eventBlockingSync             = 0x1
	eventDisableTiming            = 0x2
	eventInterprocess             = 0x4
	streamNonBlocking             = 0x1
	attrMemoryType                = 2
	attrDevicePointer             = 3
	attrDeviceOrdinal             = 9
	memoryTypeHost                = 1
	memoryTypeDevice              = 2
	deviceAttrUnifiedAddressing   = 41
	deviceAttrMultiprocessorCount = 16
)

// DeviceAttrMultiprocessorCount is CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT.
const DeviceAttrMultiprocessorCount = deviceAttrMultiprocessorCount

// MemoryType values returned by Context.PointerInfo.
const (
	MemoryHost   = memoryTypeHost
	MemoryDevice = memoryTypeDevice
)

// IPCHandleSize is the size of a CUipcMemHandle.
const IPCHandleSize = 64

// IPCHandle is a CUipcMemHandle.
type IPCHandle [IPCHandleSize]byte

// Driver is libcuda loaded with purego. All methods are safe for concurrent use.
type Driver struct {
	lib uintptr
	fn  map[string]uintptr
}

var (
	loadOnce sync.Once
	loaded   *Driver
	loadErr  error
)

// required lists every entry point the binding calls, with the _v2 names first where the
// driver exports them.
var required = [][]string{
	{"cuInit"}, {"cuDriverGetVersion"}, {"cuGetErrorString"}, {"cuGetErrorName"},
	{"cuDeviceGetCount"}, {"cuDeviceGet"}, {"cuDeviceGetName"}, {"cuDeviceGetAttribute"},
	{"cuDeviceCanAccessPeer"},
	{"cuDevicePrimaryCtxRetain"}, {"cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"},
	{"cuCtxSetCurrent"}, {"cuCtxEnablePeerAccess"}, {"cuCtxSynchronize"},
	{"cuMemAlloc_v2", "cuMemAlloc"}, {"cuMemFree_v2", "cuMemFree"},
	{"cuMemHostAlloc"}, {"cuMemFreeHost"}, {"cuMemGetInfo_v2", "cuMemGetInfo"},
	{"cuMemHostRegister_v2", "cuMemHostRegister"}, {"cuMemHostUnregister"},
	{"cuMemGetAddressRange_v2", "cuMemGetAddressRange"}, {"cuPointerGetAttribute"},
	{"cuMemsetD8_v2", "cuMemsetD8"},
	{"cuIpcGetMemHandle"}, {"cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"}, {"cuIpcCloseMemHandle"},
	{"cuMemcpyHtoD_v2", "cuMemcpyHtoD"}, {"cuMemcpyDtoH_v2", "cuMemcpyDtoH"},
	{"cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"}, {"cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync"},
	{"cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"}, {"cuMemcpyPeerAsync"}, {"cuMemcpyAsync"},
	{"cuStreamCreate"}, {"cuStreamDestroy_v2", "cuStreamDestroy"}, {"cuStreamSynchronize"},
	{"cuStreamWaitEvent"},
	{"cuEventCreate"}, {"cuEventDestroy_v2", "cuEventDestroy"}, {"cuEventRecord"},
	{"cuEventQuery"}, {"cuEventSynchronize"}, {"cuEventElapsedTime_v2", "cuEventElapsedTime"},
	{"cuModuleLoadData"}, {"cuModuleUnload"}, {"cuModuleGetFunction"}, {"cuLaunchKernel"},
	{"cuIpcGetEventHandle"}, {"cuIpcOpenEventHandle"},
}

// optional lists entry points that newer drivers export; Load records the first name found.
// cuMemcpyBatchAsync (CUDA 12.8) took a failIdx argument that CUDA 13's _v2 dropped.
var optional = [][]string{
	{"cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"},
}

// Load loads libcuda.so.1 (or $KVC_LIBCUDA) once and calls cuInit. It returns an error wrapping
// ErrNoDriver when the library, an entry point or a device is missing.
func Load() (*Driver, error) {
	loadOnce.Do(func() { loaded, loadErr = load() })
	return loaded, loadErr
}

func load() (*Driver, error) {
	path := os.Getenv("KVC_LIBCUDA")
	if path == "" {
		path = "libcuda.so.1"
	}
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("%w: dlopen %s: %v", ErrNoDriver, path, err)
	}
	d := &Driver{lib: lib, fn: make(map[string]uintptr, len(required))}
	for _, names := range required {
		var addr uintptr
		for _, n := range names {
			if a, err := purego.Dlsym(lib, n); err == nil && a != 0 {
				addr = a
				break
			}
		}
		if addr == 0 {
			return nil, fmt.Errorf("%w: %s lacks %s", ErrNoDriver, path, names[0])
		}
		d.fn[names[0]] = addr
	}
	for _, names := range optional {
		for _, n := range names {
			if a, err := purego.Dlsym(lib, n); err == nil && a != 0 {
				d.fn[n] = a
				break
			}
		}
	}
	if err := d.call("cuInit", 0); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	n, err := d.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: no CUDA device", ErrNoDriver)
	}
	return d, nil
}

// call invokes entry point name and converts a non-zero CUresult into *Error. Arguments may be
// pointers converted to uintptr in the call expression: uintptrescapes moves what they point
// to to the heap and keeps it alive for the call, so a stack copy cannot leave the driver
// writing to a stale address.
//
//go:uintptrescapes
func (d *Driver) call(name string, args ...uintptr) error {
	r, _, _ := purego.SyscallN(d.fn[name], args...)
	if code := int32(r); code != 0 {
		return d.errorOf(name, int(code))
	}
	return nil
}

func (d *Driver) errorOf(call string, code int) *Error {
	e := &Error{Call: call, Code: code, Name: "?", Msg: "?"}
	var p uintptr
	if r, _, _ := purego.SyscallN(d.fn["cuGetErrorName"], uintptr(code), uintptr(unsafe.Pointer(&p))); r == 0 && p != 0 {
		e.Name = goString(p)
	}
	p = 0
	if r, _, _ := purego.SyscallN(d.fn["cuGetErrorString"], uintptr(code), uintptr(unsafe.Pointer(&p))); r == 0 && p != 0 {
		e.Msg = goString(p)
	}
	return e
}

// IsCode reports whether err is a driver error with the given code.
func IsCode(err error, code int) bool {
	var e *Error
	return errors.As(err, &e) && e.Code == code
}

// goString copies a NUL-terminated C string owned by the driver.
func goString(p uintptr) string {
	var b []byte
	for i := uintptr(0); i < 4096; i++ {
		c := *(*byte)(unsafe.Add(unsafe.Pointer(nil), p+i))
		if c == 0 {
			break
		}
		b = append(b, c)
	}
	return string(b)
}

// Version is the driver's CUDA version (e.g. 13000).
func (d *Driver) Version() (int, error) {
	var v int32
	err := d.call("cuDriverGetVersion", uintptr(unsafe.Pointer(&v)))
	return int(v), err
}

// DeviceCount is the number of visible devices.
func (d *Driver) DeviceCount() (int, error) {
	var n int32
	err := d.call("cuDeviceGetCount", uintptr(unsafe.Pointer(&n)))
	return int(n), err
}

func (d *Driver) device(ordinal int) (int32, error) {
	var dev int32
	err := d.call("cuDeviceGet", uintptr(unsafe.Pointer(&dev)), uintptr(ordinal))
	return dev, err
}

// DeviceName is the marketing name of a device.
func (d *Driver) DeviceName(ordinal int) (string, error) {
	dev, err := d.device(ordinal)
	if err != nil {
		return "", err
	}
	buf := make([]byte, 256)
	if err := d.call("cuDeviceGetName", uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), uintptr(dev)); err != nil {
		return "", err
	}
	for i, c := range buf {
		if c == 0 {
			return string(buf[:i]), nil
		}
	}
	return string(buf), nil
}

// DeviceAttribute reads a CUdevice_attribute.
func (d *Driver) DeviceAttribute(ordinal, attr int) (int, error) {
	dev, err := d.device(ordinal)
	if err != nil {
		return 0, err
	}
	var v int32
	err = d.call("cuDeviceGetAttribute", uintptr(unsafe.Pointer(&v)), uintptr(attr), uintptr(dev))
	return int(v), err
}

// CanAccessPeer reports whether device a can access device b's memory directly.
func (d *Driver) CanAccessPeer(a, b int) (bool, error) {
	da, err := d.device(a)
	if err != nil {
		return false, err
	}
	db, err := d.device(b)
	if err != nil {
		return false, err
	}
	var v int32
	err = d.call("cuDeviceCanAccessPeer", uintptr(unsafe.Pointer(&v)), uintptr(da), uintptr(db))
	return v != 0, err
}

// Context is a retained primary context of one device. Methods make it current on a locked OS
// thread for the duration of each call, so they may be called from any goroutine.
type Context struct {
	d   *Driver
	h   uintptr
	Dev int
}

// PrimaryContext retains the primary context of device ordinal.
func (d *Driver) PrimaryContext(ordinal int) (*Context, error) {
	dev, err := d.device(ordinal)
	if err != nil {
		return nil, err
	}
	var h uintptr
	if err := d.call("cuDevicePrimaryCtxRetain", uintptr(unsafe.Pointer(&h)), uintptr(dev)); err != nil {
		return nil, err
	}
	return &Context{d: d, h: h, Dev: ordinal}, nil
}

// Release releases the primary context.
func (c *Context) Release() error {
	dev, err := c.d.device(c.Dev)
	if err != nil {
		return err
	}
	return c.d.call("cuDevicePrimaryCtxRelease_v2", uintptr(dev))
}

// Driver returns the driver the context belongs to.
func (c *Context) Driver() *Driver { return c.d }

// do runs the driver call name with the context current on a locked OS thread (arguments as
// for call).
//
//go:uintptrescapes
func (c *Context) do(name string, args ...uintptr) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := c.d.call("cuCtxSetCurrent", c.h); err != nil {
		return err
	}
	return c.d.call(name, args...)
}

// EnablePeerAccess lets kernels and copies of c access peer's memory; already enabled is not
// an error.
func (c *Context) EnablePeerAccess(peer *Context) error {
	err := c.do("cuCtxEnablePeerAccess", peer.h, 0)
	if IsCode(err, codePeerAccessAlreadyEnabled) {
		return nil
	}
	return err
}

// Synchronize waits for all work of the context.
func (c *Context) Synchronize() error { return c.do("cuCtxSynchronize") }

// MemAlloc allocates n bytes of device memory.
func (c *Context) MemAlloc(n uint64) (uint64, error) {
	var p uint64
	err := c.do("cuMemAlloc_v2", uintptr(unsafe.Pointer(&p)), uintptr(n))
	return p, err
}

// MemFree frees device memory.
func (c *Context) MemFree(p uint64) error { return c.do("cuMemFree_v2", uintptr(p)) }

// MemHostAlloc allocates n bytes of pinned host memory, portable across contexts and mapped
// into the device address space (UVA: the host pointer is also the device pointer).
func (c *Context) MemHostAlloc(n uint64) (uint64, error) {
	var p uintptr
	err := c.do("cuMemHostAlloc", uintptr(unsafe.Pointer(&p)), uintptr(n), memHostAllocPortable|memHostAllocDeviceMap)
	return uint64(p), err
}

// MemHostRegister page-locks n bytes of existing host memory at p (such as a shared-memory
// file mapped by this process), portable across contexts and mapped into the device address
// space, so that copies and kernels reach it as they reach MemHostAlloc memory. p and n should
// be page aligned. Undo with MemHostUnregister before unmapping.
func (c *Context) MemHostRegister(p, n uint64) error {
	return c.do("cuMemHostRegister_v2", uintptr(p), uintptr(n), memHostRegisterPortable|memHostRegisterDeviceMap)
}

// MemHostUnregister undoes MemHostRegister of the memory at p.
func (c *Context) MemHostUnregister(p uint64) error { return c.do("cuMemHostUnregister", uintptr(p)) }

// MemFreeHost frees pinned host memory.
func (c *Context) MemFreeHost(p uint64) error { return c.do("cuMemFreeHost", uintptr(p)) }

// MemGetInfo returns free and total device memory.
func (c *Context) MemGetInfo() (free, total uint64, err error) {
	err = c.do("cuMemGetInfo_v2", uintptr(unsafe.Pointer(&free)), uintptr(unsafe.Pointer(&total)))
	return
}

// AddressRange returns the base and size of the allocation holding device pointer p.
func (c *Context) AddressRange(p uint64) (base, size uint64, err error) {
	err = c.do("cuMemGetAddressRange_v2", uintptr(unsafe.Pointer(&base)), uintptr(unsafe.Pointer(&size)), uintptr(p))
	return
}

// PointerInfo returns the memory type (MemoryHost or MemoryDevice) and, for device memory,
// the device ordinal of the allocation holding p. Unregistered host memory is an error.
func (c *Context) PointerInfo(p uint64) (memType, device int, err error) {
	var mt uint32
	if err = c.do("cuPointerGetAttribute", uintptr(unsafe.Pointer(&mt)), attrMemoryType, uintptr(p)); err != nil {
		return 0, 0, err
	}
	device = -1
	if mt == memoryTypeDevice {
		var ord int32
		if err = c.do("cuPointerGetAttribute", uintptr(unsafe.Pointer(&ord)), attrDeviceOrdinal, uintptr(p)); err != nil {
			return 0, 0, err
		}
		device = int(ord)
	}
	return int(mt), device, nil
}

// HostDevicePointer returns the device address of mapped pinned host memory at p; it fails for
// pageable (unregistered) memory.
func (c *Context) HostDevicePointer(p uint64) (uint64, error) {
	var d uint64
	err := c.do("cuPointerGetAttribute", uintptr(unsafe.Pointer(&d)), attrDevicePointer, uintptr(p))
	return d, err
}

// MemsetD8 sets n bytes at device pointer p to v (synchronous).
func (c *Context) MemsetD8(p uint64, v byte, n uint64) error {
	return c.do("cuMemsetD8_v2", uintptr(p), uintptr(v), uintptr(n))
}

// IPCGetHandle returns the IPC handle of the allocation whose base is p.
func (c *Context) IPCGetHandle(p uint64) (IPCHandle, error) {
	var h IPCHandle
	err := c.do("cuIpcGetMemHandle", uintptr(unsafe.Pointer(&h[0])), uintptr(p))
	return h, err
}

// IPCOpen maps another process's allocation into this process (peer access enabled lazily for
// contexts of other devices) and returns its base address here.
func (c *Context) IPCOpen(h IPCHandle) (uint64, error) {
	var p uint64
	// CUipcMemHandle is a 64-byte struct passed by value: in the SysV AMD64 ABI it goes on the
	// stack (class MEMORY) and uses no register, so Flags takes the second integer register.
	w := (*[8]uint64)(unsafe.Pointer(&h[0]))
	err := c.do("cuIpcOpenMemHandle_v2", uintptr(unsafe.Pointer(&p)), ipcMemLazyEnablePeerAccess, 0, 0, 0, 0,
		uintptr(w[0]), uintptr(w[1]), uintptr(w[2]), uintptr(w[3]), uintptr(w[4]), uintptr(w[5]), uintptr(w[6]), uintptr(w[7]))
	return p, err
}

// IPCClose unmaps memory opened with IPCOpen.
func (c *Context) IPCClose(p uint64) error { return c.do("cuIpcCloseMemHandle", uintptr(p)) }

// MemcpyHtoD copies n bytes from host memory src to device dst (synchronous).
func (c *Context) MemcpyHtoD(dst uint64, src unsafe.Pointer, n uint64) error {
	return c.do("cuMemcpyHtoD_v2", uintptr(dst), uintptr(src), uintptr(n))
}

// MemcpyDtoH copies n bytes from device src to host memory dst (synchronous).
func (c *Context) MemcpyDtoH(dst unsafe.Pointer, src uint64, n uint64) error {
	return c.do("cuMemcpyDtoH_v2", uintptr(dst), uintptr(src), uintptr(n))
}

// MemcpyHtoDAsync copies from pinned host memory src to device dst on s.
func (c *Context) MemcpyHtoDAsync(dst, src, n uint64, s Stream) error {
	return c.do("cuMemcpyHtoDAsync_v2", uintptr(dst), uintptr(src), uintptr(n), uintptr(s))
}

// MemcpyDtoHAsync copies from device src to pinned host memory dst on s.
func (c *Context) MemcpyDtoHAsync(dst, src, n uint64, s Stream) error {
	return c.do("cuMemcpyDtoHAsync_v2", uintptr(dst), uintptr(src), uintptr(n), uintptr(s))
}

// MemcpyDtoDAsync copies n bytes between device (UVA) addresses on s.
func (c *Context) MemcpyDtoDAsync(dst, src, n uint64, s Stream) error {
	return c.do("cuMemcpyDtoDAsync_v2", uintptr(dst), uintptr(src), uintptr(n), uintptr(s))
}

// MemcpyAsync copies n bytes between any two UVA addresses on s.
func (c *Context) MemcpyAsync(dst, src, n uint64, s Stream) error {
	return c.do("cuMemcpyAsync", uintptr(dst), uintptr(src), uintptr(n), uintptr(s))
}

// MemcpyPeerAsync copies n bytes from src in srcCtx to dst in dstCtx on s.
func (c *Context) MemcpyPeerAsync(dst uint64, dstCtx *Context, src uint64, srcCtx *Context, n uint64, s Stream) error {
	return c.do("cuMemcpyPeerAsync", uintptr(dst), dstCtx.h, uintptr(src), srcCtx.h, uintptr(n), uintptr(s))
}

// Stream is a CUstream.
type Stream uintptr

// StreamCreate creates a non-blocking stream.
func (c *Context) StreamCreate() (Stream, error) {
	var s uintptr
	err := c.do("cuStreamCreate", uintptr(unsafe.Pointer(&s)), streamNonBlocking)
	return Stream(s), err
}

// StreamDestroy destroys s.
func (c *Context) StreamDestroy(s Stream) error { return c.do("cuStreamDestroy_v2", uintptr(s)) }

// StreamSynchronize waits for all work on s.
func (c *Context) StreamSynchronize(s Stream) error { return c.do("cuStreamSynchronize", uintptr(s)) }

// StreamWaitEvent makes later work on s wait until the work recorded in e (as of this call)
// has completed, without blocking the host.
func (c *Context) StreamWaitEvent(s Stream, e Event) error {
	return c.do("cuStreamWaitEvent", uintptr(s), uintptr(e), 0)
}

// Event is a CUevent.
type Event uintptr

// EventCreate creates an event; timing events can be used with EventElapsed, the others
// block the waiting thread instead of spinning.
func (c *Context) EventCreate(timing bool) (Event, error) {
	var e uintptr
	flags := uintptr(eventBlockingSync | eventDisableTiming)
	if timing {
		flags = eventBlockingSync
	}
	err := c.do("cuEventCreate", uintptr(unsafe.Pointer(&e)), flags)
	return Event(e), err
}

// EventCreateSpin creates an event whose waiters follow the context's scheduling policy (the
// primary context's default, CU_CTX_SCHED_AUTO, spins when the host has more cores than
// active contexts): cuEventSynchronize returns microseconds after the work, instead of after
// the wake-up of a sleeping thread.
func (c *Context) EventCreateSpin() (Event, error) {
	var e uintptr
	err := c.do("cuEventCreate", uintptr(unsafe.Pointer(&e)), eventDisableTiming)
	return Event(e), err
}

// EventDestroy destroys e.
func (c *Context) EventDestroy(e Event) error { return c.do("cuEventDestroy_v2", uintptr(e)) }

// EventRecord records e on s.
func (c *Context) EventRecord(e Event, s Stream) error {
	return c.do("cuEventRecord", uintptr(e), uintptr(s))
}

// EventQuery reports whether the work before e has completed.
func (c *Context) EventQuery(e Event) (bool, error) {
	err := c.do("cuEventQuery", uintptr(e))
	if IsCode(err, codeNotReady) {
		return false, nil
	}
	return err == nil, err
}

// EventSynchronize blocks until e has completed.
func (c *Context) EventSynchronize(e Event) error { return c.do("cuEventSynchronize", uintptr(e)) }

// EventElapsed returns the milliseconds between two completed timing events.
func (c *Context) EventElapsed(start, end Event) (float32, error) {
	var ms float32
	err := c.do("cuEventElapsedTime_v2", uintptr(unsafe.Pointer(&ms)), uintptr(start), uintptr(end))
	return ms, err
}

// Module is a loaded CUmodule.
type Module uintptr

// Function is a CUfunction.
type Function uintptr

// ModuleLoadData JIT-compiles PTX text (or loads a cubin) into the context.
func (c *Context) ModuleLoadData(image string) (Module, error) {
	b := append([]byte(image), 0)
	var m uintptr
	err := c.do("cuModuleLoadData", uintptr(unsafe.Pointer(&m)), uintptr(unsafe.Pointer(&b[0])))
	runtime.KeepAlive(b)
	return Module(m), err
}

// ModuleUnload unloads m.
func (c *Context) ModuleUnload(m Module) error { return c.do("cuModuleUnload", uintptr(m)) }

// ModuleFunction looks up a kernel of m.
func (c *Context) ModuleFunction(m Module, name string) (Function, error) {
	b := append([]byte(name), 0)
	var f uintptr
	err := c.do("cuModuleGetFunction", uintptr(unsafe.Pointer(&f)), uintptr(m), uintptr(unsafe.Pointer(&b[0])))
	runtime.KeepAlive(b)
	return Function(f), err
}

// LaunchCopy launches the copy kernel f over n descriptors at device address descs, with
// grid CTAs of block threads, on s.
func (c *Context) LaunchCopy(f Function, descs uint64, n uint32, grid, block uint32, s Stream) error {
	// kernelParams is an array of pointers to the argument values; the driver copies the values
	// during the call, so Go memory pinned for the call's duration is enough.
	args := &struct {
		descs uint64
		n     uint32
		_     uint32
		ptrs  [2]uintptr
	}{descs: descs, n: n}
	var pin runtime.Pinner
	pin.Pin(args)
	defer pin.Unpin()
	args.ptrs[0] = uintptr(unsafe.Pointer(&args.descs))
	args.ptrs[1] = uintptr(unsafe.Pointer(&args.n))
	return c.do("cuLaunchKernel", uintptr(f), uintptr(grid), 1, 1, uintptr(block), 1, 1, 0, uintptr(s),
		uintptr(unsafe.Pointer(&args.ptrs[0])), 0)
}

// HostBytes views n bytes of pinned host memory at p (from MemHostAlloc) as a slice. The
// slice must not be used after the memory is freed.
func HostBytes(p, n uint64) []byte {
	if p == 0 || n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(nil), uintptr(p))), int(n))
}

// IPCEventHandleSize is the size of a CUipcEventHandle.
const IPCEventHandleSize = 64

// IPCEventHandle is a CUipcEventHandle.
type IPCEventHandle [IPCEventHandleSize]byte

// EventCreateIPC creates an event another process can open with IPCOpenEvent (interprocess,
// no timing, blocking sync).
func (c *Context) EventCreateIPC() (Event, error) {
	var e uintptr
	err := c.do("cuEventCreate", uintptr(unsafe.Pointer(&e)), eventBlockingSync|eventDisableTiming|eventInterprocess)
	return Event(e), err
}

// IPCEventHandle returns the interprocess handle of e (created by EventCreateIPC).
func (c *Context) IPCEventHandle(e Event) (IPCEventHandle, error) {
	var h IPCEventHandle
	err := c.do("cuIpcGetEventHandle", uintptr(unsafe.Pointer(&h[0])), uintptr(e))
	return h, err
}

// IPCOpenEvent opens another process's interprocess event in this context; the result is
// queried like a local event and released with EventDestroy. Recording it again in the owner
// makes it reflect the new record.
func (c *Context) IPCOpenEvent(h IPCEventHandle) (Event, error) {
	var e uintptr
	// CUipcEventHandle is a 64-byte struct passed by value: class MEMORY in the SysV AMD64 ABI,
	// on the stack after the six integer registers (see IPCOpen).
	w := (*[8]uint64)(unsafe.Pointer(&h[0]))
	err := c.do("cuIpcOpenEventHandle", uintptr(unsafe.Pointer(&e)), 0, 0, 0, 0, 0,
		uintptr(w[0]), uintptr(w[1]), uintptr(w[2]), uintptr(w[3]), uintptr(w[4]), uintptr(w[5]), uintptr(w[6]), uintptr(w[7]))
	return Event(e), err
}

// HasBatchMemcpy reports whether the driver exports cuMemcpyBatchAsync (CUDA 12.8+).
func (d *Driver) HasBatchMemcpy() bool {
	return d.fn["cuMemcpyBatchAsync_v2"] != 0 || d.fn["cuMemcpyBatchAsync"] != 0
}

// memcpyAttributes mirrors CUmemcpyAttributes: srcAccessOrder, srcLocHint {type, id},
// dstLocHint {type, id}, flags (24 bytes).
type memcpyAttributes struct {
	srcAccessOrder uint32
	srcLocType     int32
	srcLocID       int32
	dstLocType     int32
	dstLocID       int32
	flags          uint32
}

// memcpySrcAccessOrderStream: the source is read in stream order.
const memcpySrcAccessOrderStream = 1

// MemcpyBatchAsync enqueues count pointer-to-pointer copies dsts[i] <- srcs[i] of sizes[i]
// bytes on s with cuMemcpyBatchAsync (copies of one call may run in any order; the call as a
// whole is stream ordered). dsts, srcs and sizes are host arrays of count 64-bit values (pinned
// memory of this process, valid until the copies complete).
func (c *Context) MemcpyBatchAsync(dsts, srcs, sizes uint64, count int, s Stream) error {
	attrs := &memcpyAttributes{srcAccessOrder: memcpySrcAccessOrderStream}
	idx := new(uint64)
	var pin runtime.Pinner
	pin.Pin(attrs)
	pin.Pin(idx)
	defer pin.Unpin()
	if c.d.fn["cuMemcpyBatchAsync_v2"] != 0 {
		return c.do("cuMemcpyBatchAsync_v2", uintptr(dsts), uintptr(srcs), uintptr(sizes), uintptr(count),
			uintptr(unsafe.Pointer(attrs)), uintptr(unsafe.Pointer(idx)), 1, uintptr(s))
	}
	if c.d.fn["cuMemcpyBatchAsync"] == 0 {
		return &Error{Call: "cuMemcpyBatchAsync", Code: -1, Name: "NOT_EXPORTED", Msg: "the driver has no cuMemcpyBatchAsync (CUDA 12.8+)"}
	}
	fail := new(uint64)
	pin.Pin(fail)
	return c.do("cuMemcpyBatchAsync", uintptr(dsts), uintptr(srcs), uintptr(sizes), uintptr(count),
		uintptr(unsafe.Pointer(attrs)), uintptr(unsafe.Pointer(idx)), 1, uintptr(unsafe.Pointer(fail)), uintptr(s))
}
