package rdma

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"
)

func (e *CUDAEngine) acceptLoop() {
	defer e.wg.Done()
	for {
		c, err := e.ln.Accept()
		if err != nil {
			return
		}
		e.wg.Add(1)
		go e.serve(c)
	}
}

// serve answers one opener: hello, then snapshots until either side closes.
func (e *CUDAEngine) serve(c net.Conn) {
	defer e.wg.Done()
	defer c.Close()
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	e.greeting[c] = struct{}{} // closed by Close while waiting for the hello
	e.mu.Unlock()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, err := cudaReadFrame(c)
	e.mu.Lock()
	delete(e.greeting, c)
	e.mu.Unlock()
	if err != nil {
		return
	}
	if _, err := cudaDecodeHello(b); err != nil {
		return
	}
	_ = c.SetReadDeadline(time.Time{})
	cc := &cudaConn{c: c}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return
	}
	e.conns[cc] = struct{}{}
	cc.send(cudaEncodeRegions(e.pid, e.adv))
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		delete(e.conns, cc)
		e.mu.Unlock()
	}()
	// The opener sends nothing more; a read returns when it closes (or misbehaves).
	var one [1]byte
	_, _ = c.Read(one[:])
}

// OpenSegment implements Engine: connect to the peer's control socket, receive its regions and
// import its device memory.
func (e *CUDAEngine) OpenSegment(ctx context.Context, name string) (SegmentID, error) {
	network, addr := splitCUDAAddr(name)
	if addr == "" {
		return 0, fmt.Errorf("%w: empty segment name", ErrUnknownSegment)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return 0, fmt.Errorf("%w %q: %v", ErrUnknownSegment, name, err)
	}
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(10 * time.Second)
	}
	_ = c.SetDeadline(dl)
	p := &cudaPeer{name: name, conn: c, done: make(chan struct{}), updated: make(chan struct{}, 1)}
	err = cudaWriteFrame(c, cudaEncodeHello(e.pid))
	var first []byte
	if err == nil {
		first, err = cudaReadFrame(c)
	}
	if err == nil {
		err = e.applySnapshot(p, first)
	}
	if err != nil {
		_ = c.Close()
		return 0, fmt.Errorf("%w %q: handshake: %v", ErrUnknownSegment, name, err)
	}
	_ = c.SetDeadline(time.Time{})
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		_ = c.Close()
		return 0, ErrClosed
	}
	id := e.nextSeg
	e.nextSeg++
	e.peers[id] = p
	e.mu.Unlock()
	e.wg.Add(1)
	go e.follow(p)
	return id, nil
}

// applySnapshot decodes a peer's region snapshot and resolves it for this process.
func (e *CUDAEngine) applySnapshot(p *cudaPeer, msg []byte) error {
	pid, regs, err := cudaDecodeRegions(msg)
	if err != nil {
		return err
	}
	spans := make(cudaSpans, len(regs))
	for i, r := range regs {
		s := cudaSpan{addr: r.Addr, len: r.Len, dev: -1}
		if r.CUDA != nil {
			s.dev = r.CUDA.Device
		}
		switch {
		case pid == e.pid && !e.testForeign:
			s.ptr = r.Ptr // same process: the owner's pointer is valid here
		case r.CUDA != nil:
			base, err := e.importHandle(r.CUDA)
			if err != nil {
				s.err = err
			} else {
				s.ptr = base + r.CUDA.Offset
			}
		case r.Kind == MemShared:
			if s.ptr, err = e.importShared(r); err != nil {
				s.err = err
			}
		default:
			s.err = errors.New("host memory of another process is not reachable through CUDA IPC")
		}
		spans[i] = s
	}
	p.pid = pid
	p.regs.Store(&regs)
	p.spans.Store(&spans)
	select {
	case p.updated <- struct{}{}:
	default:
	}
	return nil
}

// follow applies the peer's later snapshots until the connection ends.
func (e *CUDAEngine) follow(p *cudaPeer) {
	defer e.wg.Done()
	defer close(p.done)
	for {
		msg, err := cudaReadFrame(p.conn)
		if err == nil {
			err = e.applySnapshot(p, msg)
		}
		if err != nil {
			gone := fmt.Errorf("%w: %s: %v", ErrPeerGone, p.name, err)
			p.gone.Store(&gone)
			_ = p.conn.Close()
			return
		}
	}
}

// CloseSegment implements Engine.
func (e *CUDAEngine) CloseSegment(id SegmentID) error {
	e.mu.Lock()
	p, ok := e.peers[id]
	delete(e.peers, id)
	e.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %d", ErrUnknownSegment, id)
	}
	_ = p.conn.Close()
	<-p.done
	return nil
}

// RemoteRegions implements Engine.
func (e *CUDAEngine) RemoteRegions(id SegmentID) ([]Region, error) {
	e.mu.RLock()
	p, ok := e.peers[id]
	e.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("%w: %d", ErrUnknownSegment, id)
	}
	regs := *p.regs.Load()
	out := make([]Region, len(regs))
	for i, r := range regs {
		out[i] = r.Region
	}
	return out, nil
}
