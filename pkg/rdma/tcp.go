package rdma

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

func init() { register("tcp", newTCP) }

const (
	tcpDefaultConns      = 4
	tcpMaxConns          = 64
	tcpDefaultSliceBytes = 256 << 10
	tcpMaxInflight       = 4096 // unacknowledged slices per connection
	tcpHandshakeTimeout  = 10 * time.Second
	tcpReadBufSize       = 256 << 10
	// tcpServeBufSize is the owner's read buffer: a WRITE_BATCH header and its descriptors fit,
	// and little payload is read into it (and then copied) before readv lands the rest in place.
	tcpServeBufSize = 32 << 10
	tcpWriteBufSize = 256 << 10
)

type tcpEngine struct {
	conns      int
	sliceBytes uint64
	tcpShape   tcpShape
	ln         net.Listener
	name       string
	regions    regionTable
	batches    batchTable

	mu       sync.Mutex
	closed   bool
	segs     map[SegmentID]*tcpSegment
	nextSeg  SegmentID
	accepted map[net.Conn]struct{}
	wg       sync.WaitGroup

	// serverHook, when set (tests), runs before the owner handles each WRITE or READ frame.
	serverHook func(typ uint8)
	// guard, when set, is asked about every incoming WRITE range (Config.WriteGuard).
	guard atomic.Pointer[WriteGuard]
}

func newTCP(_ context.Context, cfg Config) (Engine, error) {
	e := &tcpEngine{
		conns:      cfg.Conns,
		sliceBytes: cfg.SliceBytes,
		tcpShape:   tcpShapeOf(cfg.Layout),
		segs:       map[SegmentID]*tcpSegment{},
		accepted:   map[net.Conn]struct{}{},
	}
	e.SetWriteGuard(cfg.WriteGuard)
	if e.conns == 0 {
		e.conns = tcpDefaultConns
	}
	if e.conns < 0 || e.conns > tcpMaxConns {
		return nil, fmt.Errorf("%w: tcp: %d connections per peer (1..%d)", ErrInvalidRequest, cfg.Conns, tcpMaxConns)
	}
	if e.sliceBytes == 0 {
		e.sliceBytes = tcpDefaultSliceBytes
	}
	if e.sliceBytes > tcpMaxSlice {
		return nil, fmt.Errorf("%w: tcp: slice of %d bytes (at most %d)", ErrInvalidRequest, cfg.SliceBytes, tcpMaxSlice)
	}
	if l := cfg.Layout; l != nil {
		// Only the shape is exchanged; buffer addresses may not be known yet.
		if l.PageSize <= 0 || l.ItemLen == 0 || l.ItemLen%uint64(l.PageSize) != 0 || l.NumLayers <= 0 {
			return nil, fmt.Errorf("%w: tcp: layout shape: page size %d, item length %d, layers %d", ErrInvalidRequest, l.PageSize, l.ItemLen, l.NumLayers)
		}
	}
	addr := cfg.ListenAddr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%w: tcp: listen on %s: %v", ErrUnavailable, addr, err)
	}
	e.ln = ln
	e.name = ln.Addr().String()
	if cfg.AdvertiseAddr != "" {
		e.name = cfg.AdvertiseAddr
	}
	e.wg.Add(1)
	go e.acceptLoop()
	return e, nil
}

func (e *tcpEngine) Backend() string     { return "tcp" }
func (e *tcpEngine) SegmentName() string { return e.name }

func (e *tcpEngine) RegisterMemory(r Region) error {
	if r.Kind == MemCUDA {
		return fmt.Errorf("%w: the tcp backend cannot access CUDA device memory", ErrInvalidRequest)
	}
	if e.isClosed() {
		return ErrClosed
	}
	return e.regions.add(r)
}

func (e *tcpEngine) UnregisterMemory(addr uint64) error { return e.regions.remove(addr) }

// SetWriteGuard installs g (nil removes the guard); frames read from then on are checked by it.
func (e *tcpEngine) SetWriteGuard(g WriteGuard) {
	if g == nil {
		e.guard.Store(nil)
		return
	}
	e.guard.Store(&g)
}

// checkGuard asks the installed write guard, if any, about one incoming write.
func (e *tcpEngine) checkGuard(peer string, addr, n uint64) error {
	if g := e.guard.Load(); g != nil {
		return (*g)(peer, addr, n)
	}
	return nil
}

// guardRefusal is the owner's message for a write its guard refused.
func guardRefusal(addr, n uint64, err error) string {
	return fmt.Sprintf("write [%#x, +%d) refused by the owner's write guard: %v", addr, n, err)
}

func (e *tcpEngine) isClosed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

func (e *tcpEngine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	segs := e.segs
	e.segs = map[SegmentID]*tcpSegment{}
	accepted := make([]net.Conn, 0, len(e.accepted))
	for c := range e.accepted {
		accepted = append(accepted, c)
	}
	e.mu.Unlock()
	err := e.ln.Close()
	for _, s := range segs {
		for _, c := range s.conns {
			c.kill(ErrClosed)
		}
	}
	for _, c := range accepted {
		c.Close()
	}
	e.batches.failAll(ErrClosed)
	e.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
