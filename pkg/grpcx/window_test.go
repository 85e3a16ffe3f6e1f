package grpcx

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// tapListener records every byte its connections read (the client's frames) and write (the
// server's).
type tapListener struct {
	net.Listener
	mu       sync.Mutex
	in, out  bytes.Buffer
	accepted int
}

func (l *tapListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	l.mu.Lock()
	l.accepted++
	l.mu.Unlock()
	return &tapConn{Conn: c, l: l}, nil
}

type tapConn struct {
	net.Conn
	l *tapListener
}

func (c *tapConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.l.mu.Lock()
	c.l.in.Write(p[:n])
	c.l.mu.Unlock()
	return n, err
}

func (c *tapConn) Write(p []byte) (int, error) {
	c.l.mu.Lock()
	c.l.out.Write(p)
	c.l.mu.Unlock()
	return c.Conn.Write(p)
}

// pings counts the PING frames (acks included) in b, an HTTP/2 byte stream (after the client
// preface when client is set).
func pings(t *testing.T, b []byte, client bool) (n int) {
	t.Helper()
	if client {
		if !bytes.HasPrefix(b, []byte(http2.ClientPreface)) {
			t.Fatalf("client bytes do not start with the HTTP/2 preface")
		}
		b = b[len(http2.ClientPreface):]
	}
	fr := http2.NewFramer(nil, bytes.NewReader(b))
	fr.SetMaxReadFrameSize(1 << 24)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
				return n // the capture may end inside a frame
			}
			t.Fatalf("reading the captured frames: %v", err)
		}
		if _, ok := f.(*http2.PingFrame); ok {
			n++
		}
	}
}

// TestStaticFlowControlWindows: our servers and clients use static HTTP/2 windows
// (StreamWindow, ConnWindow), so a stream of small messages carries no flow-control PING
// frames: with grpc-go's dynamic windows each side's bandwidth-delay estimator sends a PING
// (and the peer an ack) about once per round trip of data, extra frames to write, read and
// wake up for on a Route stream (issue 22 item 5).
func TestStaticFlowControlWindows(t *testing.T) {
	srv := NewServer(zerolog.Nop(), WithCallLogging(false))
	kvcv1.RegisterRouterServiceServer(srv, echoRouter{})
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lis := &tapListener{Listener: inner}
	ctx := t.Context()
	done := make(chan error, 1)
	sctx, stop := context.WithCancel(ctx)
	go func() { done <- srv.Serve(sctx, lis, time.Second) }()
	defer func() { stop(); <-done }()
	conn, err := grpc.NewClient(inner.Addr().String(), append(ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	st, err := kvcv1.NewRouterServiceClient(conn).Route(ctx)
	if err != nil {
		t.Fatal(err)
	}
	req := &kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Outcome{Outcome: &kvcv1.RouteOutcome{DecisionId: "d1", Success: true}}}
	pingPong(t, st, req, 200)
	if err := conn.Close(); err != nil {
		t.Fatal(err)
	}
	lis.mu.Lock()
	in, out, accepted := bytes.Clone(lis.in.Bytes()), bytes.Clone(lis.out.Bytes()), lis.accepted
	lis.mu.Unlock()
	if accepted != 1 {
		t.Fatalf("%d connections accepted, want 1", accepted)
	}
	if n := pings(t, in, true); n != 0 {
		t.Errorf("the client sent %d PING frames for 200 messages each way, want 0 (dynamic flow-control windows)", n)
	}
	if n := pings(t, out, false); n != 0 {
		t.Errorf("the server sent %d PING frames for 200 messages each way, want 0 (dynamic flow-control windows)", n)
	}
}
