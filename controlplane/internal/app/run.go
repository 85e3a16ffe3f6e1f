package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/kvcentric/kvcentric/controlplane/internal/election"
	"github.com/kvcentric/kvcentric/controlplane/internal/embedetcd"
	"github.com/kvcentric/kvcentric/controlplane/internal/router"
	"github.com/kvcentric/kvcentric/controlplane/internal/server"
	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/flagenv"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	"github.com/kvcentric/kvcentric/pkg/obs"
	"github.com/kvcentric/kvcentric/pkg/sdnotify"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Main parses args (and KVC_* env), then runs until SIGINT/SIGTERM. It returns the exit code:
// 0 after a clean stop, 1 on a runtime failure, 2 on bad flags.
func Main(args []string, stderr io.Writer) int {
	opts := NewOptions()
	fs := flag.NewFlagSet("kvc-controlplane", flag.ContinueOnError)
	fs.SetOutput(stderr)
	opts.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kvc-controlplane: unexpected arguments: %v\n", fs.Args())
		return 2
	}
	if err := flagenv.Apply(fs, os.Getenv); err != nil {
		fmt.Fprintf(stderr, "kvc-controlplane: %v\n", err)
		return 2
	}
	if err := opts.Validate(); err != nil {
		fmt.Fprintf(stderr, "kvc-controlplane: %v\n", err)
		return 2
	}
	log, err := obs.NewLogger(stderr, opts.LogLevel, opts.LogFormat, "kvc-controlplane")
	if err != nil {
		fmt.Fprintf(stderr, "kvc-controlplane: %v\n", err)
		return 2
	}
	log = log.With().Str("node", opts.NodeID).Logger()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := RunBounded(ctx, opts.ShutdownGrace, func(ctx context.Context) error { return Run(ctx, opts, log) }); err != nil {
		log.Error().Err(err).Msg("control plane failed")
		return 1
	}
	return 0
}

// ErrShutdownGrace means a stop did not finish within --shutdown-grace; the process exits
// anyway (whatever etcd does: an unreachable etcd must never keep a replica alive).
var ErrShutdownGrace = errors.New("stop did not finish within --shutdown-grace; exiting anyway")

// RunBounded runs run(ctx) and returns its error, or ErrShutdownGrace when it has not returned
// grace after ctx ended (run keeps going in the background; the caller exits).
func RunBounded(ctx context.Context, grace time.Duration, run func(context.Context) error) error {
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case err := <-done:
		return err
	case <-t.C:
		return ErrShutdownGrace
	}
}

// readyInfo is the ready file's content (docs/interfaces.md).
type readyInfo struct {
	PID            int    `json:"pid"`
	NodeID         string `json:"node_id"`
	GRPCAddr       string `json:"grpc_addr"`
	HTTPAddr       string `json:"http_addr"`
	EtcdClientAddr string `json:"etcd_client_addr,omitempty"`
}

