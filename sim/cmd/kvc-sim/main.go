// Command kvc-sim is a simulated SGLang worker (prefill or decode) with a real KV pool in shared
// memory registered with its real sidecar, the worker HTTP API the gateway uses, streaming
// sessions with LRU eviction, and a timing model. See docs/simulator.md.
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
	"strings"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/obs"
	"github.com/kvcentric/kvcentric/pkg/sdnotify"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sim/internal/worker"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Getenv, os.Stderr)
	stop()
	os.Exit(code)
}

type options struct {
	role, workerID, httpAddr, bridgeSocket, shmDir, model string
	logLevel, logFormat, readyFile, addrFile              string
	capacity                                              int64
	pageSize, layers, bytesPerToken, tpRank, tpSize       int
	modelBytesPerToken                                    int64
	prefillTPS, prefillOverheadMS, decodeMS, linkGbps     float64
	tierEgressGbps                                        float64
	timeScale                                             float64
	bridgeWait, transferTimeout, preallocWait             time.Duration
	baseline                                              worker.BaselineConfig
	pullDirs, restoreDirs                                 string
	linkDir, evict                                        string
}

func parse(args []string, getenv func(string) string, stderr io.Writer) (*options, worker.Config, error) {
	o := &options{}
	def := worker.DefaultTiming()
	fs := flag.NewFlagSet("kvc-sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.role, "role", "", "prefill or decode (required)")
	fs.StringVar(&o.workerID, "worker-id", "", "worker id (required; the sidecar's --worker-id)")
	fs.StringVar(&o.httpAddr, "http-addr", "127.0.0.1:0", "listen address of the worker HTTP API and /metrics")
	fs.StringVar(&o.bridgeSocket, "bridge-socket", "", "Unix socket of the sidecar's WorkerBridgeService (required; waited for)")
	fs.DurationVar(&o.bridgeWait, "bridge-wait", 60*time.Second, "how long to wait for the sidecar's socket and RegisterKVPool")
	fs.Int64Var(&o.capacity, "kv-capacity-tokens", 92104, "KV pool capacity in tokens (rounded down to whole pages)")
	fs.IntVar(&o.pageSize, "page-size", 16, "tokens per KV page")
	fs.IntVar(&o.layers, "layers", 48, "model layers (the pool has a K and a V buffer per layer)")
	fs.IntVar(&o.bytesPerToken, "bytes-per-token-per-buffer", 16, "real KV bytes per token per buffer (the real model has 1024; scaled down for CPU-only runs)")
	fs.Int64Var(&o.modelBytesPerToken, "model-bytes-per-token", def.ModelBytesPerToken, "the real model's KV bytes per token, for the transfer time model")
	fs.Float64Var(&o.prefillTPS, "prefill-tokens-per-s", def.PrefillTokensPerS, "modeled prefill throughput (uncached tokens per second)")
	fs.Float64Var(&o.prefillOverheadMS, "prefill-overhead-ms", float64(def.PrefillOverhead)/1e6, "modeled fixed cost of one prefill pass (ms)")
	fs.Float64Var(&o.decodeMS, "decode-ms-per-token", float64(def.DecodePerToken)/1e6, "modeled time per output token (ms)")
	fs.Float64Var(&o.linkGbps, "link-gbps", def.LinkGbps, "modeled KV transfer link bandwidth (Gb/s)")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "multiplies every modeled duration (0.1 = ten times faster)")
	fs.DurationVar(&o.transferTimeout, "transfer-timeout", 60*time.Second, "bound of one KV transfer wait")
	fs.DurationVar(&o.preallocWait, "prealloc-wait", 0, "decode: how long a request that cannot get KV pages even by eviction waits for running requests to free some (SGLang's prealloc queue) before 503 no_capacity; 0 rejects at once")
	fs.Int64Var(&o.baseline.PrefixCacheTokens, "prefix-cache-tokens", 0, "prefill: radix (prefix) cache capacity in tokens; a prefill computes only what follows the longest cached page-aligned prefix (0: none, the E1 lower bound)")
	fs.StringVar(&o.baseline.EvictionPolicy, "radix-eviction-policy", worker.EvictLRU, "prefill: the prefix cache's eviction (SGLang's flag): lru, or priority (the pages of requests with a lower priority field go first, LRU within a priority)")
	fs.StringVar(&o.pullDirs, "pull-dirs", "", "prefill: comma list of KV tier directories to fetch a session's longer prefix from over the link (llm-d P2P pull from decode hosts' CPU tiers; SGLang HiCache L3)")
	fs.StringVar(&o.baseline.OffloadDir, "offload-dir", "", "decode: write every finished turn's KV (input and generated) to this tier directory (llm-d decode host CPU tier; SGLang decode offload to L3)")
	fs.Int64Var(&o.baseline.OffloadCapacityTokens, "offload-capacity-tokens", 0, "decode: tokens this worker keeps in --offload-dir, LRU by session (0: unbounded)")
	fs.BoolVar(&o.baseline.DecodeRadix, "decode-radix", false, "decode: SGLang decode radix cache + decode HiCache: a plain P/D turn receives only the suffix past what this worker holds or restores from --restore-dirs")
	fs.Int64Var(&o.baseline.RadixTokens, "decode-radix-tokens", 0, "decode: most tokens the L1 radix may hold of the KV pool with --decode-radix (it lives in the pool and competes with running requests; 0: the whole pool)")
	fs.StringVar(&o.evict, "evict", "lru", "decode: lru (evict idle sessions, least recently used first, when a request needs room: SGLang's decode radix) or watermark (never evict a session for capacity, as SGLang's streaming sessions; only the sidecar's capacity release frees one: pair with the decode sidecar's --release-high-watermark)")
	fs.Float64Var(&o.tierEgressGbps, "tier-egress-gbps", 0, "modeled egress of a KV tier (--pull-dirs, --restore-dirs: SGLang's L3 store, a decode host's CPU tier) shared by the flows out of it (Gb/s; 0: --link-gbps, one NIC; a store striped over N nodes has N NICs)")
	fs.StringVar(&o.linkDir, "link-dir", filepath.Join(os.TempDir(), "kvc-sim-links"), "directory where the kvc-sims of one machine count the modeled flows out of each sender (a prefill node, a KV tier), so that they share its link (\"\": only this node's NIC is shared)")
	fs.StringVar(&o.restoreDirs, "restore-dirs", "", "decode: comma list of tier directories --decode-radix restores from (SGLang's L3)")
	fs.IntVar(&o.tpRank, "tp-rank", 0, "tensor parallelism: this process is rank N of --tp-size (one sidecar per rank; its KV is that rank's shard)")
	fs.IntVar(&o.tpSize, "tp-size", 0, "tensor parallelism: the ranks of the worker (0 or 1: none)")
	fs.StringVar(&o.shmDir, "shm-dir", "/dev/shm", "directory of the shared-memory KV pool file")
	fs.StringVar(&o.model, "model", "Qwen/Qwen3-30B-A3B (kvc-sim)", "model name reported by /get_model_info")
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn, error")
	fs.StringVar(&o.logFormat, "log-format", "json", "json or console")
	fs.StringVar(&o.readyFile, "ready-file", "", "write a JSON ready file here once serving")
	fs.StringVar(&o.addrFile, "addr-file", "", "write {\"pid\", \"http_addr\"} here as soon as the HTTP port is bound, before the sidecar is waited for (a supervisor passes the worker URL to the sidecar it starts next)")
	if err := flagenv.Parse(fs, args, getenv); err != nil {
		return nil, worker.Config{}, err
	}
	var role kvcv1.WorkerRole
	switch o.role {
	case "prefill":
		role = kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	case "decode":
		role = kvcv1.WorkerRole_WORKER_ROLE_DECODE
	default:
		return nil, worker.Config{}, fmt.Errorf("--role must be prefill or decode, got %q", o.role)
	}
	if err := kvcv1.ValidateID("--worker-id", o.workerID); err != nil {
		return nil, worker.Config{}, err
	}
	if o.bridgeSocket == "" {
		return nil, worker.Config{}, errors.New("--bridge-socket is required")
	}
	if o.bridgeWait <= 0 || o.transferTimeout <= 0 {
		return nil, worker.Config{}, errors.New("--bridge-wait and --transfer-timeout must be > 0")
	}
	switch o.evict {
	case "lru", "watermark":
	default:
		return nil, worker.Config{}, fmt.Errorf("--evict must be lru or watermark, got %q", o.evict)
	}
	if o.tierEgressGbps < 0 || o.tierEgressGbps != o.tierEgressGbps {
		return nil, worker.Config{}, errors.New("--tier-egress-gbps must be >= 0")
	}
	if o.preallocWait < 0 {
		return nil, worker.Config{}, errors.New("--prealloc-wait must be >= 0")
	}
	if o.pageSize <= 0 || o.capacity < int64(o.pageSize) {
		return nil, worker.Config{}, fmt.Errorf("--kv-capacity-tokens %d must hold at least one page of --page-size %d", o.capacity, o.pageSize)
	}
	if o.prefillOverheadMS < 0 || o.decodeMS < 0 {
		return nil, worker.Config{}, errors.New("--prefill-overhead-ms and --decode-ms-per-token must be >= 0")
	}
	cfg := worker.Config{
		Role:     role,
		WorkerID: o.workerID,
		Geometry: worker.Geometry{PageSize: o.pageSize, Layers: o.layers, BytesPerToken: o.bytesPerToken,
			PageCount: o.capacity / int64(o.pageSize)},
		Timing: worker.Timing{
			PrefillTokensPerS:  o.prefillTPS,
			PrefillOverhead:    time.Duration(o.prefillOverheadMS * 1e6),
			DecodePerToken:     time.Duration(o.decodeMS * 1e6),
			LinkGbps:           o.linkGbps,
			ModelBytesPerToken: o.modelBytesPerToken,
			Scale:              o.timeScale,
		},
		Model:           o.model,
		TransferTimeout: o.transferTimeout,
		PreallocWait:    o.preallocWait,
		TPRank:          int32(o.tpRank),
		TPSize:          int32(o.tpSize),
		LinkDir:         o.linkDir,
		TierEgressGbps:  o.tierEgressGbps,

		EvictOnlyByRelease: o.evict == "watermark",
	}
	if o.tpSize < 0 || o.tpSize > 1024 || o.tpRank < 0 || o.tpRank >= max(o.tpSize, 1) {
		return nil, worker.Config{}, fmt.Errorf("--tp-rank %d must be in [0, --tp-size %d) (--tp-size in [0, 1024])", o.tpRank, o.tpSize)
	}
	if err := cfg.Geometry.Validate(); err != nil {
		return nil, worker.Config{}, err
	}
	o.baseline.PullDirs, o.baseline.RestoreDirs = splitDirs(o.pullDirs), splitDirs(o.restoreDirs)
	if o.baseline.DecodeRadix && o.baseline.RadixTokens == 0 {
		o.baseline.RadixTokens = o.capacity
	}
	bl, err := worker.NewBaseline(o.baseline, o.pageSize)
	if err != nil {
		return nil, worker.Config{}, err
	}
	cfg.Baseline = bl
	if err := cfg.Timing.Validate(); err != nil {
		return nil, worker.Config{}, err
	}
	return o, cfg, nil
}

