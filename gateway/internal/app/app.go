package app

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime/debug"
	"time"

	"github.com/rs/zerolog"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/config"
	"github.com/kvcentric/kvcentric/gateway/internal/routeclient"
	"github.com/kvcentric/kvcentric/gateway/internal/server"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/obs"
	"github.com/kvcentric/kvcentric/pkg/sdnotify"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

// ErrStartup marks a start-up error in what the operator configured (a tokenizer that does not
// load): the command exits 2, as for a bad flag.
var ErrStartup = errors.New("start-up configuration")

// loadContent loads the tokenizer (--tokenizer) and says at start how input tokens are
// counted.
func loadContent(cfg *config.Config, log zerolog.Logger, m *server.Metrics) (*server.Content, error) {
	lim := cfg.TokenizeLimits()
	c := &server.Content{PageSize: cfg.KVPageSize, Limits: &lim, TokenizeCacheBytes: cfg.TokenizeCacheBytes}
	if cfg.TokenizeCacheBytes == 0 {
		c.TokenizeCacheBytes = -1 // --tokenize-cache-bytes 0: off (0 in Content is the default)
	}
	if cfg.Tokenizer == "" {
		m.TokenizerLoaded.Set(0)
		log.Warn().Msg("no --tokenizer: input tokens are estimated as ⌈bytes/4⌉, chat messages rendered as \"role: content\" lines, and page hashes go only with requests that carry input_ids")
		return c, nil
	}
	t0 := time.Now()
	tok, err := tokenizer.Load(cfg.Tokenizer)
	if err != nil {
		return nil, fmt.Errorf("%w: --tokenizer: %v", ErrStartup, err)
	}
	c.Tok = tok
	m.TokenizerLoaded.Set(1)
	log.Info().Str("tokenizer", cfg.Tokenizer).Dur("load", time.Since(t0)).Msg("tokenizer loaded: exact input token counts and the model's chat template")
	return c, nil
}

