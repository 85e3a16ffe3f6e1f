package netproxy

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// echoServer echoes every connection until the test ends.
func echoServer(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = lis.Close() })
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	return lis.Addr().String()
}

func newProxy(t *testing.T, target string) *Proxy {
	t.Helper()
	p, err := New(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func roundTrip(t *testing.T, c net.Conn, msg []byte) {
	t.Helper()
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo %q, want %q", got, msg)
	}
}

func TestForwardBlackholeHeal(t *testing.T) {
	p := newProxy(t, echoServer(t))
	c := dial(t, p.Addr())
	roundTrip(t, c, []byte("before"))

	p.Blackhole()
	if !p.Blackholed() {
		t.Fatal("not black-holed")
	}
	msg := bytes.Repeat([]byte("held"), 1000)
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	// Nothing may come back while black-holed, and the connection must stay open: a read
	// times out (it neither returns data nor EOF/RST).
	_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	one := make([]byte, 1)
	if n, err := c.Read(one); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read while black-holed: n=%d err=%v", n, err)
	}
	// A new connection is accepted but carries nothing either.
	c2 := dial(t, p.Addr())
	if _, err := c2.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	_ = c2.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, err := c2.Read(one); n != 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("new conn while black-holed: n=%d err=%v", n, err)
	}

	p.Heal()
	got := make([]byte, len(msg))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("held bytes after heal: err %v, equal %v", err, bytes.Equal(got, msg))
	}
	_ = c2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c2, one); err != nil || one[0] != 'x' {
		t.Fatalf("second conn after heal: %q %v", one, err)
	}
	roundTrip(t, c, []byte("after"))
	if p.Accepted() != 2 || p.Conns() != 2 {
		t.Fatalf("accepted %d conns %d", p.Accepted(), p.Conns())
	}
}

func TestPeerCloseCrossesOnlyAfterHeal(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	p := newProxy(t, lis.Addr().String())
	c := dial(t, p.Addr())
	srv, err := lis.Accept()
	if err != nil {
		t.Fatal(err)
	}
	p.Blackhole()
	_ = srv.Close()
	one := make([]byte, 1)
	_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if _, err := c.Read(one); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("close crossed the black hole: %v", err)
	}
	p.Heal()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(one); !errors.Is(err, io.EOF) {
		t.Fatalf("after heal: %v, want EOF", err)
	}
}

func TestTargetDownAndClose(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	_ = lis.Close()
	p := newProxy(t, addr)
	c := dial(t, p.Addr())
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("target down: %v, want EOF", err)
	}

	q := newProxy(t, echoServer(t))
	c = dial(t, q.Addr())
	roundTrip(t, c, []byte("x"))
	q.Blackhole()
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Fatal("connection open after Close")
	}
	if _, err := net.DialTimeout("tcp", q.Addr(), time.Second); err == nil {
		t.Fatal("still accepting after Close")
	}
	_ = q.Close() // idempotent
}
