// Command kvc-local brings up a whole kvcentric cluster as real processes on loopback (an
// embedded etcd, a control-plane pair, prefill and decode kvc-sim workers each with its sidecar,
// the gateway), prints where each listens, and tears it down cleanly on SIGINT/SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
	"github.com/kvcentric/kvcentric/pkg/obs"
	"github.com/kvcentric/kvcentric/pkg/sdnotify"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sim/internal/bench"
	"github.com/kvcentric/kvcentric/sim/internal/cluster"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

type options struct {
	cfg       cluster.Config
	timeScale float64
	simArgs   string
	policy    string
	httpAddr  string
	readyFile string
	noGateway bool
	refArgs   string
}

func parse(args []string, getenv func(string) string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("kvc-local", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.cfg.BinDir, "bin-dir", "", "directory of the kvc-* binaries (default: this binary's directory)")
	fs.StringVar(&o.cfg.WorkDir, "work-dir", "", "logs, sockets, ready files, event logs (default: a new directory under $TMPDIR)")
	fs.IntVar(&o.cfg.Prefill, "prefill", 1, "prefill workers (the same as --prefill-workers)")
	fs.IntVar(&o.cfg.Prefill, "prefill-workers", 1, "prefill workers")
	fs.IntVar(&o.cfg.Decode, "decode", 3, "decode workers (the same as --decode-workers)")
	fs.IntVar(&o.cfg.Decode, "decode-workers", 3, "decode workers")
	fs.IntVar(&o.cfg.ControlPlanes, "control-planes", 2, "control-plane replicas (2 = an HA pair)")
	fs.Int64Var(&o.cfg.DecodeCapacityTokens, "decode-capacity-tokens", 0, "KV capacity of each decode worker in tokens (0 = kvc-sim's default)")
	fs.Int64Var(&o.cfg.PrefillCapacityTokens, "prefill-capacity-tokens", 0, "KV capacity of each prefill worker in tokens (0 = kvc-sim's default)")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "kvc-sim --time-scale (multiplies every modeled duration); the sidecars' --time-scale and the policy's reservation/unreachable timers follow it (kvc-bench does the same)")
	fs.StringVar(&o.simArgs, "sim-args", "", "extra kvc-sim flags, space separated (e.g. \"--bytes-per-token-per-buffer 8\")")
	fs.StringVar(&o.policy, "policy-json", "", "policy to apply after start, as kvc.v1.Policy JSON (e.g. '{\"snapshotsEnabled\": false}')")
	fs.BoolVar(&o.noGateway, "no-gateway", false, "do not start kvc-gateway")
	fs.StringVar(&o.cfg.WorkerKind, "worker-kind", "sim", "what runs next to each sidecar: sim (kvc-sim) or refworker (kvc-refworker, a real model: integrations/refworker)")
	fs.StringVar(&o.cfg.RefworkerPython, "refworker-python", "python3", "Python that runs -m kvc_refworker (e.g. the venv of integrations/sglang/scripts/make-venv.sh)")
	fs.StringVar(&o.refArgs, "refworker-args", "", "extra kvc-refworker flags, space separated (e.g. \"--model tiny --verify-recompute\")")
	fs.DurationVar(&o.cfg.StartTimeout, "start-timeout", 120*time.Second, "bound of each start-up step")
	fs.DurationVar(&o.cfg.StopGrace, "stop-grace", 10*time.Second, "SIGTERM to SIGKILL grace when stopping")
	fs.StringVar(&o.httpAddr, "http-addr", "127.0.0.1:0", "kvc-local's own /metrics, /healthz, /readyz")
	fs.StringVar(&o.readyFile, "ready-file", "", "write a JSON ready file (gateway URL, control planes, workers) once the cluster is up")
	if err := flagenv.Parse(fs, args, getenv); err != nil {
		return nil, err
	}
	switch {
	case o.cfg.Prefill < 1 || o.cfg.Prefill > 16:
		return nil, fmt.Errorf("--prefill %d out of range [1, 16]", o.cfg.Prefill)
	case o.cfg.Decode < 1 || o.cfg.Decode > 16:
		return nil, fmt.Errorf("--decode %d out of range [1, 16]", o.cfg.Decode)
	case o.cfg.ControlPlanes < 1 || o.cfg.ControlPlanes > 5:
		return nil, fmt.Errorf("--control-planes %d out of range [1, 5]", o.cfg.ControlPlanes)
	case o.cfg.DecodeCapacityTokens < 0 || o.cfg.PrefillCapacityTokens < 0:
		return nil, errors.New("capacities must be >= 0")
	case o.cfg.WorkerKind != cluster.WorkerKindSim && o.cfg.WorkerKind != cluster.WorkerKindRefworker:
		return nil, fmt.Errorf("--worker-kind %q (want sim or refworker)", o.cfg.WorkerKind)
	case !(o.timeScale >= 0):
		return nil, fmt.Errorf("--time-scale %v must be >= 0", o.timeScale)
	case o.cfg.StartTimeout <= 0 || o.cfg.StopGrace <= 0:
		return nil, errors.New("--start-timeout and --stop-grace must be > 0")
	}
	if o.policy != "" {
		p := &kvcv1.Policy{}
		if err := protojson.Unmarshal([]byte(o.policy), p); err != nil {
			return nil, fmt.Errorf("--policy-json: %v", err)
		}
		o.cfg.Policy = p
	}
	o.cfg.SimArgs = append([]string{"--time-scale", strconv.FormatFloat(o.timeScale, 'g', -1, 64)}, strings.Fields(o.simArgs)...)
	// The sidecars' and the control plane's decision-shaping timers run at the model's speed too
	// (as kvc-bench runs them): otherwise a heartbeat or a reservation timeout lasts 1/X model
	// seconds longer than at real speed.
	o.cfg.SidecarArgs = bench.SidecarTimerArgs(o.timeScale)
	if o.timeScale > 0 && o.timeScale != 1 {
		if o.cfg.Policy == nil {
			o.cfg.Policy = &kvcv1.Policy{}
		}
		bench.ScalePolicyTimers(o.cfg.Policy, o.timeScale)
	}
	o.cfg.RefworkerArgs = strings.Fields(o.refArgs)
	o.cfg.Gateway = !o.noGateway
	return o, nil
}

