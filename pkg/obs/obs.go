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

// NewRegistry returns a Prometheus registry with the Go and process collectors.
func NewRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
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
	Mux   *http.ServeMux
	srv   *http.Server
	ready *Ready
}

// NewHTTPServer builds the observability HTTP server around reg and ready.
func NewHTTPServer(reg *prometheus.Registry, ready *Ready) *HTTPServer {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
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

// Serve serves on lis until ctx is done, then shuts down.
func (h *HTTPServer) Serve(ctx context.Context, lis net.Listener) error {
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
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = h.srv.Shutdown(sctx)
	<-errc
	return nil
}
