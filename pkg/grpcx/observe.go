package grpcx

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	"google.golang.org/grpc"
)

// Per-method gRPC metrics of this process (metrics.go: the names, labels and counting of
// go-grpc-middleware's Prometheus provider, with a stream's counters looked up once per call):
// every server built by NewServer and every client dialled with ClientOptions/DialOptions
// records into them; RegisterMetrics exposes them in a registry (obs.NewRegistry does it).
//
//	grpc_server_started_total, grpc_server_handled_total{grpc_code}, grpc_server_msg_received_total,
//	grpc_server_msg_sent_total, grpc_server_handling_seconds (histogram)
//	grpc_client_started_total, grpc_client_handled_total{grpc_code}, grpc_client_msg_received_total,
//	grpc_client_msg_sent_total, grpc_client_handling_seconds (histogram)
//
// each with grpc_type, grpc_service and grpc_method labels.
var (
	serverMetrics = newServerMetrics()
	clientMetrics = newClientMetrics()
)

// RegisterMetrics adds the process's per-method gRPC server and client metrics to reg (again
// in the same registry is a no-op).
func RegisterMetrics(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{serverMetrics, clientMetrics} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// tracePropagator is W3C Trace Context: the traceparent/tracestate gRPC metadata every
// server and client reads and writes, whatever global propagator the binary installed.
var tracePropagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// serverObserve are the server options for metrics and traces: an OpenTelemetry span per call
// (the global TracerProvider: a no-op one unless the binary set up tracing with obs), child of
// the caller's span when its metadata carries a traceparent.
func serverObserve() []grpc.ServerOption {
	return []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithPropagators(tracePropagator)))}
}

// clientObserve are the dial options for metrics and traces: a span per call, and the calling
// context's trace sent as traceparent metadata.
func clientObserve() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithPropagators(tracePropagator))),
		grpc.WithChainUnaryInterceptor(clientMetrics.unaryClient),
		grpc.WithChainStreamInterceptor(clientMetrics.streamClient),
	}
}
