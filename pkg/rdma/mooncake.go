package rdma

import (
	"context"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"
)

func init() { register("mooncake", newMooncake) }

// Environment variables read by the mooncake backend when the matching Config field is empty.
const (
	// MooncakeLibEnv is the path of libtransfer_engine.so.
	MooncakeLibEnv = "KVC_MOONCAKE_LIB"
	// MooncakeProtocolEnv is Mooncake's transport ("rdma" by default, as SGLang; "tcp").
	MooncakeProtocolEnv = "KVC_MOONCAKE_PROTOCOL"
	// MooncakeMetadataEnv is Mooncake's metadata connection string ("P2PHANDSHAKE" by default).
	MooncakeMetadataEnv = "KVC_MOONCAKE_METADATA"
	// MooncakeDevicesEnv is the NIC priority matrix JSON passed to installTransport.
	MooncakeDevicesEnv = "KVC_MOONCAKE_DEVICES"
)

func orEnv(v, env, def string) string {
	if v != "" {
		return v
	}
	if v = os.Getenv(env); v != "" {
		return v
	}
	return def
}

// Constants of transfer_engine_c.h.
const (
	mcOpcodeRead  = 0
	mcOpcodeWrite = 1

	mcStatusWaiting   = 0
	mcStatusPending   = 1
	mcStatusInvalid   = 2
	mcStatusCanceled  = 3
	mcStatusCompleted = 4
	mcStatusTimeout   = 5
	mcStatusFailed    = 6

	mcInvalidBatch = ^uint64(0)
)

// mcRequest is struct transfer_request (40 bytes on LP64):
//
//	int opcode; void *source; segment_id_t target_id; file_id_t file_id;
//	uint64_t target_offset; uint64_t length;
//
// Older headers have no file_id; it then sits in the padding after target_id and is left 0, so
// one layout serves both.
type mcRequest struct {
	opcode       int32
	_            [4]byte
	source       uintptr
	targetID     int32
	fileID       uint32 //nolint:unused // file_id in the C layout: always 0
	targetOffset uint64
	length       uint64
}

// mcStatus is struct transfer_status (16 bytes): int status; uint64_t transferred_bytes.
type mcStatus struct {
	status int32
	_      [4]byte
	bytes  uint64
}

// mcAPI holds the C functions of transfer_engine_c.h.
type mcAPI struct {
	createTransferEngine  func(metadata, localName, host string, rpcPort uint64, autoDiscover int32) uintptr
	destroyTransferEngine func(eng uintptr)
	getLocalIPAndPort     func(eng uintptr, buf *byte, n uint64) int32
	installTransport      func(eng uintptr, proto string, args unsafe.Pointer) uintptr
	openSegment           func(eng uintptr, name string) int32
	closeSegment          func(eng uintptr, id int32) int32
	registerLocalMemory   func(eng uintptr, addr uintptr, n uint64, location string, remote int32) int32
	unregisterLocalMemory func(eng uintptr, addr uintptr) int32
	allocateBatchID       func(eng uintptr, size uint64) uint64
	submitTransfer        func(eng uintptr, batch uint64, reqs *mcRequest, n uint64) int32
	getTransferStatus     func(eng uintptr, batch uint64, task uint64, st *mcStatus) int32
	freeBatchID           func(eng uintptr, batch uint64) int32
}

var (
	mcLibsMu sync.Mutex
	mcLibs   = map[string]*mcAPI{} // a library is loaded once per path
)

// loadMooncake dlopens the library and resolves every function; a missing library or symbol is
// ErrUnavailable with the reason.
func loadMooncake(path string) (*mcAPI, error) {
	mcLibsMu.Lock()
	defer mcLibsMu.Unlock()
	if api, ok := mcLibs[path]; ok {
		return api, nil
	}
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("%w: mooncake: cannot load %s: %v (install Mooncake's libtransfer_engine.so, see docs/transfer-engine.md)", ErrUnavailable, path, err)
	}
	api := &mcAPI{}
	syms := []struct {
		name string
		fn   any
	}{
		{"createTransferEngine", &api.createTransferEngine},
		{"destroyTransferEngine", &api.destroyTransferEngine},
		{"getLocalIpAndPort", &api.getLocalIPAndPort},
		{"installTransport", &api.installTransport},
		{"openSegment", &api.openSegment},
		{"closeSegment", &api.closeSegment},
		{"registerLocalMemory", &api.registerLocalMemory},
		{"unregisterLocalMemory", &api.unregisterLocalMemory},
		{"allocateBatchID", &api.allocateBatchID},
		{"submitTransfer", &api.submitTransfer},
		{"getTransferStatus", &api.getTransferStatus},
		{"freeBatchID", &api.freeBatchID},
	}
	for _, s := range syms {
		sym, err := purego.Dlsym(lib, s.name)
		if err != nil || sym == 0 {
			_ = purego.Dlclose(lib)
			return nil, fmt.Errorf("%w: mooncake: %s does not export %s, so it is not a build of Mooncake's C API (transfer_engine_c.h): %v", ErrUnavailable, path, s.name, err)
		}
		purego.RegisterFunc(s.fn, sym)
	}
	mcLibs[path] = api
	return api, nil
}

