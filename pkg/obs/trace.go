package obs

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Tracing configures OpenTelemetry traces for a binary (SetupTracing). The flags' fields win
// where set; otherwise the standard OTEL_* environment variables apply (docs/operations.md,
// "Tracing"): OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER (otlp or none),
// OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _PROTOCOL (grpc, the default here, or http/protobuf),
// _HEADERS, _TIMEOUT, _INSECURE, _CERTIFICATE, _COMPRESSION (read by the OTLP exporters),
// OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG (read by the SDK), OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES.
type Tracing struct {
	// Service is the service.name resource attribute (the binary's name) unless
	// OTEL_SERVICE_NAME names another.
	Service string
	// OTLPEndpoint is host:port of an OTLP/gRPC collector; "" leaves it to
	// OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, and without those (and OTEL_TRACES_EXPORTER=otlp)
	// nothing is exported (trace ids are still made and propagated, unsampled unless the caller
	// sampled: W3C traceparent to gRPC peers and workers, for correlation).
	OTLPEndpoint string
	// OTLPInsecure sends to the collector without TLS.
	OTLPInsecure bool
	// SampleRatio of new traces exported (a caller's sampled flag is followed); 0 means 1.
	// OTEL_TRACES_SAMPLER, when set, decides instead.
	SampleRatio float64
	// Exporter, when set, receives the spans instead of an OTLP endpoint (tests: an in-memory
	// exporter).
	Exporter sdktrace.SpanExporter
}

// Sampler names OTEL_TRACES_SAMPLER may take (the SDK builds them).
var envSamplers = map[string]bool{"always_on": true, "always_off": true, "traceidratio": true,
	"parentbased_always_on": true, "parentbased_always_off": true, "parentbased_traceidratio": true}

// unsampledParentsSampled is set by SetupTracing when the sampler it installs may record a span
// whose remote parent is not sampled (SamplesUnsampledParents).
var unsampledParentsSampled atomic.Bool

// SamplesUnsampledParents reports whether the TracerProvider SetupTracing installed may sample
// a span whose remote parent is not sampled: only an OTEL_TRACES_SAMPLER that is not parent-based
// (always_on, traceidratio). Every other configuration follows the parent's sampled flag, and
// without SetupTracing the global provider is otel's no-op one, which records nothing. A caller
// may then skip starting a span for an unsampled parent and pass the parent's context on
// instead (the control plane's decision spans: nothing would be recorded either way).
func SamplesUnsampledParents() bool { return unsampledParentsSampled.Load() }

// envSampler reports whether OTEL_TRACES_SAMPLER is set (and its name), refusing values the
// SDK would only log and ignore.
func envSampler() (bool, string, error) {
	name := strings.ToLower(strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER")))
	if name == "" {
		return false, "", nil
	}
	if !envSamplers[name] {
		return false, "", fmt.Errorf("OTEL_TRACES_SAMPLER=%q: want always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio", name)
	}
	if arg := strings.TrimSpace(os.Getenv("OTEL_TRACES_SAMPLER_ARG")); arg != "" && strings.HasSuffix(name, "traceidratio") {
		if r, err := strconv.ParseFloat(arg, 64); err != nil || r < 0 || r > 1 {
			return false, "", fmt.Errorf("OTEL_TRACES_SAMPLER_ARG=%q: want a ratio in [0, 1]", arg)
		}
	}
	return true, name, nil
}

// exporter is the span exporter t and the environment ask for (nil: none) and where it sends.
func exporter(ctx context.Context, t Tracing) (sdktrace.SpanExporter, string, error) {
	if t.Exporter != nil {
		return t.Exporter, "in-process", nil
	}
	if t.OTLPEndpoint != "" {
		opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(t.OTLPEndpoint)}
		if t.OTLPInsecure {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		exp, err := otlptracegrpc.New(ctx, opts...)
		if err != nil {
			return nil, "", fmt.Errorf("otlp exporter %s: %w", t.OTLPEndpoint, err)
		}
		return exp, t.OTLPEndpoint, nil
	}
	if v := strings.TrimSpace(os.Getenv("OTEL_SDK_DISABLED")); v != "" {
		off, err := strconv.ParseBool(v)
		if err != nil {
			return nil, "", fmt.Errorf("OTEL_SDK_DISABLED=%q: want true or false", v)
		}
		if off {
			return nil, "", nil
		}
	}
	switch kind := strings.TrimSpace(os.Getenv("OTEL_TRACES_EXPORTER")); kind {
	case "none":
		return nil, "", nil
	case "otlp":
	case "":
		if os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") == "" && os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT") == "" {
			return nil, "", nil
		}
	default:
		return nil, "", fmt.Errorf("OTEL_TRACES_EXPORTER=%q: want otlp or none", kind)
	}
	where := cmp.Or(os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT"), "the OTLP default endpoint")
	switch proto := cmp.Or(os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"), os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL"), "grpc"); proto {
	case "grpc":
		var opts []otlptracegrpc.Option
		if t.OTLPInsecure {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		exp, err := otlptracegrpc.New(ctx, opts...)
		if err != nil {
			return nil, "", fmt.Errorf("otlp/grpc exporter %s: %w", where, err)
		}
		return exp, where, nil
	case "http/protobuf":
		var opts []otlptracehttp.Option
		if t.OTLPInsecure {
			opts = append(opts, otlptracehttp.WithInsecure())
		}
		exp, err := otlptracehttp.New(ctx, opts...)
		if err != nil {
			return nil, "", fmt.Errorf("otlp/http exporter %s: %w", where, err)
		}
		return exp, where, nil
	default:
		return nil, "", fmt.Errorf("OTEL_EXPORTER_OTLP_PROTOCOL=%q: want grpc or http/protobuf", proto)
	}
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
	fromEnv, envName, err := envSampler()
	if err != nil {
		return nil, err
	}
	res, err := resource.New(ctx, resource.WithAttributes(attribute.String("service.name", t.Service)), resource.WithFromEnv())
	if err != nil {
		return nil, fmt.Errorf("trace resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES): %w", err)
	}
	exp, _, err := exporter(ctx, t)
	if err != nil {
		return nil, err
	}
	popts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	// Without an exporter nothing is recorded for new traces (ids are still made and
	// propagated, not sampled); a caller's sampled flag is followed either way, so the
	// caller's own tracing reaches the workers intact. With one, OTEL_TRACES_SAMPLER (read by
	// the SDK) or else the ratio decides.
	switch {
	case exp == nil:
		popts = append(popts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())))
	case !fromEnv:
		popts = append(popts, sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))))
	}
	if exp != nil {
		if t.Exporter != nil {
			popts = append(popts, sdktrace.WithSyncer(exp))
		} else {
			popts = append(popts, sdktrace.WithBatcher(exp))
		}
	}
	tp := sdktrace.NewTracerProvider(popts...)
	// With an exporter and OTEL_TRACES_SAMPLER set the SDK's sampler decides; only its
	// non-parent-based ones sample under an unsampled parent.
	unsampledParentsSampled.Store(exp != nil && fromEnv && !strings.HasPrefix(envName, "parentbased_"))
	otel.SetTracerProvider(tp)
	return func(ctx context.Context) error {
		return errors.Join(tp.Shutdown(ctx))
	}, nil
}
