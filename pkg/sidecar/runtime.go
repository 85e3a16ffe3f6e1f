package sidecar

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/obs"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sdnotify"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Runtime is what a sidecar binary builds before its core: logger, metrics, event log, transfer
// engine and the peer listener (whose address the core advertises).
type Runtime struct {
	C        *Common
	Log      zerolog.Logger
	Reg      *prometheus.Registry
	Events   *EventLog
	Engine   rdma.Engine
	PeerLis  net.Listener
	PeerAddr string // advertised
	Node     string
	Ready    obs.Ready
	// TLS is the mTLS identity from --tls-*; nil: plaintext.
	TLS *tlsx.Source
	// stopTracing flushes and stops the trace exporter (obs.SetupTracing); Serve calls it.
	stopTracing func(context.Context) error
}

// PeerDialOptions are the extra dial options of connections to other sidecars' peer services
// (mutual TLS requiring a sidecar certificate when --tls-* is set; none otherwise). Pass them to
// NewPeers.
func (rt *Runtime) PeerDialOptions() []grpc.DialOption {
	if rt.TLS == nil {
		return nil
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(rt.TLS.ClientCredentials(tlsx.RoleSidecar))}
}

// Start builds the runtime for a sidecar binary (component names it in logs).
func Start(ctx context.Context, c *Common, component string, logw io.Writer) (*Runtime, error) {
	log, err := obs.NewLogger(logw, c.LogLevel, c.LogFormat, component)
	if err != nil {
		return nil, err
	}
	log = log.With().Str("worker_id", c.WorkerID).Logger()
	rt := &Runtime{C: c, Log: log, Reg: obs.NewRegistry(), Node: c.Node}
	if rt.Node == "" {
		rt.Node, _ = os.Hostname()
	}
	rt.TLS, err = tlsx.Load(c.TLS, tlsx.WithLogger(log))
	if err != nil {
		return nil, err
	}
	if rt.TLS != nil {
		if r := rt.TLS.Role(); r != tlsx.RoleSidecar {
			return nil, fmt.Errorf("--tls-cert %s has role %q; a sidecar needs %s", c.TLS.Cert, r, tlsx.RoleSidecar.URI())
		}
		// The control plane and peer sidecars accept this sidecar only as a worker its
		// certificate names: say so now rather than at every refused hello.
		if err := tlsx.CertAllowsWorker(rt.TLS.Leaf(), c.WorkerID); err != nil {
			return nil, fmt.Errorf("--tls-cert %s: %s (issue it with worker:%s, deploy/tls/make-certs.sh)", c.TLS.Cert, status.Convert(err).Message(), c.WorkerID)
		}
		log.Info().Str("cert", c.TLS.Cert).Time("not_after", rt.TLS.NotAfter()).Msg("mutual TLS on")
		if err := tlsx.RegisterMetrics(rt.Reg, "grpc", rt.TLS); err != nil {
			return nil, err
		}
	}
	// Traces: a span per control-plane command (ControlPlane.apply), child of the decision
	// that sent it (Command.traceparent); gRPC calls propagate through pkg/grpcx.
	rt.stopTracing, err = obs.SetupTracing(ctx, obs.Tracing{Service: component, OTLPEndpoint: c.OTLPEndpoint,
		OTLPInsecure: c.OTLPInsecure, SampleRatio: c.TraceSampleRatio})
	if err != nil {
		return nil, err
	}
	rt.Events, err = OpenEventLog(c.EventLog, c.WorkerID, c.EventLogRotation, rt.Reg)
	if err != nil {
		return nil, err
	}
	eng, err := rdma.New(ctx, rdma.Config{Backend: c.Transport, ListenAddr: c.TransferAddr, AdvertiseAddr: c.TransferAdvertise,
		Conns: c.TransferConns, SliceBytes: c.TransferSlice, CUDADevice: c.GPUIndex, MooncakeLib: c.MooncakeLib,
		MooncakeMetadata: c.MooncakeMetadata, MooncakeProtocol: c.MooncakeProtocol, MooncakeDevices: c.MooncakeDevices})
	if err != nil {
		_ = rt.Events.Close()
		return nil, fmt.Errorf("transfer engine: %w", err)
	}
	if c.FaultDelay > 0 {
		log.Warn().Dur("delay", c.FaultDelay).Msg("fault injection: every transfer request is delayed")
		eng = kvxfer.NewSlowEngine(eng, c.FaultDelay)
	}
	rt.Engine = eng
	rt.PeerLis, err = net.Listen("tcp", c.PeerAddr)
	if err != nil {
		_ = eng.Close()
		_ = rt.Events.Close()
		return nil, fmt.Errorf("peer listen: %w", err)
	}
	rt.PeerAddr = c.AdvertisePeerAddr
	if rt.PeerAddr == "" {
		rt.PeerAddr = rt.PeerLis.Addr().String()
	}
	return rt, nil
}

