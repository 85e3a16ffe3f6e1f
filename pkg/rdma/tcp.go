package rdma

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
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

// memAt is the registered memory [addr, addr+n). Only called after a bounds check against a
// registered region whose read lock is held.
func memAt(addr, n uint64) []byte {
	p := *(*unsafe.Pointer)(unsafe.Pointer(&addr))
	return unsafe.Slice((*byte)(p), n)
}

// memRegion is a registered region. Copies hold a reference (use/release) while they touch its
// bytes; UnregisterMemory marks it gone and waits until no reference is left, so no copy ever
// touches a withdrawn region. References nest (a sender holds many while one writev runs).
type memRegion struct {
	Region
	users atomic.Int64
	gone  atomic.Bool
	mu    sync.Mutex
	cond  *sync.Cond
}

func newMemRegion(r Region) *memRegion {
	m := &memRegion{Region: r}
	m.cond = sync.NewCond(&m.mu)
	return m
}

// use takes a reference; it fails once the region is withdrawn.
func (m *memRegion) use() bool {
	m.users.Add(1)
	if m.gone.Load() {
		m.release()
		return false
	}
	return true
}

func (m *memRegion) release() {
	if m.users.Add(-1) == 0 && m.gone.Load() {
		m.mu.Lock()
		m.cond.Broadcast()
		m.mu.Unlock()
	}
}

// withdraw marks the region gone and waits for the copies in flight.
func (m *memRegion) withdraw() {
	m.mu.Lock()
	m.gone.Store(true)
	for m.users.Load() > 0 {
		m.cond.Wait()
	}
	m.mu.Unlock()
}

// regionTable is a sorted set of non-overlapping regions.
type regionTable struct {
	mu   sync.RWMutex
	regs []*memRegion
}

func (t *regionTable) add(r Region) error {
	if r.Len == 0 || r.Addr == 0 || r.Addr+r.Len < r.Addr {
		return fmt.Errorf("%w: region [%#x, +%d)", ErrInvalidRequest, r.Addr, r.Len)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].Addr >= r.Addr })
	if i < len(t.regs) && t.regs[i].Addr < r.Addr+r.Len || i > 0 && t.regs[i-1].Addr+t.regs[i-1].Len > r.Addr {
		return fmt.Errorf("%w: region [%#x, +%d) overlaps a registered region", ErrInvalidRequest, r.Addr, r.Len)
	}
	t.regs = append(t.regs, nil)
	copy(t.regs[i+1:], t.regs[i:])
	t.regs[i] = newMemRegion(r)
	return nil
}

func (t *regionTable) remove(addr uint64) error {
	t.mu.Lock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].Addr >= addr })
	if i == len(t.regs) || t.regs[i].Addr != addr {
		t.mu.Unlock()
		return fmt.Errorf("%w: no region registered at %#x", ErrInvalidRequest, addr)
	}
	r := t.regs[i]
	t.regs = append(t.regs[:i], t.regs[i+1:]...)
	t.mu.Unlock()
	r.withdraw()
	return nil
}

// find returns the region holding [addr, addr+n), or nil.
func (t *regionTable) find(addr, n uint64) *memRegion {
	t.mu.RLock()
	defer t.mu.RUnlock()
	i := sort.Search(len(t.regs), func(i int) bool { return t.regs[i].Addr > addr })
	if i == 0 {
		return nil
	}
	if r := t.regs[i-1]; r.Contains(addr, n) {
		return r
	}
	return nil
}

// acquire returns the region holding [addr, addr+n) with a reference taken, or nil.
func (t *regionTable) acquire(addr, n uint64) *memRegion {
	r := t.find(addr, n)
	if r == nil || !r.use() {
		return nil
	}
	return r
}

func (t *regionTable) list() []Region {
	t.mu.RLock()
	defer t.mu.RUnlock()
	out := make([]Region, len(t.regs))
	for i, r := range t.regs {
		out[i] = r.Region
	}
	return out
}

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

// ---- owner side ----

func (e *tcpEngine) acceptLoop() {
	defer e.wg.Done()
	for {
		c, err := e.ln.Accept()
		if err != nil {
			return
		}
		e.mu.Lock()
		if e.closed {
			e.mu.Unlock()
			c.Close()
			return
		}
		e.accepted[c] = struct{}{}
		e.wg.Add(1)
		e.mu.Unlock()
		go func() {
			defer e.wg.Done()
			_ = e.serveConn(c)
			c.Close()
			e.mu.Lock()
			delete(e.accepted, c)
			e.mu.Unlock()
		}()
	}
}

// serveConn answers one peer connection: the handshake, then WRITE and READ frames in order.
func (e *tcpEngine) serveConn(c net.Conn) error {
	br := bufio.NewReaderSize(c, tcpServeBufSize)
	bw := bufio.NewWriterSize(c, tcpWriteBufSize)
	_ = c.SetDeadline(time.Now().Add(tcpHandshakeTimeout))
	ok, peer, err := e.serveHandshake(br, bw)
	if err != nil || !ok {
		return err
	}
	_ = c.SetDeadline(time.Time{})
	var raw syscall.RawConn
	if sc, ok := c.(syscall.Conn); ok {
		raw, _ = sc.SyscallConn()
	}
	return e.servePeer(br, bw, raw, c, peer)
}

// tcpPayloadTimeout bounds how long the owner waits for the payload of a WRITE it has started to
// land: a stalled peer must not keep a region referenced (and UnregisterMemory waiting) forever.
var tcpPayloadTimeout = 30 * time.Second

type readDeadliner interface{ SetReadDeadline(time.Time) error }

