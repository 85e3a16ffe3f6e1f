package app

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/config"
	"github.com/kvcentric/kvcentric/gateway/internal/routeclient"
	"github.com/kvcentric/kvcentric/gateway/internal/server"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/obs"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

// Run serves until ctx ends. logOut receives the logs.
func Run(ctx context.Context, cfg *config.Config, logOut io.Writer) error {
	log, err := obs.NewLogger(logOut, cfg.LogLevel, cfg.LogFormat, "kvc-gateway")
	if err != nil {
		return err
	}
	reg := obs.NewRegistry()
	m := server.NewMetrics(reg)
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
		}, cpDial...)
		router = rc
	}
	adm, err := server.NewAdmission(cfg.AdmissionLimits(), reg)
	if err != nil {
		return err
	}
	srv := server.New(router, pool, server.Options{
		RequestTimeout: cfg.RequestTimeout, ConnectTimeout: cfg.ConnectTimeout, MaxBodyBytes: cfg.MaxBodyBytes,
		Parse:          api.Options{RequireSession: cfg.RequireSession, DefaultMaxTok: cfg.DefaultMaxTok},
		SessionTimeout: cfg.SessionTimeout, Admission: adm,
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
	hs := obs.NewHTTPServer(reg, &ready)
	srv.Register(hs.Mux)

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return hs.Serve(gctx, lis) })
	if rc != nil {
		g.Go(func() error { return rc.Run(gctx) })
		g.Go(func() error {
			return pool.Refresh(gctx, cfg.ControlPlanes, cfg.WorkerRefresh, log, func(ok bool) {
				if ok {
					m.Refresh.WithLabelValues("ok").Inc()
				} else {
					m.Refresh.WithLabelValues("failed").Inc()
				}
			}, cpDial...)
		})
	}
	// Fail-open serving works without a control plane, so the gateway is ready once it listens.
	ready.Set(true)
	addr := lis.Addr().String()
	if err := obs.WriteReadyFile(cfg.ReadyFile, map[string]any{"pid": os.Getpid(), "http_addr": addr, "scheme": scheme}); err != nil {
		log.Error().Err(err).Msg("ready file")
	}
	if _, err := obs.SdNotify("READY=1"); err != nil {
		log.Warn().Err(err).Msg("sd_notify")
	}
	np, nd := pool.Sizes()
	log.Info().Str("http_addr", addr).Str("scheme", scheme).Strs("control_planes", cfg.ControlPlanes).Int("failopen_prefill", np).Int("failopen_decode", nd).
		Dur("request_timeout", cfg.RequestTimeout).Dur("route_timeout", cfg.RouteTimeout).Msg("kvc-gateway serving")
	err = g.Wait()
	_, _ = obs.SdNotify("STOPPING=1")
	return err
}
