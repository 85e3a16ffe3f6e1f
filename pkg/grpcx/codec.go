package grpcx

import (
	"context"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/encoding/proto"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
)

// decodeCodec is the server codec: protobuf, except that a message that does not decode
// (malformed wire bytes, a string field that is not UTF-8, a wrong wire type) is answered
// INVALID_ARGUMENT instead of grpc-go's INTERNAL ("failed to unmarshal"), which says the
// server is broken when the client sent garbage. grpc-go turns any codec error into INTERNAL,
// so Unmarshal records the failure against the message and reports success; the interceptors
// of the same server (DecodeCheck*) find the record before any handler runs and refuse the
// call (unary) or the received message (stream).
type decodeCodec struct {
	base encoding.CodecV2
	bad  sync.Map // message pointer (any) -> decode error
	// nbad counts the entries of bad: while it is 0 (every message decoded, the usual case) a
	// received message needs no lookup in bad.
	nbad atomic.Int64
}

func newDecodeCodec() *decodeCodec {
	return &decodeCodec{base: encoding.GetCodecV2(proto.Name)}
}

func (c *decodeCodec) Name() string { return c.base.Name() }

func (c *decodeCodec) Marshal(v any) (mem.BufferSlice, error) { return c.base.Marshal(v) }

func (c *decodeCodec) Unmarshal(data mem.BufferSlice, v any) error {
	if err := c.base.Unmarshal(data, v); err != nil {
		c.nbad.Add(1) // before the entry: take never misses a stored one
		if _, dup := c.bad.Swap(v, err); dup {
			c.nbad.Add(-1)
		}
	}
	return nil
}

// take returns (and forgets) the decode error recorded for m.
func (c *decodeCodec) take(m any) error {
	if c.nbad.Load() == 0 {
		return nil
	}
	if err, ok := c.bad.LoadAndDelete(m); ok {
		c.nbad.Add(-1)
		return status.Errorf(codes.InvalidArgument, "malformed request message: %v", err.(error))
	}
	return nil
}

// forget drops the decode error recorded for m, if any.
func (c *decodeCodec) forget(m any) {
	if c.nbad.Load() == 0 {
		return
	}
	if _, ok := c.bad.LoadAndDelete(m); ok {
		c.nbad.Add(-1)
	}
}

func (c *decodeCodec) unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := c.take(req); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func (c *decodeCodec) stream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	return h(srv, &decodeStream{ServerStream: ss, c: c})
}

type decodeStream struct {
	grpc.ServerStream
	c *decodeCodec
}

func (s *decodeStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		s.c.forget(m)
		return err
	}
	return s.c.take(m)
}