// serveHandshake answers the HELLO; it returns whether data frames follow and the name the peer
// announced (its own segment name, what a WriteGuard is told).
func (e *tcpEngine) serveHandshake(br *bufio.Reader, bw *bufio.Writer) (bool, string, error) {
	typ, n, err := tcpReadHeader(br)
	if err != nil {
		return false, "", err
	}
	if typ != tcpFtHello {
		return false, "", fmt.Errorf("%w: expected HELLO, got tcpFrame type %d", tcpErrProtocol, typ)
	}
	body, err := tcpReadBody(br, n)
	if err != nil {
		return false, "", err
	}
	h, err := tcpDecodeHello(body)
	if err != nil {
		return false, "", err
	}
	ack := tcpHelloAck{version: tcpWireVersion, tcpShape: e.tcpShape}
	switch {
	case h.version != tcpWireVersion:
		ack.status, ack.msg = tcpStVersion, fmt.Sprintf("version %d not supported (want %d)", h.version, tcpWireVersion)
	case e.tcpShape.compatible(h.tcpShape) != nil:
		ack.status, ack.msg = tcpStLayout, e.tcpShape.compatible(h.tcpShape).Error()
	default:
		ack.regions = e.regions.list()
	}
	if _, err := bw.Write(tcpEncodeHelloAck(ack)); err != nil {
		return false, "", err
	}
	return ack.status == tcpStOK, h.name, bw.Flush()
}

// serveData handles data frames until the peer goes away. Every target range is checked against
// the registered regions, and every WRITE range then against the write guard (if one is
// installed), before a byte is touched; refused WRITE payloads are discarded.
// Successful WRITEs are acknowledged cumulatively (WRITE_ACK_UPTO) before any other answer and
// whenever the input runs dry, so answers stay in request order.
func (e *tcpEngine) serveData(br *bufio.Reader, bw *bufio.Writer, raw syscall.RawConn, dl readDeadliner) error {
	return e.servePeer(br, bw, raw, dl, "")
}

// servePeer is serveData for the peer that announced itself as peer at the handshake.
func (e *tcpEngine) servePeer(br *bufio.Reader, bw *bufio.Writer, raw syscall.RawConn, dl readDeadliner, peer string) error {
	payloadDeadline := func(on bool) {
		if dl == nil {
			return
		}
		t := time.Time{}
		if on {
			t = time.Now().Add(tcpPayloadTimeout)
		}
		_ = dl.SetReadDeadline(t)
	}
	var hdr [20]byte
	var out []byte
	wb := &writeBatch{}
	var ackID uint64
	ackPending := false
	flushAck := func() error {
		if !ackPending {
			return nil
		}
		ackPending = false
		out = tcpAppendAckUpTo(out[:0], ackID)
		_, err := bw.Write(out)
		return err
	}
	for {
		if br.Buffered() == 0 {
			if err := flushAck(); err != nil {
				return err
			}
			if err := bw.Flush(); err != nil {
				return err
			}
		}
		typ, n, err := tcpReadHeader(br)
		if err != nil {
			return err
		}
		if e.serverHook != nil {
			e.serverHook(typ)
		}
		switch typ {
		case tcpFtWrite:
			if _, err := io.ReadFull(br, hdr[:16]); err != nil {
				return err
			}
			id, addr, plen := binary.LittleEndian.Uint64(hdr[:]), binary.LittleEndian.Uint64(hdr[8:]), uint64(n-16)
			status, msg := tcpStOK, ""
			if plen == 0 {
				status, msg = tcpStInvalid, "zero-length write"
			} else if r := e.regions.acquire(addr, plen); r == nil {
				status, msg = tcpStOutOfBounds, fmt.Sprintf("write [%#x, +%d) outside registered memory", addr, plen)
			} else if err := e.checkGuard(peer, addr, plen); err != nil {
				r.release()
				status, msg = tcpStOutOfBounds, guardRefusal(addr, plen, err)
			} else {
				payloadDeadline(true)
				_, err = io.ReadFull(br, memAt(addr, plen))
				r.release()
				payloadDeadline(false)
				if err != nil {
					return err
				}
				ackID, ackPending = id, true
				continue
			}
			if _, err := br.Discard(int(plen)); err != nil {
				return err
			}
			if err := flushAck(); err != nil {
				return err
			}
			out = tcpAppendWriteAck(out[:0], id, status, msg)
			if _, err := bw.Write(out); err != nil {
				return err
			}
		case tcpFtWriteBatch:
			payloadDeadline(true)
			err := wb.receive(e, br, raw, n, peer)
			payloadDeadline(false)
			if err != nil {
				return err
			}
			for i, st := range wb.status {
				id := wb.first + uint64(i)
				if st == tcpStOK {
					ackID, ackPending = id, true
					continue
				}
				if err := flushAck(); err != nil {
					return err
				}
				out = tcpAppendWriteAck(out[:0], id, st, wb.msg[i])
				if _, err := bw.Write(out); err != nil {
					return err
				}
			}
		case tcpFtRead:
			if _, err := io.ReadFull(br, hdr[:20]); err != nil {
				return err
			}
			if err := flushAck(); err != nil {
				return err
			}
			id, addr, rlen := binary.LittleEndian.Uint64(hdr[:]), binary.LittleEndian.Uint64(hdr[8:]), uint64(binary.LittleEndian.Uint32(hdr[16:]))
			var r *memRegion
			status, msg := tcpStOK, ""
			if rlen == 0 || rlen > tcpMaxSlice {
				status, msg = tcpStInvalid, fmt.Sprintf("read of %d bytes", rlen)
			} else if r = e.regions.acquire(addr, rlen); r == nil {
				status, msg = tcpStOutOfBounds, fmt.Sprintf("read [%#x, +%d) outside registered memory", addr, rlen)
			}
			out = out[:0]
			if status == tcpStOK {
				out = binary.LittleEndian.AppendUint32(out, uint32(1+8+1+rlen))
				out = append(out, tcpFtReadResp)
				out = binary.LittleEndian.AppendUint64(out, id)
				out = append(out, tcpStOK)
				_, err := bw.Write(out)
				if err == nil {
					_, err = bw.Write(memAt(addr, rlen))
				}
				r.release()
				if err != nil {
					return err
				}
				continue
			}
			out = binary.LittleEndian.AppendUint32(out, uint32(1+8+1+2+len(msg)))
			out = append(out, tcpFtReadResp)
			out = binary.LittleEndian.AppendUint64(out, id)
			out = append(out, status)
			out = binary.LittleEndian.AppendUint16(out, uint16(len(msg)))
			out = append(out, msg...)
			if _, err := bw.Write(out); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%w: unexpected frame type %d", tcpErrProtocol, typ)
		}
	}
}

