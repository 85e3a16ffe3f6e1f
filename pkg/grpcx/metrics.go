package grpcx

import (
	"context"
	"errors"
	"io"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// rpcMetrics are one side's (server or client) per-method gRPC metrics, with the names, labels
// and counting of go-grpc-middleware's Prometheus provider (which this package used before):
// started and handled calls, messages received and sent (a unary call counts one each way),
// handling time. A call looks its labelled counters up once when it starts; a stream's
// messages then cost one atomic add each instead of a label lookup per message.
type rpcMetrics struct {
	started, handled, received, sent *prometheus.CounterVec
	handling                         *prometheus.HistogramVec
}

// rpcBuckets are the handling-time histograms' buckets (seconds).
var rpcBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

func newServerMetrics() *rpcMetrics {
	labels := []string{"grpc_type", "grpc_service", "grpc_method"}
	return &rpcMetrics{
		started: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_server_started_total",
			Help: "Total number of RPCs started on the server."}, labels),
		handled: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_server_handled_total",
			Help: "Total number of RPCs completed on the server, regardless of success or failure."}, append(labels, "grpc_code")),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_server_msg_received_total",
			Help: "Total number of RPC stream messages received on the server."}, labels),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_server_msg_sent_total",
			Help: "Total number of gRPC stream messages sent by the server."}, labels),
		handling: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "grpc_server_handling_seconds",
			Help:    "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
			Buckets: rpcBuckets}, labels),
	}
}

func newClientMetrics() *rpcMetrics {
	labels := []string{"grpc_type", "grpc_service", "grpc_method"}
	return &rpcMetrics{
		started: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_client_started_total",
			Help: "Total number of RPCs started on the client."}, labels),
		handled: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_client_handled_total",
			Help: "Total number of RPCs completed by the client, regardless of success or failure."}, append(labels, "grpc_code")),
		received: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_client_msg_received_total",
			Help: "Total number of RPC stream messages received by the client."}, labels),
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_client_msg_sent_total",
			Help: "Total number of gRPC stream messages sent by the client."}, labels),
		handling: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "grpc_client_handling_seconds",
			Help:    "Histogram of response latency (seconds) of the gRPC until it is finished by the application.",
			Buckets: rpcBuckets}, labels),
	}
}

// Describe implements prometheus.Collector.
func (m *rpcMetrics) Describe(ch chan<- *prometheus.Desc) {
	m.started.Describe(ch)
	m.handled.Describe(ch)
	m.received.Describe(ch)
	m.sent.Describe(ch)
	m.handling.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *rpcMetrics) Collect(ch chan<- prometheus.Metric) {
	m.started.Collect(ch)
	m.handled.Collect(ch)
	m.received.Collect(ch)
	m.sent.Collect(ch)
	m.handling.Collect(ch)
}

// The grpc_type label's values.
const (
	typeUnary        = "unary"
	typeClientStream = "client_stream"
	typeServerStream = "server_stream"
	typeBidiStream   = "bidi_stream"
)

func streamType(clientStreams, serverStreams bool) string {
	switch {
	case !clientStreams && !serverStreams:
		return typeUnary
	case clientStreams && !serverStreams:
		return typeClientStream
	case !clientStreams && serverStreams:
		return typeServerStream
	}
	return typeBidiStream
}

// splitMethod splits "/package.Service/Method" into its service and method.
func splitMethod(full string) (service, method string) {
	full = strings.TrimPrefix(full, "/")
	if i := strings.IndexByte(full, '/'); i >= 0 {
		return full[:i], full[i+1:]
	}
	return "unknown", "unknown"
}

// InitializeMetrics sets every metric of every method registered on s at 0, so that a method
// never called is listed (Serve calls it).
func (m *rpcMetrics) InitializeMetrics(s *grpc.Server) {
	for service, info := range s.GetServiceInfo() {
		for _, mi := range info.Methods {
			lv := []string{streamType(mi.IsClientStream, mi.IsServerStream), service, mi.Name}
			_, _ = m.started.GetMetricWithLabelValues(lv...)
			_, _ = m.received.GetMetricWithLabelValues(lv...)
			_, _ = m.sent.GetMetricWithLabelValues(lv...)
			_, _ = m.handling.GetMetricWithLabelValues(lv...)
			for _, c := range allCodes {
				_, _ = m.handled.GetMetricWithLabelValues(lv[0], lv[1], lv[2], c.String())
			}
		}
	}
}

