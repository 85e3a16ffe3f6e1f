package rdma

import (
	"context"
	"errors"
	"fmt"
)

// Opcode is the direction of a request, seen from the local side.
type Opcode uint8

const (
	// OpRead copies remote bytes (target) into local memory (source).
	OpRead Opcode = 1
	// OpWrite copies local bytes (source) into remote memory (target).
	OpWrite Opcode = 2
)

func (o Opcode) String() string {
	switch o {
	case OpRead:
		return "READ"
	case OpWrite:
		return "WRITE"
	}
	return fmt.Sprintf("Opcode(%d)", uint8(o))
}

// MemKind says what kind of memory a registered region is.
type MemKind uint8

const (
	// MemHost is ordinary process memory.
	MemHost MemKind = 1
	// MemShared is a shared-memory file mapped from another process (the CPU analog of CUDA IPC).
	MemShared MemKind = 2
	// MemCUDA is CUDA device memory (an address in the CUDA unified address space).
	MemCUDA MemKind = 3
)

// Region is a registered memory region. Addr is an address in the owning process.
type Region struct {
	Addr uint64
	Len  uint64
	Kind MemKind
	// Location names where it lives: "cpu", "cuda:0", a shm path.
	Location string
	// CUDA describes device memory (Kind == MemCUDA): how a peer on the same node imports it.
	CUDA *CUDAMemory
}

// CUDAMemory is what a peer needs to import a device region through CUDA IPC.
type CUDAMemory struct {
	Device int
	// IPCHandle is the cudaIpcMemHandle_t (64 bytes) of the allocation holding the region.
	IPCHandle []byte
	// Offset of Addr from the start of that allocation.
	Offset uint64
}

// Contains reports whether [addr, addr+n) lies inside r.
func (r Region) Contains(addr, n uint64) bool {
	return n > 0 && addr >= r.Addr && addr+n >= addr && addr+n <= r.Addr+r.Len
}

// SegmentID is a handle to an opened peer segment.
type SegmentID int32

// BatchID is a handle to an allocated batch.
type BatchID uint64

// Request is one READ or WRITE: Length bytes between local address Source and address
// TargetAddr in the registered memory of segment Target.
type Request struct {
	Op         Opcode
	Source     uint64
	Target     SegmentID
	TargetAddr uint64
	Length     uint64
}

// TaskState is the state of one request of a batch.
type TaskState uint8

const (
	TaskWaiting   TaskState = iota // submitted, not started
	TaskPending                    // in flight
	TaskCompleted                  // all bytes moved
	TaskFailed                     // refused or broken
	TaskTimeout                    // deadline passed
	TaskCanceled                   // canceled by the caller
)

func (s TaskState) String() string {
	return [...]string{"waiting", "pending", "completed", "failed", "timeout", "canceled"}[s]
}

// Done reports whether the state is final.
func (s TaskState) Done() bool { return s >= TaskCompleted }

// TaskStatus is the status of one request.
type TaskStatus struct {
	State     TaskState
	BytesDone uint64
	Err       error
}

// Engine is the transfer engine of one sidecar, in Mooncake's model: register local memory,
// open peer segments by name, allocate batches, submit READ/WRITE requests, poll or wait for
// per-task status, free batches. Implementations are safe for concurrent use.
type Engine interface {
	// Backend names the backend ("tcp", "cuda", "mooncake").
	Backend() string
	// SegmentName is the name peers open this engine by (host:port for tcp).
	SegmentName() string
	// RegisterMemory makes a local region available as source and as target for peers.
	RegisterMemory(r Region) error
	// UnregisterMemory withdraws the region starting at addr; later requests touching it fail.
	UnregisterMemory(addr uint64) error
	// OpenSegment connects to a peer and exchanges registered regions (the handshake).
	OpenSegment(ctx context.Context, name string) (SegmentID, error)
	// CloseSegment releases a peer segment handle.
	CloseSegment(id SegmentID) error
	// RemoteRegions lists a peer's registered regions as of the last handshake.
	RemoteRegions(id SegmentID) ([]Region, error)
	// AllocateBatch reserves a batch able to hold capacity requests.
	AllocateBatch(capacity int) (BatchID, error)
	// Submit adds requests to a batch and starts them; invalid requests fail as tasks.
	Submit(ctx context.Context, b BatchID, reqs []Request) error
	// Status returns the status of task i (submission order) of batch b.
	Status(b BatchID, task int) (TaskStatus, error)
	// Wait blocks until every task of b is final or ctx is done, and returns all statuses.
	Wait(ctx context.Context, b BatchID) ([]TaskStatus, error)
	// Cancel cancels the tasks of b that are not final.
	Cancel(b BatchID) error
	// FreeBatch releases b; it is refused (ErrBatchBusy) while tasks are waiting or pending.
	FreeBatch(b BatchID) error
	// Close stops the engine and fails every unfinished task.
	Close() error
}