// writeBatch is the owner's state for one WRITE_BATCH frame.
type writeBatch struct {
	first  uint64
	desc   []byte
	regs   []*memRegion
	dst    [][]byte
	iov    [][]byte // dst with back-to-back ranges joined
	status []uint8
	msg    []string
}

// receive reads one WRITE_BATCH body (n bytes): it checks every descriptor against the registered
// regions and the write guard (if one is installed; asked with peer), then lands the payloads of the accepted writes straight in memory — what is already
// buffered is copied, the rest is read with readv into the target ranges — and discards the
// payloads of refused ones. status/msg say, per write, what to acknowledge.
func (wb *writeBatch) receive(e *tcpEngine, br *bufio.Reader, raw syscall.RawConn, n uint32, peer string) error {
	var h [12]byte
	if _, err := io.ReadFull(br, h[:]); err != nil {
		return err
	}
	wb.first = binary.LittleEndian.Uint64(h[:])
	count := binary.LittleEndian.Uint32(h[8:])
	if count == 0 || count > tcpMaxBatch || uint64(n) < 12+12*uint64(count) {
		return fmt.Errorf("%w: WRITE_BATCH of %d writes in %d bytes", tcpErrProtocol, count, n)
	}
	payload := uint64(n) - 12 - 12*uint64(count)
	if cap(wb.desc) < int(12*count) {
		wb.desc = make([]byte, 12*tcpMaxBatch)
	}
	desc := wb.desc[:12*count]
	if _, err := io.ReadFull(br, desc); err != nil {
		return err
	}
	wb.regs, wb.dst, wb.status, wb.msg = wb.regs[:0], wb.dst[:0], wb.status[:0], wb.msg[:0]
	defer func() {
		for _, r := range wb.regs {
			if r != nil {
				r.release()
			}
		}
		clear(wb.regs)
		clear(wb.dst)
	}()
	var sum uint64
	allOK := true
	var last *memRegion // holds a reference taken for an earlier write of this batch
	var guard WriteGuard
	if g := e.guard.Load(); g != nil {
		guard = *g
	}
	for i := uint32(0); i < count; i++ {
		addr, l := binary.LittleEndian.Uint64(desc[12*i:]), uint64(binary.LittleEndian.Uint32(desc[12*i+8:]))
		sum += l
		var r *memRegion
		st, msg := tcpStOK, ""
		if l == 0 {
			st, msg = tcpStInvalid, "zero-length write"
		} else if last != nil && last.Contains(addr, l) {
			r = last // checked against the same region; its reference covers this write too
		} else if r = e.regions.acquire(addr, l); r == nil {
			st, msg = tcpStOutOfBounds, fmt.Sprintf("write [%#x, +%d) outside registered memory", addr, l)
		} else {
			wb.regs = append(wb.regs, r)
			last = r
		}
		if r != nil && guard != nil {
			if err := guard(peer, addr, l); err != nil {
				r = nil // its reference, if taken here, is in wb.regs and released below
				st, msg = tcpStOutOfBounds, guardRefusal(addr, l, err)
			}
		}
		allOK = allOK && st == tcpStOK
		if r != nil {
			wb.dst = append(wb.dst, memAt(addr, l))
		} else {
			wb.dst = append(wb.dst, nil)
		}
		wb.status = append(wb.status, st)
		wb.msg = append(wb.msg, msg)
	}
	if sum != payload {
		return fmt.Errorf("%w: WRITE_BATCH payload %d bytes, descriptors say %d", tcpErrProtocol, payload, sum)
	}
	if !allOK || raw == nil {
		for i, d := range wb.dst {
			l := int(binary.LittleEndian.Uint32(desc[12*i+8:]))
			if d == nil {
				if _, err := br.Discard(l); err != nil {
					return err
				}
			} else if _, err := io.ReadFull(br, d); err != nil {
				return err
			}
		}
		return nil
	}
	// Every write was accepted: payloads that land back to back share one iovec.
	iovs := wb.iov[:0]
	for _, d := range wb.dst {
		if n := len(iovs); n > 0 && unsafe.Add(unsafe.Pointer(unsafe.SliceData(iovs[n-1])), len(iovs[n-1])) == unsafe.Pointer(unsafe.SliceData(d)) {
			iovs[n-1] = unsafe.Slice(unsafe.SliceData(iovs[n-1]), len(iovs[n-1])+len(d))
			continue
		}
		iovs = append(iovs, d)
	}
	wb.iov = iovs
	defer clear(wb.iov)
	for len(iovs) > 0 && br.Buffered() > 0 {
		k, err := br.Read(iovs[0])
		if err != nil {
			return err
		}
		iovs = advanceIovs(iovs, k)
	}
	return readvFull(raw, iovs)
}

