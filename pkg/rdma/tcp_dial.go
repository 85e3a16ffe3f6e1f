package rdma

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"sync/atomic"
	"time"
)

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