var allCodes = []codes.Code{
	codes.OK, codes.Canceled, codes.Unknown, codes.InvalidArgument, codes.DeadlineExceeded, codes.NotFound,
	codes.AlreadyExists, codes.PermissionDenied, codes.Unauthenticated, codes.ResourceExhausted,
	codes.FailedPrecondition, codes.Aborted, codes.OutOfRange, codes.Unimplemented, codes.Internal,
	codes.Unavailable, codes.DataLoss,
}

// call is one call's counters, looked up when it starts.
type call struct {
	m                    *rpcMetrics
	typ, service, method string
	received, sent       prometheus.Counter
	start                time.Time
}

func (m *rpcMetrics) begin(typ, fullMethod string) *call {
	service, method := splitMethod(fullMethod)
	c := &call{m: m, typ: typ, service: service, method: method, start: time.Now(),
		received: m.received.WithLabelValues(typ, service, method),
		sent:     m.sent.WithLabelValues(typ, service, method)}
	m.started.WithLabelValues(typ, service, method).Inc()
	return c
}

// end counts the call handled with err's code (a context error as the server itself reports
// it) and observes its handling time.
func (c *call) end(err error) {
	st, ok := status.FromError(err)
	if !ok {
		st = status.FromContextError(err)
	}
	c.m.handled.WithLabelValues(c.typ, c.service, c.method, st.Code().String()).Inc()
	c.m.handling.WithLabelValues(c.typ, c.service, c.method).Observe(time.Since(c.start).Seconds())
}

func (m *rpcMetrics) unaryServer(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	c := m.begin(typeUnary, info.FullMethod)
	c.received.Inc()
	resp, err := h(ctx, req)
	c.sent.Inc()
	c.end(err)
	return resp, err
}

func (m *rpcMetrics) streamServer(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	c := m.begin(streamType(info.IsClientStream, info.IsServerStream), info.FullMethod)
	err := h(srv, &countedServerStream{ServerStream: ss, c: c})
	c.end(err)
	return err
}

// countedServerStream counts every SendMsg and RecvMsg call (as the provider did: a failed
// one, the end of the stream included, too).
type countedServerStream struct {
	grpc.ServerStream
	c *call
}

func (s *countedServerStream) SendMsg(m any) error {
	err := s.ServerStream.SendMsg(m)
	s.c.sent.Inc()
	return err
}

func (s *countedServerStream) RecvMsg(m any) error {
	err := s.ServerStream.RecvMsg(m)
	s.c.received.Inc()
	return err
}

func (m *rpcMetrics) unaryClient(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	c := m.begin(typeUnary, method)
	c.sent.Inc()
	err := invoker(ctx, method, req, reply, cc, opts...)
	c.received.Inc()
	c.end(err)
	return err
}

func (m *rpcMetrics) streamClient(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	c := m.begin(streamType(desc.ClientStreams, desc.ServerStreams), method)
	cs, err := streamer(ctx, desc, cc, method, opts...)
	if err != nil {
		c.end(err)
		return nil, err
	}
	return &countedClientStream{ClientStream: cs, c: c, serverStreams: desc.ServerStreams}, nil
}

// countedClientStream counts every SendMsg and RecvMsg call; the call is handled when a
// server-streaming call's RecvMsg fails (io.EOF: OK), or at a client-streaming call's RecvMsg.
type countedClientStream struct {
	grpc.ClientStream
	c             *call
	serverStreams bool
}

func (s *countedClientStream) SendMsg(m any) error {
	err := s.ClientStream.SendMsg(m)
	s.c.sent.Inc()
	return err
}

func (s *countedClientStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	s.c.received.Inc()
	if s.serverStreams {
		if err == nil {
			return nil
		}
		if errors.Is(err, io.EOF) {
			s.c.end(nil)
		} else {
			s.c.end(err)
		}
		return err
	}
	s.c.end(err)
	return err
}