// advanceIovs drops the first k bytes of iovs (the slice header array is modified in place).
func advanceIovs(iovs [][]byte, k int) [][]byte {
	for k > 0 && len(iovs) > 0 {
		if k < len(iovs[0]) {
			iovs[0] = iovs[0][k:]
			return iovs
		}
		k -= len(iovs[0])
		iovs = iovs[1:]
	}
	for len(iovs) > 0 && len(iovs[0]) == 0 {
		iovs = iovs[1:]
	}
	return iovs
}

// readvFull fills iovs from the socket with readv (at most 1,024 buffers a call).
func readvFull(raw syscall.RawConn, iovs [][]byte) error {
	for len(iovs) > 0 {
		var opErr error
		err := raw.Read(func(fd uintptr) bool {
			for {
				k, err := unix.Readv(int(fd), iovs[:min(len(iovs), 1024)])
				switch {
				case err == unix.EINTR:
					continue
				case err == unix.EAGAIN:
					return false
				case err != nil:
					opErr = err
				case k == 0:
					opErr = io.ErrUnexpectedEOF
				default:
					iovs = advanceIovs(iovs, k)
				}
				return true
			}
		})
		if err != nil {
			return err
		}
		if opErr != nil {
			return opErr
		}
	}
	return nil
}

// ---- dialing side ----

type tcpSegment struct {
	id      SegmentID
	name    string
	regions []Region
	conns   []*tcpConn
	refs    int
	next    atomic.Uint64
}

func (s *tcpSegment) broken() bool {
	for _, c := range s.conns {
		select {
		case <-c.done:
			return true
		default:
		}
	}
	return false
}

func (e *tcpEngine) OpenSegment(ctx context.Context, name string) (SegmentID, error) {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return 0, ErrClosed
	}
	for _, s := range e.segs {
		if s.name == name && !s.broken() {
			s.refs++
			e.mu.Unlock()
			return s.id, nil
		}
	}
	e.mu.Unlock()

	seg := &tcpSegment{name: name, refs: 1}
	for i := 0; i < e.conns; i++ {
		c, ack, err := e.dial(ctx, name, i)
		if err != nil {
			for _, c := range seg.conns {
				c.kill(ErrClosed)
			}
			return 0, err
		}
		if i == 0 {
			seg.regions = ack.regions
		}
		seg.conns = append(seg.conns, c)
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		for _, c := range seg.conns {
			c.kill(ErrClosed)
		}
		return 0, ErrClosed
	}
	e.nextSeg++
	seg.id = e.nextSeg
	e.segs[seg.id] = seg
	for _, c := range seg.conns {
		e.wg.Add(2)
		go c.writeLoop()
		go c.readLoop()
	}
	e.mu.Unlock()
	return seg.id, nil
}

// dial opens connection i to the peer and runs the handshake.
func (e *tcpEngine) dial(ctx context.Context, name string, i int) (*tcpConn, tcpHelloAck, error) {
	d := net.Dialer{Timeout: tcpHandshakeTimeout}
	nc, err := d.DialContext(ctx, "tcp", name)
	if err != nil {
		return nil, tcpHelloAck{}, fmt.Errorf("%w %q: %v", ErrUnknownSegment, name, err)
	}
	dl := time.Now().Add(tcpHandshakeTimeout)
	if t, ok := ctx.Deadline(); ok && t.Before(dl) {
		dl = t
	}
	_ = nc.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { _ = nc.SetDeadline(time.Now()) })
	ack, err := e.handshake(nc, i)
	stop()
	if err != nil {
		nc.Close()
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return nil, tcpHelloAck{}, fmt.Errorf("rdma: tcp handshake with %s: %w", name, err)
	}
	_ = nc.SetDeadline(time.Time{})
	c := &tcpConn{
		e:     e,
		nc:    nc,
		br:    bufio.NewReaderSize(nc, tcpReadBufSize),
		wake:  make(chan struct{}, 1),
		space: make(chan struct{}, 1),
		done:  make(chan struct{}),
	}
	return c, ack, nil
}

func (e *tcpEngine) handshake(nc net.Conn, i int) (tcpHelloAck, error) {
	if _, err := nc.Write(tcpEncodeHello(tcpHello{version: tcpWireVersion, conn: uint16(i), tcpShape: e.tcpShape, name: e.name})); err != nil {
		return tcpHelloAck{}, err
	}
	br := bufio.NewReaderSize(nc, 4096)
	typ, n, err := tcpReadHeader(br)
	if err != nil {
		return tcpHelloAck{}, err
	}
	if typ != tcpFtHelloAck {
		return tcpHelloAck{}, fmt.Errorf("%w: expected HELLO_ACK, got tcpFrame type %d", tcpErrProtocol, typ)
	}
	body, err := tcpReadBody(br, n)
	if err != nil {
		return tcpHelloAck{}, err
	}
	if br.Buffered() != 0 {
		return tcpHelloAck{}, fmt.Errorf("%w: data after HELLO_ACK", tcpErrProtocol)
	}
	ack, err := tcpDecodeHelloAck(body)
	if err != nil {
		return tcpHelloAck{}, err
	}
	if err := tcpStatusErr(ack.status, ack.msg); err != nil {
		return tcpHelloAck{}, err
	}
	if ack.version != tcpWireVersion {
		return tcpHelloAck{}, fmt.Errorf("%w: peer speaks version %d", tcpErrProtocol, ack.version)
	}
	if err := e.tcpShape.compatible(ack.tcpShape); err != nil {
		return tcpHelloAck{}, err
	}
	return ack, nil
}

