package obs

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// otelEnv clears every OTEL_* variable the set-up reads, then sets kv.
func otelEnv(t *testing.T, kv map[string]string) {
	t.Helper()
	for _, k := range []string{"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_HEADERS",
		"OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"} {
		t.Setenv(k, kv[k]) // restored after the test
		if kv[k] == "" {
			_ = os.Unsetenv(k) // unset, not empty: the SDK refuses an empty OTEL_TRACES_SAMPLER
		}
	}
	prevTP, prevProp := otel.GetTracerProvider(), otel.GetTextMapPropagator()
	t.Cleanup(func() { otel.SetTracerProvider(prevTP); otel.SetTextMapPropagator(prevProp) })
}

type collector struct {
	coltrace.UnimplementedTraceServiceServer
	got chan *coltrace.ExportTraceServiceRequest
}

func (c *collector) Export(_ context.Context, r *coltrace.ExportTraceServiceRequest) (*coltrace.ExportTraceServiceResponse, error) {
	c.got <- r
	return &coltrace.ExportTraceServiceResponse{}, nil
}

// exported is the service.name and span names of one export request.
func exported(r *coltrace.ExportTraceServiceRequest) (service, attrs string, spans []string) {
	for _, rs := range r.GetResourceSpans() {
		for _, a := range rs.GetResource().GetAttributes() {
			if a.GetKey() == "service.name" {
				service = a.GetValue().GetStringValue()
			}
			attrs += a.GetKey() + "=" + a.GetValue().GetStringValue() + ";"
		}
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				spans = append(spans, s.GetName())
			}
		}
	}
	return service, attrs, spans
}

// emit starts and ends one root span, then flushes through stop.
func emit(t *testing.T, stop func(context.Context) error, name string) {
	t.Helper()
	_, s := otel.Tracer("t").Start(t.Context(), name)
	s.End()
	if err := stop(t.Context()); err != nil {
		t.Fatalf("flush: %v", err)
	}
}

// TestTracingFromEnvOTLP: with no --otlp-endpoint, OTEL_EXPORTER_OTLP_ENDPOINT sends the spans to
// a real collector, over gRPC (the default here) or OTLP/HTTP (OTEL_EXPORTER_OTLP_PROTOCOL), and
// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the resource.
func TestTracingFromEnvOTLP(t *testing.T) {
	t.Run("grpc", func(t *testing.T) {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		col := &collector{got: make(chan *coltrace.ExportTraceServiceRequest, 4)}
		srv := grpc.NewServer()
		coltrace.RegisterTraceServiceServer(srv, col)
		go func() { _ = srv.Serve(lis) }()
		defer srv.Stop()
		otelEnv(t, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://" + lis.Addr().String(),
			"OTEL_SERVICE_NAME": "gw-from-env", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"})
		stop, err := SetupTracing(t.Context(), Tracing{Service: "kvc-gateway"})
		if err != nil {
			t.Fatal(err)
		}
		emit(t, stop, "over-grpc")
		svc, attrs, spans := exported(<-col.got)
		if svc != "gw-from-env" || !strings.Contains(attrs, "deployment.environment=test") || len(spans) != 1 || spans[0] != "over-grpc" {
			t.Fatalf("collector got service %q attrs %q spans %v", svc, attrs, spans)
		}
	})
	t.Run("http/protobuf", func(t *testing.T) {
		got := make(chan *coltrace.ExportTraceServiceRequest, 4)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			req := &coltrace.ExportTraceServiceRequest{}
			if r.URL.Path != "/v1/traces" || proto.Unmarshal(b, req) != nil {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			got <- req
			w.Header().Set("Content-Type", "application/x-protobuf")
			out, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
			_, _ = w.Write(out)
		}))
		defer srv.Close()
		otelEnv(t, map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
		stop, err := SetupTracing(t.Context(), Tracing{Service: "kvc-controlplane"})
		if err != nil {
			t.Fatal(err)
		}
		emit(t, stop, "over-http")
		svc, _, spans := exported(<-got)
		if svc != "kvc-controlplane" || len(spans) != 1 || spans[0] != "over-http" {
			t.Fatalf("collector got service %q spans %v", svc, spans)
		}
	})
}

// TestTracingEnvSamplerAndOff: OTEL_TRACES_SAMPLER decides over the ratio; OTEL_TRACES_EXPORTER=none
// and OTEL_SDK_DISABLED=true export nothing; values the SDK would ignore are refused.
func TestTracingEnvSamplerAndOff(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     map[string]string
		ratio   float64
		wantErr string
		sampled bool
	}{
		{name: "ratio alone", ratio: 1, sampled: true},
		{name: "always_off beats ratio 1", env: map[string]string{"OTEL_TRACES_SAMPLER": "always_off"}, ratio: 1},
		{name: "traceidratio 0 beats ratio 1", env: map[string]string{"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, ratio: 1},
		{name: "always_on beats a tiny ratio", env: map[string]string{"OTEL_TRACES_SAMPLER": "always_on"}, ratio: 1e-12, sampled: true},
		{name: "bad sampler", env: map[string]string{"OTEL_TRACES_SAMPLER": "sometimes"}, wantErr: "OTEL_TRACES_SAMPLER"},
		{name: "bad sampler arg", env: map[string]string{"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, wantErr: "OTEL_TRACES_SAMPLER_ARG"},
		{name: "bad resource", env: map[string]string{"OTEL_RESOURCE_ATTRIBUTES": "no-equals-sign"}, wantErr: "OTEL_RESOURCE_ATTRIBUTES"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			otelEnv(t, tc.env)
			exp := tracetest.NewInMemoryExporter()
			stop, err := SetupTracing(t.Context(), Tracing{Service: "x", SampleRatio: tc.ratio, Exporter: exp})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			_, s := otel.Tracer("t").Start(t.Context(), "root")
			s.End()
			n := len(exp.GetSpans()) // before the shutdown, which empties the in-memory exporter
			_ = stop(t.Context())
			if (n == 1) != tc.sampled {
				t.Fatalf("%d spans exported, want sampled=%v", n, tc.sampled)
			}
		})
	}
	// An endpoint in the environment, but exporting turned off: nothing is sampled.
	for _, off := range []map[string]string{
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_TRACES_EXPORTER": "none"},
		{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"},
		{},
	} {
		otelEnv(t, off)
		stop, err := SetupTracing(t.Context(), Tracing{Service: "x"})
		if err != nil {
			t.Fatal(err)
		}
		_, s := otel.Tracer("t").Start(t.Context(), "root")
		if s.SpanContext().IsSampled() {
			t.Fatalf("%v: new trace sampled without an exporter", off)
		}
		s.End()
		_ = stop(t.Context())
	}
	for env, want := range map[string]string{"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_SDK_DISABLED": "maybe"} {
		otelEnv(t, map[string]string{env: want, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
		if _, err := SetupTracing(t.Context(), Tracing{Service: "x"}); err == nil || !strings.Contains(err.Error(), env) {
			t.Fatalf("%s=%s: err %v, want one naming it", env, want, err)
		}
	}
}