// WorkerListener is implemented by a core that acts when its worker process goes down or comes
// back (WorkerHealth): a decode core drops every session, whose KV died with the worker. Called
// one transition at a time, before the control plane hears of it.
type WorkerListener interface {
	WorkerHealth(down bool, reason string)
}

// ReadinessReporter is implemented by a core that can say what it waits for before it is ready
// (Attach.WaitingFor): /readyz answers it, and the runtime logs it at start and every
// readinessLogEvery while waiting.
type ReadinessReporter interface {
	WaitingFor() string
}

const readinessLogEvery = 10 * time.Second

// Core is a sidecar's core, served by Runtime.Serve.
type Core interface {
	kvcv1.WorkerBridgeServiceServer
	kvcv1.TransferPeerServiceServer
	Handler
	// Registered is closed once the worker registered its KV pool.
	Registered() <-chan struct{}
	// Run does the core's background work until ctx is done.
	Run(ctx context.Context) error
	// Mount adds the core's HTTP handlers.
	Mount(mux *http.ServeMux)
}

// Serve runs the bridge (Unix socket), the peer service, HTTP and — once the worker registered
// its pool — the control-plane loop, until ctx is done. It writes the ready file once serving.
func (rt *Runtime) Serve(ctx context.Context, core Core, setReporter func(*ControlPlane)) error {
	c := rt.C
	defer rt.Events.Close()
	defer rt.Engine.Close()
	defer func() {
		// Spans still buffered for the collector: bounded, after everything else stopped.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		if rt.stopTracing == nil {
			return
		}
		if err := rt.stopTracing(sctx); err != nil {
			rt.Log.Warn().Err(err).Msg("trace exporter shutdown")
		}
	}()
	bridgeLis, err := ListenUnix(c.BridgeSocket)
	if err != nil {
		_ = rt.PeerLis.Close()
		return fmt.Errorf("bridge socket: %w", err)
	}
	defer os.Remove(c.BridgeSocket)
	httpLis, err := net.Listen("tcp", c.HTTPAddr)
	if err != nil {
		_ = rt.PeerLis.Close()
		_ = bridgeLis.Close()
		return fmt.Errorf("http listen: %w", err)
	}
	var cp *ControlPlane
	health := NewWorkerHealth(HealthConfig{URL: c.WorkerURL, Interval: c.Scaled(c.WorkerHealthInterval), Threshold: c.WorkerHealthThreshold,
		Timeout: c.WorkerHealthTimeout, Registerer: rt.Reg, OnChange: func(down bool, reason string) {
			if l, ok := core.(WorkerListener); ok {
				l.WorkerHealth(down, reason) // first: a decode core drops (and reports) the lost sessions
			}
			if cp != nil {
				cp.SetWorkerDown(down, reason)
			}
		}}, rt.Log.With().Str("part", "worker-health").Logger())
	bridge := grpcx.NewServer(rt.Log.With().Str("server", "bridge").Logger(), health.ServerOptions()...)
	kvcv1.RegisterWorkerBridgeServiceServer(bridge, core)
	// The bridge is a 0600 Unix socket to the local worker: plaintext. The peer port is TCP:
	// mutual TLS when configured.
	peer := grpcx.NewServer(rt.Log.With().Str("server", "peer").Logger(), grpcx.WithTLS(rt.TLS))
	kvcv1.RegisterTransferPeerServiceServer(peer, core)
	hs := obs.NewHTTPServer(rt.Reg, &rt.Ready)
	core.Mount(hs.Mux)
	sd := sdnotify.New(rt.Log, rt.Reg)
	waiting := func() string {
		if rr, ok := core.(ReadinessReporter); ok {
			if w := rr.WaitingFor(); w != "" {
				return w
			}
		}
		return "waiting for worker to register its KV pool"
	}
	httpSrv := &http.Server{Handler: readyzHandler(hs.Mux, &rt.Ready, waiting), ReadHeaderTimeout: 5 * time.Second}

	if eps := c.Endpoints(); len(eps) > 0 {
		cp = NewControlPlane(CPConfig{Endpoints: eps, Heartbeat: c.Scaled(c.Heartbeat), Lease: c.CPLease, Registerer: rt.Reg,
			DialOptions: []grpc.DialOption{cpclient.DialCredentials(rt.TLS)}},
			core, rt.Log.With().Str("part", "cpclient").Logger())
		if setReporter != nil {
			setReporter(cp)
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return bridge.Serve(gctx, bridgeLis, 5*time.Second) })
	g.Go(func() error { return peer.Serve(gctx, rt.PeerLis, 5*time.Second) })
	g.Go(func() error { return serveHTTP(gctx, httpSrv, httpLis) })
	g.Go(func() error { return core.Run(gctx) })
	g.Go(func() error { return health.Run(gctx) })
	// systemd's watchdog (WatchdogSec=): pinged while the HTTP listener answers /healthz (the
	// worker's own health is not the sidecar's: a worker down is reported, not restarted here).
	g.Go(func() error { return sd.Watchdog(gctx, sdnotify.HTTPProbe(httpLis.Addr(), "/healthz", false)) })
	g.Go(func() error {
		t := time.NewTicker(readinessLogEvery)
		defer t.Stop()
		rt.Log.Info().Str("waiting_for", waiting()).Msg("not ready")
	wait:
		for {
			select {
			case <-gctx.Done():
				return nil
			case <-core.Registered():
				break wait
			case <-t.C:
				rt.Log.Warn().Str("waiting_for", waiting()).Msg("not ready")
			}
		}
		rt.Log.Info().Msg("ready: worker attached")
		rt.Ready.Set(true)
		sd.Status("ready: worker attached")
		bridge.Health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
		if cp == nil {
			rt.Log.Warn().Msg("no --control-plane: running standalone")
			return nil
		}
		return cp.Run(gctx)
	})
	peer.Health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	if err := obs.WriteReadyFile(c.ReadyFile, map[string]any{
		"pid": os.Getpid(), "worker_id": c.WorkerID, "http_addr": httpLis.Addr().String(), "peer_addr": rt.PeerAddr,
		"transfer_endpoint": rt.Engine.SegmentName(), "bridge_socket": c.BridgeSocket,
	}); err != nil {
		rt.Log.Error().Err(err).Msg("ready file")
	}
	// READY=1 once the bridge socket listens, not once the worker attached: the worker's unit
	// starts After= this one and attaches through that socket.
	sd.Ready("serving; " + waiting())
	context.AfterFunc(gctx, func() { sd.Stopping("stopping") })
	rt.Log.Info().Str("bridge", c.BridgeSocket).Str("peer", rt.PeerAddr).Str("http", httpLis.Addr().String()).
		Str("transfer", rt.Engine.SegmentName()).Str("transport", rt.Engine.Backend()).Msg("sidecar serving")
	err = g.Wait()
	sd.Stopping("stopping") // sent already as the stop began; this waits for it before the exit
	return err
}

// readyzHandler answers GET /readyz with "ready" or 503 and what the sidecar waits for, and
// passes everything else to next.
func readyzHandler(next http.Handler, ready *obs.Ready, waiting func() string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/readyz" || r.Method != http.MethodGet {
			next.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain")
		if !ready.Get() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, "not ready: "+waiting()+"\n")
			return
		}
		_, _ = io.WriteString(w, "ready\n")
	})
}

// serveHTTP serves srv on lis until ctx is done, then shuts it down (5 s grace).
func serveHTTP(ctx context.Context, srv *http.Server, lis net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lis) }()
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
	_ = srv.Shutdown(sctx)
	<-errc
	return nil
}