func (e *tcpEngine) CloseSegment(id SegmentID) error {
	e.mu.Lock()
	s, ok := e.segs[id]
	if !ok {
		e.mu.Unlock()
		return fmt.Errorf("%w: %d", ErrUnknownSegment, id)
	}
	s.refs--
	if s.refs > 0 {
		e.mu.Unlock()
		return nil
	}
	delete(e.segs, id)
	e.mu.Unlock()
	for _, c := range s.conns {
		c.kill(fmt.Errorf("%w: segment closed", ErrClosed))
	}
	return nil
}

func (e *tcpEngine) RemoteRegions(id SegmentID) ([]Region, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s, ok := e.segs[id]
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownSegment, id)
	}
	return append([]Region(nil), s.regions...), nil
}

// sliceOp is one frame's worth of a task.
type sliceOp struct {
	t     *task
	b     *batch // t's
	op    Opcode
	local *memRegion
	laddr uint64
	raddr uint64
	n     uint64
	id    uint64
}

// done accounts for one answered (or failed) slice. The task ends when its last slice does: a
// refused slice fails the task, but only after its other slices are answered too, so that when
// Wait reports the failure none of the task's bytes is still in flight (allowed slices of a
// failed task may have landed; nothing lands later).
func (s *sliceOp) done(err error) {
	if err != nil {
		s.t.serr.CompareAndSwap(nil, &err)
	} else {
		s.t.bytes.Add(s.n)
	}
	if s.t.left.Add(-1) == 0 {
		if e := s.t.serr.Load(); e != nil {
			s.t.finish(s.b, TaskFailed, *e)
		} else {
			s.t.finish(s.b, TaskCompleted, nil)
		}
	}
}

// tcpConn is one connection to a peer: a writer goroutine sends queued slices (WRITE payloads go
// straight from registered memory with writev), a reader goroutine matches the owner's in-order
// answers with the in-flight slices.
type tcpConn struct {
	e  *tcpEngine
	nc net.Conn
	br *bufio.Reader

	mu       sync.Mutex
	queue    [][]sliceOp // chunks handed over by Submit
	inflight []sliceOp   // FIFO, head at ihead
	ihead    int
	dead     bool
	deadErr  error
	waiting  bool // the writer waits for in-flight room

	wake  chan struct{} // new work
	space chan struct{} // in-flight room
	done  chan struct{}
}

// enqueue hands a chunk of slices to the writer, which owns it from now on; on a dead connection
// they fail at once.
func (c *tcpConn) enqueue(ops []sliceOp) {
	c.mu.Lock()
	if c.dead {
		err := c.deadErr
		c.mu.Unlock()
		for i := range ops {
			ops[i].done(err)
		}
		return
	}
	c.queue = append(c.queue, ops)
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// kill breaks the connection: every queued and in-flight slice fails with err.
func (c *tcpConn) kill(err error) {
	c.mu.Lock()
	if c.dead {
		c.mu.Unlock()
		return
	}
	c.dead, c.deadErr = true, err
	q, inf := c.queue, c.inflight[c.ihead:]
	c.queue, c.inflight, c.ihead = nil, nil, 0
	close(c.done)
	c.mu.Unlock()
	c.nc.Close()
	for i := range inf {
		inf[i].done(err)
	}
	for _, ch := range q {
		for i := range ch {
			ch[i].done(err)
		}
	}
}

func (c *tcpConn) isDead() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

func (c *tcpConn) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.deadErr
}

// sender accumulates frames for one writev: READ frames, WRITE_BATCH headers and small WRITE
// payloads in a fixed arena (so they leave in large contiguous writes), payloads larger than
// sendCopyMax referenced in place in registered memory (zero copy), with a reference held on their
// regions until written.
type sender struct {
	c     *tcpConn
	pend  []sliceOp
	bufs  net.Buffers
	iov   [][]byte // backing array of bufs
	arena []byte
	ext   bool // the last iovec ends at the arena's end and may grow
	held  []*memRegion
	next  uint64
	// lastEnd is the address just past the last zero-copy payload iovec (valid while !ext).
	lastEnd uint64
	// credit: room for this many pending frames was seen in the in-flight window.
	credit int

	// The open WRITE_BATCH: its header iovec, reserved arena bytes, count and payload bytes.
	grp      int // index in iov, -1 when none is open
	grpAt    int
	grpCount int
	grpBytes uint64
	grpFirst uint64
}

const (
	sendMaxIov = 1024
	// grpHeader is the arena space a WRITE_BATCH header may take.
	grpHeader = 4 + 1 + 12 + 12*tcpMaxBatch
)

// Send tuning: the arena size, and the largest payload copied into it (larger ones go zero-copy
// with writev). BenchmarkTransfer measured pure zero copy (sendCopyMax 0) fastest on an idle host
// (ratio 1.16 vs 0.98 with 64 KiB copies); KVC_BENCH_SEND_ARENA / KVC_BENCH_SEND_COPY try others.
var (
	sendArena   = 256 << 10
	sendCopyMax = 0
)

func (w *sender) appendArena(b []byte) {
	start := len(w.arena)
	w.arena = append(w.arena, b...)
	if w.ext {
		last := &w.iov[len(w.iov)-1]
		*last = w.arena[start-len(*last) : len(w.arena)]
		return
	}
	w.iov = append(w.iov, w.arena[start:])
	w.ext = true
}