// Run serves until ctx ends. logOut receives the logs.
func Run(ctx context.Context, cfg *config.Config, logOut io.Writer) error {
	log, err := obs.NewLogger(logOut, cfg.LogLevel, cfg.LogFormat, "kvc-gateway")
	if err != nil {
		return err
	}
	if os.Getenv("GOMEMLIMIT") == "" {
		lim := server.MemoryLimit(cfg.AdmissionLimits(), cfg.TokenizeLimits())
		debug.SetMemoryLimit(lim)
		log.Info().Int64("memory_limit_bytes", lim).Msg("soft memory limit from the admission bounds (GOMEMLIMIT overrides)")
	}
	reg := obs.NewRegistry()
	m := server.NewMetrics(reg)
	content, err := loadContent(cfg, log, m)
	if err != nil {
		return err
	}
	// mTLS to the control plane (the server must hold a controlplane certificate).
	cpTLS, err := tlsx.Load(cfg.TLS, tlsx.WithLogger(log))
	if err != nil {
		return err
	}
	var cpDial []grpc.DialOption
	if cpTLS != nil {
		if r := cpTLS.Role(); r != tlsx.RoleGateway {
			return fmt.Errorf("--tls-cert %s has role %q; the gateway needs %s", cfg.TLS.Cert, r, tlsx.RoleGateway.URI())
		}
		cpDial = []grpc.DialOption{cpclient.DialCredentials(cpTLS)}
		log.Info().Str("cert", cfg.TLS.Cert).Time("not_after", cpTLS.NotAfter()).Msg("mutual TLS to the control plane")
	}
	httpTLS, err := tlsx.Load(cfg.HTTPTLS, tlsx.WithLogger(log.With().Str("part", "https").Logger()))
	if err != nil {
		return fmt.Errorf("https: %w", err)
	}
	if err := errors.Join(tlsx.RegisterMetrics(reg, "grpc", cpTLS), tlsx.RegisterMetrics(reg, "https", httpTLS)); err != nil {
		return err
	}
	stopTracing, err := obs.SetupTracing(ctx, obs.Tracing{Service: "kvc-gateway", OTLPEndpoint: cfg.OTLPEndpoint,
		OTLPInsecure: cfg.OTLPInsecure, SampleRatio: cfg.TraceSampleRatio})
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = stopTracing(sctx)
		cancel()
	}()

	conv := func(ws []config.Worker) []workers.Worker {
		out := make([]workers.Worker, 0, len(ws))
		for i, w := range ws {
			out = append(out, workers.Worker{ID: fmt.Sprintf("static-%d", i), URL: w.URL, PeerAddr: w.PeerAddr})
		}
		return out
	}
	pool := workers.NewPool(conv(cfg.PrefillURLs), conv(cfg.DecodeURLs))

	var rc *routeclient.Client
	var router server.Router
	if len(cfg.ControlPlanes) > 0 {
		rc = routeclient.New(cfg.ControlPlanes, cfg.RouteTimeout, log, routeclient.Observer{
			Connected: func(addr string, up bool) {
				if up {
					m.CPConnected.Set(1)
					log.Info().Str("addr", addr).Msg("route stream up")
				} else {
					m.CPConnected.Set(0)
				}
			},
			Orphan: m.Orphans.Inc,
			Silent: func(addr string) {
				m.CPSilent.Inc()
				log.Warn().Str("addr", addr).Msg("control plane answered nothing for half the lease: left for the next")
			},
		}, cpDial...)
		rc.SetLease(cfg.CPLease)
		router = rc
	}
	adm, err := server.NewAdmission(cfg.AdmissionLimits(), reg)
	if err != nil {
		return err
	}
	srv := server.New(router, pool, server.Options{
		RequestTimeout: cfg.RequestTimeout, ConnectTimeout: cfg.ConnectTimeout, MaxBodyBytes: cfg.MaxBodyBytes,
		Parse: api.Options{RequireSession: cfg.RequireSession, DefaultMaxTok: cfg.DefaultMaxTok,
			ToolCallParser: cfg.ToolCallParser, ReasoningParser: cfg.ReasoningParser, DefaultChatTemplateKwargs: cfg.DefaultKwargs,
			GenerationDefaults: cfg.GenerationDefaults},
		SessionTimeout: cfg.SessionTimeout, Admission: adm, Content: content, ResumeMidStream: cfg.ResumeMidStream,
	}, log, m)
	defer srv.Close()

	lis, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", cfg.HTTPAddr, err)
	}
	scheme := "http"
	if httpTLS != nil {
		lis, scheme = tls.NewListener(lis, httpTLS.ServerConfig()), "https" // certificate re-read on rotation
	}
	var ready obs.Ready
	// The client API's listener; /metrics on it only when no admin listener is configured.
	pubReg, adminAddr := reg, ""
	var admin *obs.HTTPServer
	var alis net.Listener
	if cfg.AdminAddr != "" {
		if alis, err = net.Listen("tcp", cfg.AdminAddr); err != nil {
			_ = lis.Close()
			return fmt.Errorf("listen --admin-addr %s: %w", cfg.AdminAddr, err)
		}
		admin, pubReg, adminAddr = obs.NewHTTPServer(reg, &ready), nil, alis.Addr().String()
	}
	hs := obs.NewHTTPServer(pubReg, &ready)
	srv.Register(hs.Mux)
	sd := sdnotify.New(log, reg)
	// systemd's watchdog (WatchdogSec=): pinged while /healthz answers, on the admin listener
	// when there is one, else on the client listener (HTTPS when it serves HTTPS).
	probe := sdnotify.HTTPProbe(lis.Addr(), "/healthz", httpTLS != nil)
	if alis != nil {
		probe = sdnotify.HTTPProbe(alis.Addr(), "/healthz", false)
	}

	// Background parts (route stream, worker refresh, admin listener) outlive the client
	// listener's stop: requests in flight during the grace still report their outcomes and
	// /metrics stays up. A failure of one stops the client listener too.
	bg, bgctx := errgroup.WithContext(context.Background())
	bgctx, stopBG := context.WithCancel(bgctx)
	defer stopBG()
	if admin != nil {
		bg.Go(func() error { return admin.Serve(bgctx, alis) })
	}
	bg.Go(func() error { return sd.Watchdog(bgctx, probe) })
	if rc != nil {
		bg.Go(func() error { return rc.Run(bgctx) })
		bg.Go(func() error {
			return pool.Refresh(bgctx, cfg.ControlPlanes, cfg.WorkerRefresh, log, func(ok bool) {
				if ok {
					m.Refresh.WithLabelValues("ok").Inc()
				} else {
					m.Refresh.WithLabelValues("failed").Inc()
				}
			}, cpDial...)
		})
	}
	sctx, stopServe := context.WithCancel(ctx)
	defer stopServe()
	context.AfterFunc(bgctx, stopServe)
	served := make(chan error, 1)
	go func() {
		served <- hs.ServeGraceful(sctx, lis, obs.Graceful{NotReady: &ready, Delay: cfg.ShutdownDelay, Grace: cfg.ShutdownGrace,
			OnStop: func(phase string, inflight int64) {
				log.Info().Str("phase", phase).Int64("inflight", inflight).Dur("grace", cfg.ShutdownGrace).Msg("stopping: client listener")
			}})
	}()
	// Fail-open serving works without a control plane, so the gateway is ready once it listens.
	ready.Set(true)
	addr := lis.Addr().String()
	rf := map[string]any{"pid": os.Getpid(), "http_addr": addr, "scheme": scheme}
	if adminAddr != "" {
		rf["admin_addr"] = adminAddr
	}
	if err := obs.WriteReadyFile(cfg.ReadyFile, rf); err != nil {
		log.Error().Err(err).Msg("ready file")
	}
	sd.Ready(scheme + " on " + addr)
	context.AfterFunc(sctx, func() { sd.Stopping("stopping: draining requests in flight") })
	np, nd := pool.Sizes()
	log.Info().Str("http_addr", addr).Str("admin_addr", adminAddr).Str("scheme", scheme).Strs("control_planes", cfg.ControlPlanes).Int("failopen_prefill", np).Int("failopen_decode", nd).
		Dur("request_timeout", cfg.RequestTimeout).Dur("route_timeout", cfg.RouteTimeout).Msg("kvc-gateway serving")
	err = <-served
	sd.Stopping("stopping") // sent already as the stop began; this waits for it before the exit
	stopBG()
	return errors.Join(err, bg.Wait())
}