// run runs kvc-sim until ctx is done; it returns the exit code (2 for bad flags).
func run(ctx context.Context, args []string, getenv func(string) string, stderr io.Writer) int {
	o, cfg, err := parse(args, getenv, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "kvc-sim: %v\n", err)
		return 2
	}
	log, err := obs.NewLogger(stderr, o.logLevel, o.logFormat, "kvc-sim")
	if err != nil {
		fmt.Fprintf(stderr, "kvc-sim: %v\n", err)
		return 2
	}
	log = log.With().Str("worker_id", o.workerID).Str("role", o.role).Logger()
	if err := serve(ctx, o, cfg, log); err != nil {
		log.Error().Err(err).Msg("kvc-sim failed")
		return 1
	}
	return 0
}

// waitSocket waits until path exists and is a socket.
func waitSocket(ctx context.Context, path string) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if st, err := os.Stat(path); err == nil && st.Mode()&os.ModeSocket != 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sidecar socket %s did not appear: %w", path, ctx.Err())
		case <-tick.C:
		}
	}
}

func serve(ctx context.Context, o *options, cfg worker.Config, log zerolog.Logger) error {
	// Bind first (port 0 resolved) and say where: the sidecar, started after this, advertises
	// the worker's URL. Connections wait in the backlog until the pool is registered; nobody
	// sends any before the sidecar has registered with the control plane.
	lis, err := net.Listen("tcp", o.httpAddr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", o.httpAddr, err)
	}
	defer lis.Close()
	addr := lis.Addr().String()
	if err := obs.WriteReadyFile(o.addrFile, map[string]any{"pid": os.Getpid(), "http_addr": addr}); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, o.bridgeWait)
	defer cancel()
	log.Info().Str("bridge_socket", o.bridgeSocket).Dur("wait", o.bridgeWait).Msg("waiting for the sidecar's socket")
	if err := waitSocket(wctx, o.bridgeSocket); err != nil {
		return err
	}
	log.Info().Msg("sidecar socket found; registering the KV pool")
	// No idle timeout: the sidecar reads this connection closing as a hint that the worker died
	// (confirmed by /health), so keep it open for the process's life. Reconnects back off to at
	// most bridgeMaxBackoff (gRPC's default grows to 120 s): a restarted sidecar is re-attached
	// within about a second of its socket coming back, however long it was away.
	conn, err := grpc.NewClient("unix://"+o.bridgeSocket,
		append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithIdleTimeout(0),
			grpc.WithConnectParams(grpc.ConnectParams{Backoff: bridgeBackoff, MinConnectTimeout: 5 * time.Second}))...)
	if err != nil {
		return fmt.Errorf("dial sidecar: %w", err)
	}
	defer conn.Close()
	pool, err := worker.CreatePool(o.shmDir, o.workerID, cfg.Geometry)
	if err != nil {
		return err
	}
	defer pool.Close()
	reg := obs.NewRegistry()
	w, err := worker.New(cfg, pool, kvcv1.NewWorkerBridgeServiceClient(conn), reg, log)
	if err != nil {
		return err
	}
	defer w.Close() // stops its command watcher (started by the registration) before the bridge closes
	resp, err := w.RegisterPool(wctx)
	if err != nil {
		return err
	}
	log.Info().Str("pool", pool.Path()).Int64("kv_capacity_tokens", w.CapacityTokens()).
		Str("transfer_endpoint", resp.GetTransferEndpoint()).Msg("KV pool registered with the sidecar")

	ready := &obs.Ready{}
	hs := obs.NewHTTPServer(reg, ready)
	w.Register(hs.Mux)
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return hs.Serve(gctx, lis) })
	ready.Set(true)
	if err := obs.WriteReadyFile(o.readyFile, map[string]any{
		"pid": os.Getpid(), "worker_id": o.workerID, "http_addr": addr, "role": o.role,
		"shm_path": pool.Path(), "kv_capacity_tokens": w.CapacityTokens(),
	}); err != nil {
		return err
	}
	sd := sdnotify.New(log, reg)
	sd.Ready("")
	log.Info().Str("http_addr", addr).Str("url", "http://"+strings.TrimSpace(addr)).Msg("kvc-sim serving")
	err = g.Wait()
	sd.Stopping("")
	log.Info().Msg("kvc-sim stopped")
	return err
}

// bridgeBackoff is the bridge connection's reconnect backoff: gRPC's defaults (1 s doubling
// with jitter) but capped at 1 s instead of 120 s — the sidecar is on the same host, and a
// worker must find a restarted one at once (TestSidecarRestartReattach, a 25 s outage).
var bridgeBackoff = backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second}

func splitDirs(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