type mcBatch struct {
	id       uint64 // Mooncake's batch id
	capacity int
	// tasks maps our task index to Mooncake's (-1: failed here, never submitted).
	tasks    []int
	local    []TaskStatus // status of tasks failed here, and of canceled ones
	canceled bool
}

type mooncakeEngine struct {
	api  *mcAPI
	eng  uintptr
	name string

	mu      sync.Mutex
	closed  bool
	batches map[BatchID]*mcBatch
	next    BatchID
	segs    map[SegmentID]string
}

func newMooncake(_ context.Context, cfg Config) (Engine, error) {
	path := orEnv(cfg.MooncakeLib, MooncakeLibEnv, "")
	if path == "" {
		return nil, fmt.Errorf("%w: mooncake: no library path (set Config.MooncakeLib or %s to libtransfer_engine.so; see docs/transfer-engine.md)", ErrUnavailable, MooncakeLibEnv)
	}
	api, err := loadMooncake(path)
	if err != nil {
		return nil, err
	}
	metadata := orEnv(cfg.MooncakeMetadata, MooncakeMetadataEnv, "P2PHANDSHAKE")
	proto := orEnv(cfg.MooncakeProtocol, MooncakeProtocolEnv, "rdma")
	devices := orEnv(cfg.MooncakeDevices, MooncakeDevicesEnv, "")
	listen := cfg.ListenAddr
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return nil, fmt.Errorf("%w: mooncake: listen address %q: %v", ErrInvalidRequest, listen, err)
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return nil, fmt.Errorf("%w: mooncake: port %q: %v", ErrInvalidRequest, portStr, err)
	}
	eng := api.createTransferEngine(metadata, host, host, port, 0)
	if eng == 0 {
		return nil, fmt.Errorf("%w: mooncake: createTransferEngine(%q, %q) failed (see Mooncake's log)", ErrUnavailable, metadata, listen)
	}
	e := &mooncakeEngine{api: api, eng: eng, batches: map[BatchID]*mcBatch{}, segs: map[SegmentID]string{}}
	// installTransport reads args[0] (an optional NIC priority matrix JSON) and args[1].
	args := new([2]unsafe.Pointer)
	var matrix []byte
	if devices != "" {
		matrix = append([]byte(devices), 0)
		args[0] = unsafe.Pointer(&matrix[0])
	}
	tr := api.installTransport(eng, proto, unsafe.Pointer(args))
	runtime.KeepAlive(matrix)
	runtime.KeepAlive(args)
	if tr == 0 {
		api.destroyTransferEngine(eng)
		return nil, fmt.Errorf("%w: mooncake: installTransport(%q) failed", ErrUnavailable, proto)
	}
	buf := make([]byte, 256)
	if rc := api.getLocalIPAndPort(eng, &buf[0], uint64(len(buf))); rc != 0 {
		api.destroyTransferEngine(eng)
		return nil, fmt.Errorf("%w: mooncake: getLocalIpAndPort failed (%d)", ErrUnavailable, rc)
	}
	for i, c := range buf {
		if c == 0 {
			buf = buf[:i]
			break
		}
	}
	e.name = string(buf)
	if cfg.AdvertiseAddr != "" {
		e.name = cfg.AdvertiseAddr
	}
	return e, nil
}

func (e *mooncakeEngine) Backend() string     { return "mooncake" }
func (e *mooncakeEngine) SegmentName() string { return e.name }

func (e *mooncakeEngine) check() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrClosed
	}
	return nil
}

