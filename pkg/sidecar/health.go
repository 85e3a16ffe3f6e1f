package sidecar

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Worker health defaults (--worker-health-interval, --worker-health-threshold,
// --worker-health-timeout).
const (
	DefaultHealthInterval  = time.Second
	DefaultHealthThreshold = 3
	DefaultHealthTimeout   = time.Second
)

// HealthConfig configures WorkerHealth.
type HealthConfig struct {
	// URL is the worker's HTTP base URL; GET URL/health is probed. Empty: no probe (a closed
	// bridge connection alone then marks the worker down).
	URL string
	// Interval between probes (0: no periodic probe; a closed bridge still probes once).
	Interval time.Duration
	// Threshold is the number of consecutive failed probes that mark the worker down (3).
	Threshold int
	// Timeout of one probe (1s).
	Timeout time.Duration
	// Client does the probes (default: a plain client without keep-alive reuse across deaths).
	Client *http.Client
	// OnChange is called on every transition, one call at a time, from Run's goroutine.
	OnChange func(down bool, reason string)
	// Registerer takes the metrics (may be nil).
	Registerer prometheus.Registerer
}

// WorkerHealth tracks whether the worker process beside the sidecar (SGLang or kvc-sim) is
// alive. The worker is down when its WorkerBridge connection closes and a /health probe right
// after fails (or there is no URL to probe), or when Threshold probes in a row fail. It is up
// again when the worker registers its KV pool again or a probe succeeds (without a URL: or the
// worker calls the bridge again after a drop). Nothing is judged before the worker's first
// RegisterKVPool.
//
// A closed bridge connection alone is not proof: a gRPC client closes an idle connection (30
// minutes by default) and opens a new one on its next call, so the probe decides.
type WorkerHealth struct {
	cfg HealthConfig
	log zerolog.Logger

	closed chan struct{} // a bridge connection ended (cap 1)
	reg    chan struct{} // RegisterKVPool succeeded (cap 1)
	call   chan struct{} // another bridge call succeeded (cap 1; only without a URL)

	mu         sync.Mutex
	conns      int
	registered bool
	down       bool
	cause      string // bridge or health, while down
	reason     string
	since      time.Time

	up        prometheus.Gauge
	downs     *prometheus.CounterVec
	probeFail prometheus.Counter

	testHook func(what string) // in-package tests: called after each handled input
}

// NewWorkerHealth builds the tracker; call Run, and serve the bridge with ServerOptions.
func NewWorkerHealth(cfg HealthConfig, log zerolog.Logger) *WorkerHealth {
	if cfg.Threshold <= 0 {
		cfg.Threshold = DefaultHealthThreshold
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = DefaultHealthTimeout
	}
	if cfg.Client == nil {
		cfg.Client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	}
	cfg.URL = strings.TrimRight(cfg.URL, "/")
	h := &WorkerHealth{cfg: cfg, log: log, closed: make(chan struct{}, 1), reg: make(chan struct{}, 1), call: make(chan struct{}, 1),
		up: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_sidecar_worker_up",
			Help: "1 while the worker process beside this sidecar is alive (bridge connected or /health ok), 0 once judged down.",
		}),
		downs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_sidecar_worker_down_total",
			Help: "Times the worker was judged down, by cause: bridge (its bridge connection closed and /health failed) or health (/health failed --worker-health-threshold times in a row).",
		}, []string{"cause"}),
		probeFail: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_sidecar_worker_health_probe_failures_total", Help: "Failed GET <worker-url>/health probes.",
		}),
	}
	h.up.Set(1)
	h.downs.WithLabelValues("bridge")
	h.downs.WithLabelValues("health")
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(h.up, h.downs, h.probeFail)
	}
	return h
}

// ServerOptions wire the tracker into the bridge server: a stats handler that sees bridge
// connections open and close, and an interceptor that sees RegisterKVPool succeed.
func (h *WorkerHealth) ServerOptions() []grpcx.Option {
	return []grpcx.Option{
		grpcx.WithServerOptions(grpc.StatsHandler(connWatcher{h})),
		grpcx.WithUnaryInterceptors(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
			resp, err := next(ctx, req)
			switch {
			case err != nil:
			case info.FullMethod == kvcv1.WorkerBridgeService_RegisterKVPool_FullMethodName:
				h.Registered()
			case h.cfg.URL == "" && strings.HasPrefix(info.FullMethod, "/kvc.v1.WorkerBridgeService/") && h.downByBridge():
				// Without a URL to probe, a worker calling again after its bridge connection
				// closed proves it alive (that close was an idle one).
				select {
				case h.call <- struct{}{}:
				default:
				}
			}
			return resp, err
		}),
	}
}

func (h *WorkerHealth) downByBridge() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.down && h.cause == "bridge"
}