func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	o, err := parse(args, getenv, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "kvc-local: %v\n", err)
		return 2
	}
	if o.cfg.WorkDir == "" {
		d, err := os.MkdirTemp("", "kvc-local-")
		if err != nil {
			fmt.Fprintf(stderr, "kvc-local: %v\n", err)
			return 1
		}
		o.cfg.WorkDir = d
	}
	if abs, err := filepath.Abs(o.cfg.WorkDir); err == nil {
		o.cfg.WorkDir = abs
	}
	o.cfg.Log = stderr
	lis, err := net.Listen("tcp", o.httpAddr)
	if err != nil {
		fmt.Fprintf(stderr, "kvc-local: listen %s: %v\n", o.httpAddr, err)
		return 2
	}
	reg := obs.NewRegistry()
	ready := &obs.Ready{}
	hs := obs.NewHTTPServer(reg, ready)
	// The metrics server stops when run returns (also on a failed start, which has no signal).
	sctx, stopServe := context.WithCancel(ctx)
	g, gctx := errgroup.WithContext(sctx)
	g.Go(func() error { return hs.Serve(gctx, lis) })
	defer func() {
		stopServe()
		_ = g.Wait()
	}()

	fmt.Fprintf(stderr, "kvc-local: starting cluster in %s\n", o.cfg.WorkDir)
	c, err := cluster.Start(ctx, o.cfg)
	if err != nil {
		fmt.Fprintf(stderr, "kvc-local: %v\n", err)
		return 1
	}
	alive := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_local_processes_alive", Help: "Cluster processes still running."},
		func() float64 {
			n := 0
			for _, p := range c.Processes {
				if p.Alive() {
					n++
				}
			}
			return float64(n)
		})
	reg.MustRegister(alive)
	ready.Set(true)
	fmt.Fprintln(stdout, "kvc-local: cluster is up")
	c.PrintAddrs(stdout)
	fmt.Fprintf(stdout, "kvc-local metrics: http://%s/metrics\nCtrl-C stops everything.\n", lis.Addr())
	workers := make([]map[string]string, 0, len(c.Workers))
	for _, w := range c.Workers {
		workers = append(workers, map[string]string{"id": w.ID, "role": w.Role, "worker_url": w.WorkerURL,
			"sidecar_http": w.SidecarHTTP, "peer_addr": w.PeerAddr, "event_log": w.EventLog})
	}
	if err := obs.WriteReadyFile(o.readyFile, map[string]any{
		"pid": os.Getpid(), "http_addr": lis.Addr().String(), "gateway_url": c.GatewayURL,
		"control_planes": c.ControlPlaneAddrs, "etcd": c.EtcdEndpoints, "workers": workers, "work_dir": o.cfg.WorkDir,
	}); err != nil {
		fmt.Fprintf(stderr, "kvc-local: %v\n", err)
	}
	sdnotify.New(zerolog.Nop(), nil).Ready("cluster up")

	// Report processes that die while the cluster runs (they are not restarted).
	for _, p := range c.Processes {
		go func() {
			select {
			case <-p.Exited():
				if ctx.Err() == nil {
					fmt.Fprintf(stderr, "kvc-local: %s (pid %d) exited; log %s\n", p.Name, p.PID, p.LogPath)
				}
			case <-ctx.Done():
			}
		}()
	}
	<-ctx.Done()
	fmt.Fprintln(stderr, "kvc-local: stopping")
	ready.Set(false)
	if err := c.Stop(); err != nil {
		fmt.Fprintf(stderr, "kvc-local: stop: %v\n", err)
		return 1
	}
	return 0
}
