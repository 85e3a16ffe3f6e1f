package obs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
)

// NewLogger returns a JSON zerolog logger (or a console one when format is "console") at level.
func NewLogger(w io.Writer, level, format, component string) (zerolog.Logger, error) {
	if w == nil {
		w = os.Stderr
	}
	lvl, err := zerolog.ParseLevel(strings.ToLower(level))
	if err != nil || level == "" {
		return zerolog.Nop(), fmt.Errorf("invalid log level %q (want debug, info, warn, error)", level)
	}
	switch format {
	case "", "json":
	case "console":
		w = zerolog.ConsoleWriter{Out: w, TimeFormat: time.RFC3339}
	default:
		return zerolog.Nop(), fmt.Errorf("invalid log format %q (want json or console)", format)
	}
	return zerolog.New(w).Level(lvl).With().Timestamp().Str("component", component).Logger(), nil
}

// NewRegistry returns a Prometheus registry with the Go and process collectors and the
// process's per-method gRPC server and client metrics (grpcx.RegisterMetrics).
func NewRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := grpcx.RegisterMetrics(r); err != nil {
		panic(err) // a fresh registry: only a programming error can collide
	}
	return r
}

// Ready is a readiness flag for /readyz.
type Ready struct{ v atomic.Bool }

// Set marks the process ready (or not).
func (r *Ready) Set(ok bool) { r.v.Store(ok) }

// Get reports readiness.
func (r *Ready) Get() bool { return r.v.Load() }

// HTTPServer serves /metrics, /healthz, /readyz and any extra handlers.
type HTTPServer struct {
	Mux      *http.ServeMux
	srv      *http.Server
	ready    *Ready
	inflight atomic.Int64
}

// NewHTTPServer builds the observability HTTP server around reg and ready: /metrics (none when
// reg is nil: a public listener whose metrics are served on a separate admin listener),
// /healthz and /readyz.
func NewHTTPServer(reg *prometheus.Registry, ready *Ready) *HTTPServer {
	mux := http.NewServeMux()
	if reg != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		if ready != nil && !ready.Get() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, "not ready\n")
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
	return &HTTPServer{Mux: mux, ready: ready, srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}}
}

// Serve serves on lis until ctx is done, then shuts down (in-flight requests get 5 s).
func (h *HTTPServer) Serve(ctx context.Context, lis net.Listener) error {
	return h.ServeGraceful(ctx, lis, Graceful{Grace: 5 * time.Second})
}

// Graceful is how a server stops (ServeGraceful).
type Graceful struct {
	// NotReady is marked not ready first, before anything else changes (nil: none).
	NotReady *Ready
	// Delay keeps accepting new requests this long after the readiness flip, so that load
	// balancers probing /readyz stop sending before the listener closes (0: close at once).
	Delay time.Duration
	// Grace bounds the wait for in-flight requests (streams included) once the listener is
	// closed; those still running then are cut.
	Grace time.Duration
	// OnStop, when set, is told each phase ("not_ready", "closed", "drained" or "cut") and the
	// requests in flight at that moment.
	OnStop func(phase string, inflight int64)
}

// ServeGraceful serves on lis until ctx is done, then stops in order: readiness off, Delay,
// listener closed (new connections refused), in-flight requests waited for up to Grace, the
// rest cut. It returns nil after a stop, or the serve error.
func (h *HTTPServer) ServeGraceful(ctx context.Context, lis net.Listener, g Graceful) error {
	h.srv.Handler = h.counting(h.srv.Handler)
	errc := make(chan error, 1)
	go func() { errc <- h.srv.Serve(lis) }()
	select {
	case err := <-errc:
		if errors.Is(err, http.ErrServerClosed) {
			return nil
		}
		return err
	case <-ctx.Done():
	}
	report := func(phase string) {
		if g.OnStop != nil {
			g.OnStop(phase, h.inflight.Load())
		}
	}
	if g.NotReady != nil {
		g.NotReady.Set(false)
		report("not_ready")
	}
	if g.Delay > 0 {
		t := time.NewTimer(g.Delay)
		<-t.C
	}
	sctx, cancel := context.WithTimeout(context.Background(), g.Grace)
	defer cancel()
	shut := make(chan error, 1)
	go func() { shut <- h.srv.Shutdown(sctx) }()
	report("closed")
	if err := <-shut; err != nil {
		report("cut")
		_ = h.srv.Close()
	} else {
		report("drained")
	}
	<-errc
	return nil
}

func (h *HTTPServer) counting(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.inflight.Add(1)
		defer h.inflight.Add(-1)
		next.ServeHTTP(w, r)
	})
}