// Registered tells the tracker the worker registered its KV pool: it is up.
func (h *WorkerHealth) Registered() {
	select {
	case h.reg <- struct{}{}:
	default:
	}
}

// Down reports whether the worker is down, why, and since when.
func (h *WorkerHealth) Down() (bool, string, time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.down, h.reason, h.since
}

// connWatcher counts the bridge's connections.
type connWatcher struct{ h *WorkerHealth }

func (connWatcher) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (connWatcher) HandleRPC(context.Context, stats.RPCStats)                       {}
func (connWatcher) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return ctx
}

func (w connWatcher) HandleConn(_ context.Context, s stats.ConnStats) {
	h := w.h
	switch s.(type) {
	case *stats.ConnBegin:
		h.mu.Lock()
		h.conns++
		h.mu.Unlock()
	case *stats.ConnEnd:
		h.mu.Lock()
		h.conns--
		h.mu.Unlock()
		select {
		case h.closed <- struct{}{}:
		default:
		}
	}
}

// Run probes and judges until ctx is done.
func (h *WorkerHealth) Run(ctx context.Context) error {
	var tick <-chan time.Time
	if h.cfg.URL != "" && h.cfg.Interval > 0 {
		t := time.NewTicker(h.cfg.Interval)
		defer t.Stop()
		tick = t.C
	}
	fails := 0
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-h.reg:
			fails = 0
			h.mu.Lock()
			h.registered = true
			h.mu.Unlock()
			h.set(false, "worker registered its KV pool", "")
			h.hook("registered")
		case <-h.call:
			h.mu.Lock()
			cause := h.cause
			h.mu.Unlock()
			if cause == "bridge" {
				h.set(false, "worker called the bridge again", "")
			}
			h.hook("called")
		case <-h.closed:
			h.mu.Lock()
			open, registered, down := h.conns, h.registered, h.down
			h.mu.Unlock()
			if open > 0 || !registered || down || ctx.Err() != nil {
				h.hook("closed-ignored")
				continue
			}
			reason := "worker bridge connection closed"
			if h.cfg.URL != "" {
				err := h.probe(ctx)
				if ctx.Err() != nil {
					return nil
				}
				if err == nil {
					h.log.Debug().Msg("worker bridge connection closed but /health answers: an idle close")
					h.hook("closed-healthy")
					continue
				}
				reason += "; " + err.Error()
			}
			fails = h.cfg.Threshold
			h.set(true, reason, "bridge")
			h.hook("closed-down")
		case <-tick:
			h.mu.Lock()
			registered := h.registered
			h.mu.Unlock()
			if !registered {
				h.hook("probe-skipped")
				continue
			}
			err := h.probe(ctx)
			if ctx.Err() != nil {
				return nil
			}
			if err == nil {
				fails = 0
				h.set(false, "/health answers again", "")
				h.hook("probe-ok")
				continue
			}
			if fails++; fails == h.cfg.Threshold {
				h.set(true, fmt.Sprintf("%d health probes failed in a row; last: %v", fails, err), "health")
			}
			h.hook("probe-failed")
		}
	}
}

func (h *WorkerHealth) hook(what string) {
	if h.testHook != nil {
		h.testHook(what)
	}
}

// set records a transition (no-op when the state does not change) and calls OnChange.
func (h *WorkerHealth) set(down bool, reason, cause string) {
	h.mu.Lock()
	if h.down == down {
		h.mu.Unlock()
		return
	}
	h.down = down
	h.since = time.Now()
	h.reason, h.cause = "", ""
	if down {
		h.reason, h.cause = reason, cause
	}
	h.mu.Unlock()
	if down {
		h.up.Set(0)
		h.downs.WithLabelValues(cause).Inc()
		h.log.Error().Str("reason", reason).Str("worker_url", h.cfg.URL).Msg("worker down: taking this GPU out of routing")
	} else {
		h.up.Set(1)
		h.log.Warn().Str("reason", reason).Msg("worker up again")
	}
	if h.cfg.OnChange != nil {
		h.cfg.OnChange(down, reason)
	}
}

// errUnhealthy is a probe answered with a non-2xx status.
var errUnhealthy = errors.New("unhealthy")

// probe does one GET <URL>/health.
func (h *WorkerHealth) probe(ctx context.Context) error {
	pctx, cancel := context.WithTimeout(ctx, h.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(pctx, http.MethodGet, h.cfg.URL+"/health", nil)
	if err == nil {
		var resp *http.Response
		resp, err = h.cfg.Client.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
			_ = resp.Body.Close()
			if resp.StatusCode/100 != 2 {
				err = fmt.Errorf("GET /health: %w: HTTP %d", errUnhealthy, resp.StatusCode)
			}
		}
	}
	if err != nil && ctx.Err() == nil {
		h.probeFail.Inc()
		return err
	}
	return nil
}