func (e *mooncakeEngine) RegisterMemory(r Region) error {
	if err := e.check(); err != nil {
		return err
	}
	if r.Len == 0 || r.Addr == 0 || r.Addr+r.Len < r.Addr {
		return fmt.Errorf("%w: region [%#x, +%d)", ErrInvalidRequest, r.Addr, r.Len)
	}
	loc := r.Location
	switch {
	case r.Kind == MemCUDA && r.CUDA != nil:
		loc = fmt.Sprintf("cuda:%d", r.CUDA.Device)
	case r.Kind == MemCUDA && loc == "":
		loc = "*"
	case r.Kind != MemCUDA:
		loc = "cpu:0"
	}
	if rc := e.api.registerLocalMemory(e.eng, uintptr(r.Addr), r.Len, loc, 1); rc != 0 {
		return fmt.Errorf("%w: mooncake: registerLocalMemory failed (%d)", ErrInvalidRequest, rc)
	}
	return nil
}

func (e *mooncakeEngine) UnregisterMemory(addr uint64) error {
	if err := e.check(); err != nil {
		return err
	}
	if rc := e.api.unregisterLocalMemory(e.eng, uintptr(addr)); rc != 0 {
		return fmt.Errorf("%w: mooncake: unregisterLocalMemory(%#x) failed (%d)", ErrInvalidRequest, addr, rc)
	}
	return nil
}

func (e *mooncakeEngine) OpenSegment(_ context.Context, name string) (SegmentID, error) {
	if err := e.check(); err != nil {
		return 0, err
	}
	id := e.api.openSegment(e.eng, name)
	if id < 0 {
		return 0, fmt.Errorf("%w %q (mooncake openSegment: %d)", ErrUnknownSegment, name, id)
	}
	e.mu.Lock()
	e.segs[SegmentID(id)] = name
	e.mu.Unlock()
	return SegmentID(id), nil
}

func (e *mooncakeEngine) CloseSegment(id SegmentID) error {
	if err := e.check(); err != nil {
		return err
	}
	e.mu.Lock()
	_, ok := e.segs[id]
	delete(e.segs, id)
	e.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownSegment, id)
	}
	if rc := e.api.closeSegment(e.eng, int32(id)); rc != 0 {
		return fmt.Errorf("mooncake: closeSegment(%d) failed (%d)", id, rc)
	}
	return nil
}

// RemoteRegions is not available through Mooncake's C API (the segment descriptor stays inside
// the library); the owner still bounds-checks every request.
func (e *mooncakeEngine) RemoteRegions(id SegmentID) ([]Region, error) {
	return nil, fmt.Errorf("%w: mooncake's C API does not expose a peer's regions", ErrUnavailable)
}

func (e *mooncakeEngine) AllocateBatch(capacity int) (BatchID, error) {
	if err := e.check(); err != nil {
		return 0, err
	}
	if capacity <= 0 {
		return 0, fmt.Errorf("%w: batch capacity %d", ErrInvalidRequest, capacity)
	}
	id := e.api.allocateBatchID(e.eng, uint64(capacity))
	if id == mcInvalidBatch {
		return 0, fmt.Errorf("mooncake: allocateBatchID(%d) failed", capacity)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.next++
	e.batches[e.next] = &mcBatch{id: id, capacity: capacity}
	return e.next, nil
}

func (e *mooncakeEngine) batch(id BatchID) (*mcBatch, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrClosed
	}
	b, ok := e.batches[id]
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownBatch, id)
	}
	return b, nil
}

func (e *mooncakeEngine) Submit(_ context.Context, id BatchID, reqs []Request) error {
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(b.tasks)+len(reqs) > b.capacity {
		return fmt.Errorf("%w: %d tasks + %d > capacity %d", ErrBatchFull, len(b.tasks), len(reqs), b.capacity)
	}
	submitted := 0
	for _, t := range b.tasks {
		if t >= 0 {
			submitted++
		}
	}
	var entries []mcRequest
	for _, r := range reqs {
		var ferr error
		switch {
		case r.Op != OpRead && r.Op != OpWrite:
			ferr = fmt.Errorf("%w: opcode %v", ErrInvalidRequest, r.Op)
		case r.Length == 0:
			ferr = fmt.Errorf("%w: zero length", ErrInvalidRequest)
		case r.Source+r.Length < r.Source || r.TargetAddr+r.Length < r.TargetAddr:
			ferr = fmt.Errorf("%w: range wraps", ErrOutOfBounds)
		}
		if _, ok := e.segs[r.Target]; !ok && ferr == nil {
			ferr = fmt.Errorf("%w: %d", ErrUnknownSegment, r.Target)
		}
		if ferr != nil {
			b.tasks = append(b.tasks, -1)
			b.local = append(b.local, TaskStatus{State: TaskFailed, Err: ferr})
			continue
		}
		op := int32(mcOpcodeWrite)
		if r.Op == OpRead {
			op = mcOpcodeRead
		}
		entries = append(entries, mcRequest{opcode: op, source: uintptr(r.Source), targetID: int32(r.Target), targetOffset: r.TargetAddr, length: r.Length})
		b.tasks = append(b.tasks, submitted+len(entries)-1)
		b.local = append(b.local, TaskStatus{})
	}
	if len(entries) == 0 {
		return nil
	}
	rc := e.api.submitTransfer(e.eng, b.id, &entries[0], uint64(len(entries)))
	runtime.KeepAlive(entries)
	if rc != 0 {
		// Nothing of this call was submitted: its valid requests fail as tasks.
		for i := len(b.tasks) - len(reqs); i < len(b.tasks); i++ {
			if b.tasks[i] >= 0 {
				b.tasks[i] = -1
				b.local[i] = TaskStatus{State: TaskFailed, Err: fmt.Errorf("mooncake: submitTransfer failed (%d)", rc)}
			}
		}
	}
	return nil
}