// Run runs the control plane until ctx ends.
func Run(ctx context.Context, opts *Options, log zerolog.Logger) error {
	reg := obs.NewRegistry()
	tlsSrc, err := tlsx.Load(opts.TLS, tlsx.WithLogger(log))
	if err != nil {
		return err
	}
	if tlsSrc != nil {
		if r := tlsSrc.Role(); r != tlsx.RoleControlPlane {
			return fmt.Errorf("--tls-cert %s has role %q; the control plane needs %s", opts.TLS.Cert, r, tlsx.RoleControlPlane.URI())
		}
		log.Info().Str("cert", opts.TLS.Cert).Time("not_after", tlsSrc.NotAfter()).Msg("mutual TLS on the gRPC port")
	}
	etcdTLS, err := tlsx.Load(opts.EtcdTLS, tlsx.WithLogger(log.With().Str("part", "etcd-client").Logger()))
	if err != nil {
		return fmt.Errorf("etcd client TLS: %w", err)
	}
	if err := errors.Join(tlsx.RegisterMetrics(reg, "grpc", tlsSrc), tlsx.RegisterMetrics(reg, "etcd", etcdTLS)); err != nil {
		return err
	}
	stopTracing, err := obs.SetupTracing(ctx, obs.Tracing{Service: "kvc-controlplane", OTLPEndpoint: opts.OTLPEndpoint,
		OTLPInsecure: opts.OTLPInsecure, SampleRatio: opts.TraceSampleRatio, Exporter: opts.traceExporter})
	if err != nil {
		return err
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = stopTracing(sctx)
		cancel()
	}()
	endpoints := opts.Endpoints()
	info := readyInfo{PID: os.Getpid(), NodeID: opts.NodeID}
	var etcdErr <-chan error // the embedded member's fatal errors (nil with --etcd-endpoints)
	if len(endpoints) == 0 {
		sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
		srv, err := embedetcd.Start(sctx, embedetcd.Config{
			Name: opts.NodeID, Dir: opts.DataDir,
			ClientAddr: opts.EmbeddedEtcdClientAddr, PeerAddr: opts.EmbeddedEtcdPeerAddr,
			QuotaBytes: opts.EmbeddedEtcdQuota, CompactionRetention: embeddedCompaction(opts.EmbeddedEtcdCompaction),
		})
		cancel()
		if err != nil {
			return err
		}
		defer srv.Close()
		etcdErr = srv.Err()
		endpoints = []string{srv.ClientURL()}
		info.EtcdClientAddr = srv.ClientAddr()
		log.Info().Str("dir", opts.DataDir).Str("client", srv.ClientURL()).Int64("quota_bytes", opts.EmbeddedEtcdQuota).
			Dur("compaction_retention", opts.EmbeddedEtcdCompaction).Msg("embedded etcd started")
	}
	ecfg := clientv3.Config{
		Endpoints:            endpoints,
		DialTimeout:          opts.EtcdDialTimeout,
		DialKeepAliveTime:    5 * time.Second,
		DialKeepAliveTimeout: 3 * time.Second,
		Logger:               zap.NewNop(),
	}
	if etcdTLS != nil {
		ecfg.TLS = etcdTLS.ClientConfig()
	}
	cli, err := clientv3.New(ecfg)
	if err != nil {
		return fmt.Errorf("etcd client: %w", err)
	}
	defer func() { _ = cli.Close() }()
	store, err := kvstore.New(cli, kvstore.WithPrefix(opts.EtcdPrefix), kvstore.WithRegisterer(reg),
		kvstore.WithCallTimeout(opts.EtcdCallTimeout))
	if err != nil {
		return err
	}

	glis, err := net.Listen("tcp", opts.GRPCAddr)
	if err != nil {
		return fmt.Errorf("grpc listen: %w", err)
	}
	defer func() { _ = glis.Close() }()
	hlis, err := net.Listen("tcp", opts.HTTPAddr)
	if err != nil {
		return fmt.Errorf("http listen: %w", err)
	}
	defer func() { _ = hlis.Close() }()
	info.GRPCAddr, info.HTTPAddr = glis.Addr().String(), hlis.Addr().String()
	advertise := opts.AdvertiseAddr
	if advertise == "" {
		advertise = info.GRPCAddr
	}

	st := state.New(state.Config{
		NodeID: opts.NodeID, Store: store, Log: log, Reg: reg,
		SessionTTL: opts.SessionTTL, UnreachableGrace: opts.UnreachableGrace, FlushDelay: opts.FlushDelay,
		VolatileFlush: volatileFlush(opts.VolatileFlush), DrainSnapshotWait: opts.DrainSnapshotWait,
	})
	el, err := election.New(election.Config{
		Client: cli, Prefix: store.ElectionPrefix(), NodeID: opts.NodeID, Addr: advertise,
		TTL: opts.ElectionTTL, RenewDeadline: opts.ElectionRenewDeadline, Log: log, Reg: reg,
	})
	if err != nil {
		return err
	}
	gate := server.NewGate(el.NotLeaderError, nil)
	gsrv := grpcx.NewServer(log, grpcx.WithTLS(tlsSrc),
		grpcx.WithUnaryInterceptors(gate.Unary), grpcx.WithStreamInterceptors(gate.Stream),
		grpcx.WithServerOptions(grpc.KeepaliveParams(keepalive.ServerParameters{
			Time: opts.GRPCKeepaliveTime, Timeout: opts.GRPCKeepaliveTimeout,
		})))
	gate.SetHealth(gsrv.Health)
	kvcv1.RegisterAdminServiceServer(gsrv, &server.Admin{NodeID: opts.NodeID, State: st, Store: store, Lead: el})
	kvcv1.RegisterSidecarServiceServer(gsrv, server.NewSidecar(server.Sidecar{
		NodeID: opts.NodeID, Addr: advertise, State: st, Log: log,
		OnStale: func() { el.StepDown("a sidecar has seen a newer epoch") },
	}, reg))
	rt := router.New(st, log, reg)
	rt.SetNewSessionShare(opts.NewSessionShare)
	rt.SetRehomeFill(opts.RehomeFill)
	rt.Register(gsrv)
	st.SetRehomeHook(rt)   // a decode worker that leaves READY: its sessions re-homed (router/rehome.go)
	st.SetTransferHook(rt) // a transfer's KV landed on its decode worker: its slot ends (router/landed.go)
	onLeadership := func(bool) {}
	if l, ok := any(rt).(interface{ OnLeadershipChange(bool) }); ok {
		onLeadership = l.OnLeadershipChange
	}
	gsrv.Health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	gsrv.Health.SetServingStatus(kvcv1.AdminService_ServiceDesc.ServiceName, healthpb.HealthCheckResponse_SERVING)

	ready := &obs.Ready{}
	hsrv := obs.NewHTTPServer(reg, ready)
	sd := sdnotify.New(log, reg)

	// Leadership in one place: lctx is the election's term (*election.Term), done when the
	// term ends for any reason and, checked on every Err call, at the renew deadline. The gate
	// (leader-only services and their streams) and the state (every mutation, command, epoch
	// and the term's goroutines) check or derive from it; nothing else decides leadership.
	lead := func(lctx context.Context, fence kvstore.Fence, serving func()) error {
		term, err := st.LeadTerm(lctx, lctx, fence)
		if err != nil {
			return err
		}
		gate.Open(lctx)
		onLeadership(true)
		serving()
		log.Info().Int64("epoch", fence.Rev).Str("addr", advertise).Msg("serving as leader")
		sd.Status(fmt.Sprintf("leader (epoch %d) on %s", fence.Rev, advertise))
		var deposed error
		select {
		case <-lctx.Done():
		case <-term.Deposed():
			deposed = kvstore.ErrFenced
		}
		gate.Close()
		onLeadership(false)
		st.EndTerm(term)
		log.Info().Int64("epoch", fence.Rev).Msg("stopped leading")
		sd.Status("standby: not leading")
		return deposed
	}

	g, gctx := errgroup.WithContext(ctx)
	// In-flight calls get ¾ of the grace, the rest is left for the last etcd writes and
	// the resignation (each bounded) before RunBounded gives up.
	g.Go(func() error { return gsrv.Serve(gctx, glis, opts.ShutdownGrace*3/4) })
	g.Go(func() error { return hsrv.Serve(gctx, hlis) })
	g.Go(func() error { return el.Observe(gctx) })
	g.Go(func() error { return store.WatchPolicy(gctx, st.SetStoredPolicy, st.PolicyCorrupt) })
	g.Go(func() error { return el.Run(gctx, lead) })
	g.Go(func() error { return rt.Run(gctx) })
	if etcdErr != nil {
		// A fatal error of the embedded member (its listener or its backend failed) ends the
		// process with it, so systemd restarts both; before, it was never read and the control
		// plane kept serving on an etcd that no longer answered.
		g.Go(func() error {
			select {
			case err := <-etcdErr:
				if err == nil {
					return nil
				}
				log.Error().Err(err).Msg("embedded etcd failed")
				return fmt.Errorf("embedded etcd: %w", err)
			case <-gctx.Done():
				return nil
			}
		})
	}
	// systemd's watchdog (WatchdogSec=): pinged while the HTTP listener answers /healthz.
	g.Go(func() error { return sd.Watchdog(gctx, sdnotify.HTTPProbe(hlis.Addr(), "/healthz", false)) })

	ready.Set(true)
	if err := obs.WriteReadyFile(opts.ReadyFile, info); err != nil {
		log.Error().Err(err).Msg("ready file")
	}
	sd.Ready("serving: grpc " + info.GRPCAddr + ", http " + info.HTTPAddr + "; standby until elected")
	context.AfterFunc(gctx, func() { sd.Stopping("stopping: resigning, draining gRPC calls") })
	log.Info().Str("grpc", info.GRPCAddr).Str("http", info.HTTPAddr).Str("advertise", advertise).
		Strs("etcd", endpoints).Msg("control plane serving")
	err = g.Wait()
	sd.Stopping("stopping") // sent already as the stop began; this waits for it before the exit
	return err
}

// volatileFlush maps --volatile-flush to state.Config.VolatileFlush (0 there is the default;
// the flag's 0 means "write every change at once").
func volatileFlush(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// embeddedCompaction maps --embedded-etcd-compaction-retention (0: off) to
// embedetcd.Config.CompactionRetention (0 there is the default, negative is off).
func embeddedCompaction(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
