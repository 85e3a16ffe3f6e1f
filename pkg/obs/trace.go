package obs

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Tracing configures OpenTelemetry traces for a binary (SetupTracing).
type Tracing struct {
	// Service is the service.name resource attribute (the binary's name).
	Service string
	// OTLPEndpoint is host:port of an OTLP/gRPC collector; "" exports nothing (trace ids are
	// still made and propagated, unsampled unless the caller sampled: W3C traceparent to gRPC
	// peers and workers, for correlation).
	OTLPEndpoint string
	// OTLPInsecure sends to the collector without TLS.
	OTLPInsecure bool
	// SampleRatio of new traces exported (a caller's sampled flag is followed); 0 means 1.
	SampleRatio float64
	// Exporter, when set, receives the spans instead of an OTLP endpoint (tests: an in-memory
	// exporter).
	Exporter sdktrace.SpanExporter
}

// SetupTracing installs the global TracerProvider and the W3C Trace Context propagator. The
// returned shutdown flushes and stops the exporter (bounded by its ctx).
func SetupTracing(ctx context.Context, t Tracing) (shutdown func(context.Context) error, err error) {
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	ratio := t.SampleRatio
	if ratio == 0 {
		ratio = 1
	}
	if ratio < 0 || ratio > 1 {
		return nil, fmt.Errorf("trace sample ratio %v out of (0, 1]", ratio)
	}
	exp := t.Exporter
	if exp == nil && t.OTLPEndpoint != "" {
		opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(t.OTLPEndpoint)}
		if t.OTLPInsecure {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		if exp, err = otlptracegrpc.New(ctx, opts...); err != nil {
			return nil, fmt.Errorf("otlp exporter %s: %w", t.OTLPEndpoint, err)
		}
	}
	res := resource.NewSchemaless(attribute.String("service.name", t.Service))
	// Without an exporter nothing is recorded for new traces (ids are still made and
	// propagated, not sampled); a caller's sampled flag is followed either way, so the
	// caller's own tracing reaches the workers intact.
	root := sdktrace.TraceIDRatioBased(ratio)
	if exp == nil {
		root = sdktrace.NeverSample()
	}
	popts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res), sdktrace.WithSampler(sdktrace.ParentBased(root))}
	if exp != nil {
		if t.Exporter != nil {
			popts = append(popts, sdktrace.WithSyncer(exp))
		} else {
			popts = append(popts, sdktrace.WithBatcher(exp))
		}
	}
	tp := sdktrace.NewTracerProvider(popts...)
	otel.SetTracerProvider(tp)
	return func(ctx context.Context) error {
		return errors.Join(tp.Shutdown(ctx))
	}, nil
}
