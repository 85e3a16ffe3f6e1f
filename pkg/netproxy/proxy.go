package netproxy

import (
	"errors"
	"net"
	"sync"
)

// Proxy forwards TCP connections from Addr() to a target.
type Proxy struct {
	lis    net.Listener
	target string

	mu      sync.Mutex
	holed   bool
	healed  chan struct{} // closed while not black-holed; replaced by Blackhole
	closed  bool
	conns   map[net.Conn]struct{}
	wg      sync.WaitGroup
	accepts int
}

// New listens on 127.0.0.1:0 and forwards to target (host:port).
func New(target string) (*Proxy, error) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{lis: lis, target: target, healed: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	close(p.healed)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's listen address (host:port).
func (p *Proxy) Addr() string { return p.lis.Addr().String() }

// Target is the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// Blackhole stops forwarding bytes in both directions; connections stay open.
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.holed {
		p.holed = true
		p.healed = make(chan struct{})
	}
}

// Heal resumes forwarding (held bytes flow in order).
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.holed {
		p.holed = false
		close(p.healed)
	}
}

// Blackholed reports whether the link is black-holed.
func (p *Proxy) Blackholed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.holed
}

// Accepted counts connections accepted so far.
func (p *Proxy) Accepted() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.accepts
}

// Conns is the number of open proxied connections.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns) / 2
}

// Close stops accepting, closes every connection and waits for the proxy's goroutines.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	err := p.lis.Close()
	for c := range p.conns {
		_ = c.Close()
	}
	if p.holed { // release copiers waiting for Heal
		p.holed = false
		close(p.healed)
	}
	p.mu.Unlock()
	p.wg.Wait()
	return err
}

// wait blocks while the link is black-holed; false once the proxy is closed.
func (p *Proxy) wait() bool {
	p.mu.Lock()
	ch, closed := p.healed, p.closed
	p.mu.Unlock()
	<-ch
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.closed && !closed
}

func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) untrack(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		down, err := p.lis.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		p.mu.Lock()
		p.accepts++
		p.mu.Unlock()
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = down.Close() // the target is down: refuse as it would
			continue
		}
		if !p.track(down, up) {
			_ = down.Close()
			_ = up.Close()
			return
		}
		p.wg.Add(2)
		var once sync.Once
		done := func() {
			once.Do(func() {
				_ = down.Close()
				_ = up.Close()
				p.untrack(down, up)
			})
		}
		go p.pipe(up, down, done)
		go p.pipe(down, up, done)
	}
}

// pipe copies src to dst, holding bytes while black-holed. When src ends, both connections
// close (the peer sees the end as soon as the link is healed).
func (p *Proxy) pipe(dst, src net.Conn, done func()) {
	defer p.wg.Done()
	defer done()
	buf := make([]byte, 32<<10)
	for {
		if !p.wait() { // do not even read while black-holed: the sender's buffers fill
			return
		}
		n, err := src.Read(buf)
		if n > 0 {
			if !p.wait() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			p.wait() // the end (FIN or RST) crosses the link only once it is healed
			return
		}
	}
}