// closeGroup writes the open WRITE_BATCH header at the end of its reserved arena bytes, right
// before the group's first payload, and extends the group's first iovec back over it.
func (w *sender) closeGroup() {
	if w.grp < 0 {
		return
	}
	used := 17 + 12*w.grpCount
	at := w.grpAt + grpHeader - used
	copy(w.arena[at+17:at+used], w.arena[w.grpAt+17:w.grpAt+used])
	h := w.arena[at : at+17]
	binary.LittleEndian.PutUint32(h, uint32(1+12+12*uint64(w.grpCount)+w.grpBytes))
	h[4] = tcpFtWriteBatch
	binary.LittleEndian.PutUint64(h[5:], w.grpFirst)
	binary.LittleEndian.PutUint32(h[13:], uint32(w.grpCount))
	first := w.iov[w.grp]
	w.iov[w.grp] = w.arena[at : w.grpAt+grpHeader+len(first)]
	w.grp = -1
}

// add queues one slice; it flushes first when the arena, the iovecs or the in-flight window are full.
func (w *sender) add(s *sliceOp) error {
	if s.op == OpWrite && w.grp >= 0 && (w.grpCount == tcpMaxBatch || w.grpBytes+s.n > tcpMaxBatchBytes) {
		w.closeGroup()
	}
	needArena, needIov := 25, 1
	if s.op == OpWrite {
		needArena, needIov = 0, 0
		if s.n <= uint64(sendCopyMax) {
			needArena = int(s.n)
		}
		needIov++ // the payload
		if w.grp < 0 {
			needArena += grpHeader
			needIov++
		}
	}
	if len(w.arena)+needArena > cap(w.arena) || len(w.iov)+needIov > sendMaxIov || len(w.pend) >= tcpMaxInflight/2 {
		if err := w.flush(); err != nil {
			return err
		}
	}
	if err := w.room(); err != nil {
		return err
	}
	if s.op == OpRead {
		w.closeGroup()
		w.next++
		s.id = w.next
		var h [25]byte
		binary.LittleEndian.PutUint32(h[:], 1+20)
		h[4] = tcpFtRead
		binary.LittleEndian.PutUint64(h[5:], s.id)
		binary.LittleEndian.PutUint64(h[13:], s.raddr)
		binary.LittleEndian.PutUint32(h[21:], uint32(s.n))
		w.appendArena(h[:25])
	} else {
		if !s.local.use() {
			s.done(fmt.Errorf("%w: local source [%#x, +%d) was unregistered", ErrOutOfBounds, s.laddr, s.n))
			return nil
		}
		w.next++
		s.id = w.next
		if w.grp < 0 {
			w.grpAt = len(w.arena)
			w.arena = w.arena[:w.grpAt+grpHeader]
			w.grp = len(w.iov)
			w.iov = append(w.iov, w.arena[w.grpAt+grpHeader:])
			w.ext = true
			w.grpCount, w.grpBytes, w.grpFirst = 0, 0, s.id
		}
		e := w.arena[w.grpAt+17+12*w.grpCount:]
		binary.LittleEndian.PutUint64(e, s.raddr)
		binary.LittleEndian.PutUint32(e[8:], uint32(s.n))
		w.grpCount++
		w.grpBytes += s.n
		if s.n <= uint64(sendCopyMax) {
			w.appendArena(memAt(s.laddr, s.n))
			s.local.release()
		} else {
			if nh := len(w.held); nh > 0 && w.held[nh-1] == s.local {
				s.local.release() // the reference taken for an earlier slice covers this one
			} else {
				w.held = append(w.held, s.local)
			}
			if last := len(w.iov) - 1; !w.ext && last > w.grp && w.lastEnd == s.laddr {
				// Contiguous with the previous payload of this WRITE_BATCH: one iovec.
				w.iov[last] = memAt(s.laddr-uint64(len(w.iov[last])), uint64(len(w.iov[last]))+s.n)
			} else {
				w.iov = append(w.iov, memAt(s.laddr, s.n))
				w.ext = false
			}
			w.lastEnd = s.laddr + s.n
		}
	}
	s.t.start()
	w.pend = append(w.pend, *s)
	return nil
}

// room waits until the in-flight window has space for the pending frames plus one. The space
// seen last is remembered (credit): answers only ever free more, so the lock is taken again only
// once that much is pending (flush resets it).
func (w *sender) room() error {
	if len(w.pend) < w.credit {
		return nil
	}
	c := w.c
	for {
		c.mu.Lock()
		if c.dead {
			c.mu.Unlock()
			return c.err()
		}
		if free := tcpMaxInflight - (len(c.inflight) - c.ihead); len(w.pend) < free {
			w.credit = free
			c.mu.Unlock()
			return nil
		}
		c.waiting = true
		c.mu.Unlock()
		if err := w.flush(); err != nil {
			return err
		}
		select {
		case <-c.space:
		case <-c.done:
		}
	}
}

// flush moves the pending frames in flight and writes them with one writev.
func (w *sender) flush() error {
	w.closeGroup()
	if len(w.pend) == 0 {
		return nil
	}
	c := w.c
	c.mu.Lock()
	if c.dead {
		c.mu.Unlock()
		err := c.err()
		for i := range w.pend {
			w.pend[i].done(err)
		}
		w.reset()
		return err
	}
	if c.ihead > 0 && c.ihead == len(c.inflight) {
		c.inflight, c.ihead = c.inflight[:0], 0
	}
	c.inflight = append(c.inflight, w.pend...)
	c.mu.Unlock()
	w.bufs = w.iov
	_, err := w.bufs.WriteTo(c.nc)
	w.reset()
	if err != nil {
		err = fmt.Errorf("%w: %s: %v", ErrPeerGone, c.nc.RemoteAddr(), err)
		c.kill(err)
		return err
	}
	return nil
}