// Config selects and configures a backend. Backend is required; there is no default and no
// fallback: asking for a backend that cannot run here is an error (ErrUnavailable).
type Config struct {
	Backend string
	// ListenAddr is where the engine accepts peers (tcp: host:port, port 0 allowed).
	ListenAddr string
	// AdvertiseAddr overrides the segment name peers use (default: the bound ListenAddr).
	AdvertiseAddr string
	// Conns is the number of parallel connections per peer (tcp).
	Conns int
	// SliceBytes splits large requests into slices spread over the connections (tcp).
	SliceBytes uint64
	// CUDADevice is the device the engine's copies run on (cuda).
	CUDADevice int
	// MooncakeLib is the path of libtransfer_engine.so (mooncake; env KVC_MOONCAKE_LIB).
	MooncakeLib string
	// MooncakeMetadata is Mooncake's metadata connection string (e.g. "P2PHANDSHAKE").
	MooncakeMetadata string
	// MooncakeProtocol is Mooncake's transport ("tcp", "rdma").
	MooncakeProtocol string
	// MooncakeDevices is the RDMA device list (mooncake, rdma protocol).
	MooncakeDevices string
	// Layout, when set, is the KV layout this engine serves (tcp): a peer whose layout has a
	// different page size, item length or layer count is refused at the handshake
	// (ErrLayoutMismatch). Only the shape is compared, not addresses (BufferAddrs may be empty).
	Layout *Layout
	// WriteGuard, when set, is asked by the owner of registered memory (tcp) about every range a
	// peer WRITEs, after the range was found inside a registered region and before any byte of it
	// lands; a refused range fails that task only (ErrOutOfBounds naming the guard's reason).
	// One-sided backends (cuda, mooncake), where the peer copies without the owner's help, cannot
	// apply it. See also WriteGuarded.
	WriteGuard WriteGuard
}

// WriteGuard decides whether a peer may WRITE [addr, addr+n) of this engine's registered memory;
// a nil result allows it. peer is the segment name the peer announced at the handshake (tcp: its
// own SegmentName), which the peer chooses itself. It runs once per incoming write on the owner's
// receive path (hundreds of thousands per large push): it must be fast and must not block.
type WriteGuard func(peer string, addr, n uint64) error

// WriteGuarded is implemented by engines that can apply a WriteGuard installed after they were
// built (the tcp backend): SetWriteGuard replaces the guard (nil removes it) for the writes that
// arrive from then on.
type WriteGuarded interface {
	SetWriteGuard(g WriteGuard)
}

// Factory builds an engine for a Config.
type Factory func(ctx context.Context, cfg Config) (Engine, error)

var backends = map[string]Factory{}

// register makes a backend available to New; called from init in each backend's file.
func register(name string, f Factory) { backends[name] = f }

// Backends lists the backend names compiled in.
func Backends() []string {
	out := make([]string, 0, len(backends))
	for n := range backends {
		out = append(out, n)
	}
	return out
}

// New builds the engine named by cfg.Backend.
func New(ctx context.Context, cfg Config) (Engine, error) {
	f, ok := backends[cfg.Backend]
	if !ok {
		return nil, fmt.Errorf("%w %q (compiled in: %v)", ErrUnknownBackend, cfg.Backend, Backends())
	}
	return f(ctx, cfg)
}

// Errors shared by every backend.
var (
	ErrUnknownBackend = errors.New("rdma: unknown backend")
	ErrUnavailable    = errors.New("rdma: backend unavailable on this machine")
	ErrUnknownSegment = errors.New("rdma: unknown segment")
	ErrUnknownBatch   = errors.New("rdma: unknown batch")
	ErrBatchBusy      = errors.New("rdma: batch has unfinished tasks")
	ErrBatchFull      = errors.New("rdma: batch capacity exceeded")
	ErrOutOfBounds    = errors.New("rdma: address range outside registered memory")
	ErrInvalidRequest = errors.New("rdma: invalid request")
	ErrClosed         = errors.New("rdma: engine closed")
	ErrPeerGone       = errors.New("rdma: peer disconnected")
	ErrLayoutMismatch = errors.New("rdma: KV layout mismatch")
)