func mcState(s int32) TaskState {
	switch s {
	case mcStatusWaiting:
		return TaskWaiting
	case mcStatusPending:
		return TaskPending
	case mcStatusCompleted:
		return TaskCompleted
	case mcStatusCanceled:
		return TaskCanceled
	case mcStatusTimeout:
		return TaskTimeout
	}
	return TaskFailed // FAILED, INVALID, anything unknown
}

func (e *mooncakeEngine) Status(id BatchID, i int) (TaskStatus, error) {
	b, err := e.batch(id)
	if err != nil {
		return TaskStatus{}, err
	}
	e.mu.Lock()
	if i < 0 || i >= len(b.tasks) {
		e.mu.Unlock()
		return TaskStatus{}, fmt.Errorf("%w: task %d of %d", ErrInvalidRequest, i, len(b.tasks))
	}
	mt, local, canceled := b.tasks[i], b.local[i], b.canceled
	e.mu.Unlock()
	if mt < 0 {
		return local, nil
	}
	var st mcStatus
	if rc := e.api.getTransferStatus(e.eng, b.id, uint64(mt), &st); rc != 0 {
		return TaskStatus{State: TaskFailed, Err: fmt.Errorf("mooncake: getTransferStatus failed (%d)", rc)}, nil
	}
	ts := TaskStatus{State: mcState(st.status), BytesDone: st.bytes}
	if !ts.State.Done() && canceled {
		ts.State, ts.Err = TaskCanceled, context.Canceled
	}
	if ts.State.Done() && ts.State != TaskCompleted && ts.Err == nil {
		ts.Err = fmt.Errorf("rdma: mooncake task %v (status %d)", ts.State, st.status)
	}
	return ts, nil
}

// Wait polls task status (the C API has no completion notification), backing off from 20µs to
// 1ms between rounds. Each round resumes at the first unfinished task and stops at the next one
// still running, so a large batch costs one status call per finished task plus one per round.
func (e *mooncakeEngine) Wait(ctx context.Context, id BatchID) ([]TaskStatus, error) {
	b, err := e.batch(id)
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	n := len(b.tasks)
	e.mu.Unlock()
	out := make([]TaskStatus, n)
	lo := 0
	pause := 20 * time.Microsecond
	for {
		for lo < n {
			st, err := e.Status(id, lo)
			if err != nil {
				return nil, err
			}
			out[lo] = st
			if !st.State.Done() {
				break
			}
			lo++
		}
		if lo == n {
			return out, nil
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			for i := lo + 1; i < n; i++ {
				out[i], _ = e.Status(id, i)
			}
			return out, ctx.Err()
		case <-t.C:
		}
		pause = min(2*pause, time.Millisecond)
	}
}

// Cancel marks the batch's unfinished tasks canceled. Mooncake's C API cannot stop them, so the
// batch cannot be freed until they end.
func (e *mooncakeEngine) Cancel(id BatchID) error {
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	e.mu.Lock()
	b.canceled = true
	e.mu.Unlock()
	return nil
}

func (e *mooncakeEngine) FreeBatch(id BatchID) error {
	b, err := e.batch(id)
	if err != nil {
		return err
	}
	if rc := e.api.freeBatchID(e.eng, b.id); rc != 0 {
		return fmt.Errorf("%w: mooncake freeBatchID refused (%d)", ErrBatchBusy, rc)
	}
	e.mu.Lock()
	delete(e.batches, id)
	e.mu.Unlock()
	return nil
}

func (e *mooncakeEngine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	e.mu.Unlock()
	e.api.destroyTransferEngine(e.eng)
	return nil
}
