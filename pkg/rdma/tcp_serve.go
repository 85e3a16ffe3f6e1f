package rdma

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

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

// servePeer handles data frames of the peer that announced itself as peer at the handshake
// until it goes away. Every target range is checked against the registered regions, and every
// WRITE range then against the write guard (if one is installed), before a byte is touched;
// refused WRITE payloads are discarded. Successful WRITEs are acknowledged cumulatively
// (WRITE_ACK_UPTO) before any other answer and whenever the input runs dry, so answers stay in
// request order.
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
			var status uint8
			var msg string
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