func (w *sender) reset() {
	for _, r := range w.held {
		r.release()
	}
	clear(w.held)
	w.held = w.held[:0]
	clear(w.iov)
	w.iov = w.iov[:0]
	w.arena = w.arena[:0]
	w.ext = false
	w.grp = -1
	w.credit = 0
	clear(w.pend)
	w.pend = w.pend[:0]
}

func (c *tcpConn) writeLoop() {
	defer c.e.wg.Done()
	w := &sender{c: c, arena: make([]byte, 0, sendArena), iov: make([][]byte, 0, sendMaxIov), grp: -1}
	defer w.reset()
	for {
		c.mu.Lock()
		for len(c.queue) == 0 && !c.dead {
			c.mu.Unlock()
			if err := w.flush(); err != nil {
				return
			}
			select {
			case <-c.wake:
			case <-c.done:
			}
			c.mu.Lock()
		}
		if c.dead {
			c.mu.Unlock()
			return // kill failed the queue
		}
		chunks := c.queue
		c.queue = nil
		c.mu.Unlock()
		for k, q := range chunks {
			if k > 0 {
				putChunk(chunks[k-1]) // add copied its slices
			}
			for i := range q {
				if q[i].t.final() {
					continue
				}
				if err := w.add(&q[i]); err != nil {
					for j := range w.pend {
						w.pend[j].done(err)
					}
					for j := i; j < len(q); j++ {
						q[j].done(err)
					}
					for _, rest := range chunks[k+1:] {
						for j := range rest {
							rest[j].done(err)
						}
					}
					return
				}
			}
		}
		if len(chunks) > 0 {
			putChunk(chunks[len(chunks)-1])
		}
	}
}

func (c *tcpConn) readLoop() {
	defer c.e.wg.Done()
	err := c.readResponses()
	c.kill(fmt.Errorf("%w: %s: %v", ErrPeerGone, c.nc.RemoteAddr(), err))
}

// pop takes the in-flight slices up to and including id, which must be in flight.
func (c *tcpConn) pop(id uint64, upTo bool, buf []sliceOp) ([]sliceOp, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	k := c.ihead
	for k < len(c.inflight) && c.inflight[k].id < id && upTo {
		k++
	}
	if k == len(c.inflight) || c.inflight[k].id != id {
		return buf, fmt.Errorf("%w: answer for request %d, which is not next in flight", tcpErrProtocol, id)
	}
	buf = append(buf, c.inflight[c.ihead:k+1]...)
	clear(c.inflight[c.ihead : k+1])
	c.ihead = k + 1
	if c.waiting {
		c.waiting = false
		select {
		case c.space <- struct{}{}:
		default:
		}
	}
	return buf, nil
}

func (c *tcpConn) readResponses() error {
	var hdr [11 + tcpMaxMsg]byte
	var got []sliceOp
	for {
		typ, n, err := tcpReadHeader(c.br)
		if err != nil {
			return err
		}
		if _, err := io.ReadFull(c.br, hdr[:min(n, 9)]); err != nil {
			return err
		}
		id := binary.LittleEndian.Uint64(hdr[:])
		switch typ {
		case tcpFtWriteAckUpTo:
			if got, err = c.pop(id, true, got[:0]); err != nil {
				return err
			}
			for i := range got {
				if got[i].op != OpWrite {
					return fmt.Errorf("%w: WRITE_ACK_UPTO covers a READ", tcpErrProtocol)
				}
			}
			for i := range got {
				got[i].done(nil)
			}
		case tcpFtWriteAck:
			if got, err = c.pop(id, false, got[:0]); err != nil {
				return err
			}
			s := &got[0]
			if _, err := io.ReadFull(c.br, hdr[9:n]); err != nil {
				return err
			}
			ml := int(binary.LittleEndian.Uint16(hdr[9:]))
			if s.op != OpWrite || 11+ml != int(n) {
				return fmt.Errorf("%w: bad WRITE_ACK", tcpErrProtocol)
			}
			s.done(tcpStatusErr(hdr[8], string(hdr[11:11+ml])))
		case tcpFtReadResp:
			if got, err = c.pop(id, false, got[:0]); err != nil {
				return err
			}
			s := &got[0]
			if s.op != OpRead {
				return fmt.Errorf("%w: READ_RESP for a WRITE", tcpErrProtocol)
			}
			status, rest := hdr[8], uint64(n-9)
			if status != tcpStOK {
				if rest < 2 || rest > 2+tcpMaxMsg {
					return fmt.Errorf("%w: bad READ_RESP", tcpErrProtocol)
				}
				if _, err := io.ReadFull(c.br, hdr[:rest]); err != nil {
					return err
				}
				ml := int(binary.LittleEndian.Uint16(hdr[:]))
				if uint64(2+ml) != rest {
					return fmt.Errorf("%w: bad READ_RESP message", tcpErrProtocol)
				}
				s.done(tcpStatusErr(status, string(hdr[2:2+ml])))
				continue
			}
			if rest != s.n {
				return fmt.Errorf("%w: READ_RESP of %d bytes, asked %d", tcpErrProtocol, rest, s.n)
			}
			if err := c.receive(s); err != nil {
				return err
			}
		default:
			return fmt.Errorf("%w: unexpected frame type %d", tcpErrProtocol, typ)
		}
	}
}

// receive lands a READ payload in local memory, or discards it when the task is already final
// (canceled) or the local region was withdrawn.
func (c *tcpConn) receive(s *sliceOp) error {
	if s.t.final() || !s.local.use() {
		if _, err := c.br.Discard(int(s.n)); err != nil {
			return err
		}
		if !s.t.final() {
			s.done(fmt.Errorf("%w: local destination [%#x, +%d) was unregistered", ErrOutOfBounds, s.laddr, s.n))
		}
		return nil
	}
	_, err := io.ReadFull(c.br, memAt(s.laddr, s.n))
	s.local.release()
	if err != nil {
		return err
	}
	s.done(nil)
	return nil
}

