package rdma

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
)

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