// ---- batches ----

// sliceChunk is how many slices Submit hands to a writer at once; chunks are recycled.
const sliceChunk = 1024

var chunkPool = sync.Pool{New: func() any { return new([]sliceOp) }}

func getChunk() []sliceOp {
	p := chunkPool.Get().(*[]sliceOp)
	if cap(*p) < sliceChunk {
		return make([]sliceOp, 0, sliceChunk)
	}
	return (*p)[:0]
}

// putChunk recycles a chunk whose slices the writer has taken.
func putChunk(q []sliceOp) {
	if cap(q) != sliceChunk {
		return
	}
	clear(q)
	q = q[:0]
	chunkPool.Put(&q)
}

func (e *tcpEngine) AllocateBatch(capacity int) (BatchID, error) {
	if e.isClosed() {
		return 0, ErrClosed
	}
	return e.batches.allocate(capacity)
}

func (e *tcpEngine) Submit(ctx context.Context, id BatchID, reqs []Request) error {
	if e.isClosed() {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b, err := e.batches.get(id)
	if err != nil {
		return err
	}
	tasks, err := b.add(len(reqs))
	if err != nil {
		return err
	}
	// Slices are handed to each connection's writer in chunks as they are planned, so the
	// first bytes leave while the rest of a large batch is still being cut. Consecutive slices
	// stay on one connection until it has about SliceBytes of them, so each writer walks memory
	// in order (contiguous payloads share an iovec) while large requests still spread over all
	// connections.
	type segQueues struct {
		seg   *tcpSegment
		q     [][]sliceOp
		ci    int    // the connection taking slices now
		bytes uint64 // bytes given to it since it was picked
	}
	var (
		queues     []*segQueues
		lastTarget SegmentID
		lastQ      *segQueues
		lastLocal  *memRegion
	)
	for i, r := range reqs {
		t := &tasks[i]
		if r.Op != OpRead && r.Op != OpWrite {
			t.finish(b, TaskFailed, fmt.Errorf("%w: opcode %v", ErrInvalidRequest, r.Op))
			continue
		}
		if r.Length == 0 {
			t.finish(b, TaskFailed, fmt.Errorf("%w: zero length", ErrInvalidRequest))
			continue
		}
		if lastQ == nil || r.Target != lastTarget {
			e.mu.Lock()
			seg, ok := e.segs[r.Target]
			e.mu.Unlock()
			if !ok {
				t.finish(b, TaskFailed, fmt.Errorf("%w: %d", ErrUnknownSegment, r.Target))
				continue
			}
			lastQ = nil
			for _, q := range queues {
				if q.seg == seg {
					lastQ = q
				}
			}
			if lastQ == nil {
				lastQ = &segQueues{seg: seg, q: make([][]sliceOp, len(seg.conns)), ci: int(seg.next.Add(1) % uint64(len(seg.conns)))}
				queues = append(queues, lastQ)
			}
			lastTarget = r.Target
		}
		if r.TargetAddr+r.Length < r.TargetAddr {
			t.finish(b, TaskFailed, fmt.Errorf("%w: target [%#x, +%d) wraps", ErrOutOfBounds, r.TargetAddr, r.Length))
			continue
		}
		local := lastLocal
		if local == nil || !local.Contains(r.Source, r.Length) {
			if local = e.regions.find(r.Source, r.Length); local == nil {
				t.finish(b, TaskFailed, fmt.Errorf("%w: local [%#x, +%d) is not registered", ErrOutOfBounds, r.Source, r.Length))
				continue
			}
			lastLocal = local
		}
		seg := lastQ.seg
		t.left.Store(int64((r.Length + e.sliceBytes - 1) / e.sliceBytes))
		for off := uint64(0); off < r.Length; off += e.sliceBytes {
			n := min(e.sliceBytes, r.Length-off)
			if lastQ.bytes >= e.sliceBytes {
				lastQ.ci, lastQ.bytes = int(seg.next.Add(1)%uint64(len(seg.conns))), 0
			}
			ci := lastQ.ci
			lastQ.bytes += n
			q := lastQ.q[ci]
			if q == nil {
				q = getChunk()
			}
			q = append(q, sliceOp{t: t, b: b, op: r.Op, local: local, laddr: r.Source + off, raddr: r.TargetAddr + off, n: n})
			if len(q) == cap(q) {
				seg.conns[ci].enqueue(q) // the writer owns q now
				q = nil
			}
			lastQ.q[ci] = q
		}
	}
	for _, sq := range queues {
		for ci, q := range sq.q {
			if len(q) > 0 {
				sq.seg.conns[ci].enqueue(q)
			}
		}
	}
	return nil
}

func (e *tcpEngine) Status(id BatchID, i int) (TaskStatus, error) {
	b, err := e.batches.get(id)
	if err != nil {
		return TaskStatus{}, err
	}
	return b.status(i)
}

func (e *tcpEngine) Wait(ctx context.Context, id BatchID) ([]TaskStatus, error) {
	b, err := e.batches.get(id)
	if err != nil {
		return nil, err
	}
	return b.wait(ctx)
}

func (e *tcpEngine) Cancel(id BatchID) error {
	b, err := e.batches.get(id)
	if err != nil {
		return err
	}
	b.cancel(TaskCanceled, context.Canceled)
	return nil
}

func (e *tcpEngine) FreeBatch(id BatchID) error { return e.batches.free(id) }

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
