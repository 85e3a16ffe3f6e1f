// Command kvc-bench replays a workload against a gateway — its own local cluster per arm with
// --local (E1 plain P/D, E3 KV-centric, E4 KV-centric with D→P snapshots; the baselines PD, SGL
// and LLMD), on one or several cluster shapes (--shapes), at one load or a sweep of loads
// (--sweep), or any gateway URL — and writes per-request metrics.jsonl, summary.json, report.md
// and PNG plots (a sweep: sweep.json with each shape's SLO capacity).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sim/internal/bench"
	"github.com/kvcentric/kvcentric/sim/internal/report"
	"github.com/kvcentric/kvcentric/sim/internal/trace"
	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

func main() { os.Exit(run(os.Args[1:], os.Stderr)) }

type opts struct {
	local          bool
	gatewayURL     string
	arms           string
	workload       string
	tracePath      string
	maxRequests    int
	sweepReuse     bool
	sweepGather    bool
	sweepFrom      []string
	timeScale      float64
	simTimeScale   float64
	out            string
	binDir         string
	seed           uint64
	sessions       int
	capacity       int64
	bytesPerToken  int
	simArgs        string
	requestTimeout time.Duration
	sendText       bool
	sendIDs        bool
	sidecarArgs    string
	prefillSCArgs  string
	cpArgs         string
	gwArgs         string
	decode         int
	prefill        int
	prefillCap     int64
	prefixCache    int64
	hostTier       int64
	sloTTFT        time.Duration
	sloTPOT        time.Duration
	killDecode     string
	killWorkerOnly bool
	recoveryCtl    bool
	killAt         time.Duration
	killAfter      int
	killDelay      time.Duration
	sweep          bench.SweepSpec
	shapes         []bench.Shape
	snapDelta      int64
	seedStore      bool
	seedStoreShort bool
	workerKind     string
	refPython      string
	refArgs        string
	refDevices     string
	advertised     int64
	agentic        workload.AgenticConfig
	multiTurnOnly  bool
}

func parse(args []string, stderr io.Writer) (*opts, error) {
	o := &opts{}
	fs := flag.NewFlagSet("kvc-bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	def := workload.DefaultAgentic()
	fs.BoolVar(&o.sweepReuse, "sweep-reuse", false, "--sweep: a point whose directory already holds a summary.json with every arm (a finished run of that point) is read instead of run, so points run by separate kvc-bench processes (e.g. side by side on a larger machine, each with a one-point --sweep into the same --out) are gathered into one sweep.json")
	fs.BoolVar(&o.sweepGather, "sweep-gather", false, "--sweep-reuse that runs nothing: a point without a finished run of every arm is reported as aborted with the arms it has")
	fs.Func("sweep-from", "with --sweep-reuse: comma list of other --out directories whose points (same SHAPE/load-X layout) hold some of the arms, e.g. one directory per arm run apart; a point is read when --out and these together hold every arm", func(v string) error {
		for _, d := range strings.Split(v, ",") {
			if d = strings.TrimSpace(d); d == "" {
				return errors.New("an empty directory in the list")
			}
			o.sweepFrom = append(o.sweepFrom, d)
		}
		return nil
	})
	fs.BoolVar(&o.local, "local", false, "start a fresh local cluster (1 P + 3 D, 2 control planes, gateway) per arm")
	fs.StringVar(&o.gatewayURL, "gateway-url", "", "replay one arm against this gateway instead of --local")
	fs.StringVar(&o.arms, "arms", "E1,E3,E4", "arms to run with --local (E1 plain P/D without a prefix cache, PD with one, SGL SGLang decode radix + offload + HiCache, LLMD llm-d P2P pull, E3 KV-centric, E4 KV-centric + D→P snapshots); with --gateway-url, the one arm's label")
	fs.StringVar(&o.workload, "workload", "builtin", "builtin (agentic sessions) or mooncake (a trace in Mooncake's format, --trace)")
	fs.StringVar(&o.tracePath, "trace", "", "trace file for --workload mooncake")
	fs.BoolVar(&o.multiTurnOnly, "multi-turn-only", false, "--workload mooncake: keep only rebuilt multi-turn sessions (whole sessions, times shifted to 0); --max-requests then cuts whole sessions in start order")
	fs.IntVar(&o.maxRequests, "max-requests", 0, "replay at most this many requests (0 = all)")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "multiplies the workload clock (arrival and think times) and, with --local, kvc-sim's modeled durations: 0.5 runs everything twice as fast")
	fs.Float64Var(&o.simTimeScale, "sim-time-scale", 0, "with --local: kvc-sim's --time-scale, multiplying every modeled GPU/transfer duration (0: the same as --time-scale, so the whole system runs at one speed and times are reported in model seconds)")
	fs.StringVar(&o.out, "out", "out/bench", "output directory")
	fs.StringVar(&o.binDir, "bin-dir", "", "directory of the kvc-* binaries (default: next to kvc-bench)")
	fs.Uint64Var(&o.seed, "seed", def.Seed, "seed of the built-in workload")
	fs.IntVar(&o.sessions, "sessions", def.Sessions, "sessions of the built-in workload")
	o.agentic = def
	fs.DurationVar(&o.agentic.ArrivalSpan, "arrival-span", def.ArrivalSpan, "built-in workload: session starts spread over this long")
	fs.DurationVar(&o.agentic.ArrivalSpacing, "arrival-spacing", 0, "built-in workload: session i starts at i times this (0: starts spread at random over --arrival-span)")
	fs.IntVar(&o.agentic.MinTurns, "min-turns", def.MinTurns, "built-in workload: fewest turns per session")
	fs.IntVar(&o.agentic.MaxTurns, "max-turns", def.MaxTurns, "built-in workload: most turns per session")
	fs.Int64Var(&o.agentic.InitialMin, "initial-min-tokens", def.InitialMin, "built-in workload: smallest first-turn context")
	fs.Int64Var(&o.agentic.InitialMax, "initial-max-tokens", def.InitialMax, "built-in workload: largest first-turn context")
	fs.DurationVar(&o.agentic.ThinkMin, "think-min", def.ThinkMin, "built-in workload: shortest think time between turns")
	fs.DurationVar(&o.agentic.ThinkMax, "think-max", def.ThinkMax, "built-in workload: longest ordinary think time")
	fs.Float64Var(&o.agentic.LongThinkProb, "long-think-prob", def.LongThinkProb, "built-in workload: probability of a long pause before a turn")
	fs.Float64Var(&o.agentic.LargeAppendProb, "large-append-prob", def.LargeAppendProb, "built-in workload: probability that a turn appends --large-append-min-tokens to --large-append-max-tokens (above the direct-to-D limit)")
	fs.Int64Var(&o.agentic.LargeAppendMin, "large-append-min-tokens", def.LargeAppendMin, "built-in workload: smallest large append")
	fs.Int64Var(&o.agentic.LargeAppendMax, "large-append-max-tokens", def.LargeAppendMax, "built-in workload: largest large append")
	fs.Float64Var(&o.agentic.EditProb, "edit-prob", def.EditProb, "built-in workload: probability that a turn edits the history before it (strips the last reasoning or compacts old turns)")
	fs.Int64Var(&o.advertised, "decode-advertised-tokens", 0, "with --local: KV capacity the decode sidecars report to the control plane (0: the pool's); above the pool, the control plane admits by its own count and the worker's LRU evicts idle sessions")
	fs.Int64Var(&o.capacity, "decode-capacity-tokens", 60000, "with --local: KV capacity of each decode worker in tokens (below the working set, so some sessions get evicted)")
	fs.IntVar(&o.bytesPerToken, "bytes-per-token-per-buffer", 2, "with --local: real KV bytes per token per layer buffer in kvc-sim (scaled down from 1024 for CPU-only runs)")
	fs.StringVar(&o.simArgs, "sim-args", "", "with --local: extra kvc-sim flags, space separated")
	fs.DurationVar(&o.requestTimeout, "request-timeout", 200*time.Second, "client-side bound of one request")
	fs.IntVar(&o.decode, "decode", 3, "with --local: decode workers (the same as --decode-workers)")
	fs.IntVar(&o.decode, "decode-workers", 3, "with --local: decode workers")
	fs.IntVar(&o.prefill, "prefill-workers", 1, "with --local: prefill workers")
	fs.Int64Var(&o.prefillCap, "prefill-capacity-tokens", 0, "with --local: KV pool of each prefill kvc-sim in tokens (0: kvc-sim's default); the largest input a prefill worker can take")
	fs.Int64Var(&o.prefixCache, "prefix-cache-tokens", 0, "with --local: the prefill radix cache of every arm but E1 (0: the prefill pool's capacity)")
	fs.Int64Var(&o.hostTier, "host-tier-tokens", 0, "with --local, arm LLMD: each decode host's CPU tier in tokens (0: unbounded)")
	fs.DurationVar(&o.sloTTFT, "slo-ttft", 2*time.Second, "goodput SLO: time to first token (model time)")
	fs.DurationVar(&o.sloTPOT, "slo-tpot", 50*time.Millisecond, "goodput SLO: time per output token (model time)")
	fs.StringVar(&o.killDecode, "kill-decode", "", "with --local: SIGKILL a decode worker (its kvc-sim and sidecar) --kill-at into each arm's replay, and measure recovery: most (the one holding the most sessions at that moment, in every arm) or a name (decode-1)")
	fs.Func("sweep", "built-in workload with --local: comma list of load multipliers (e.g. 0.5,1,2,4) for every shape, or per shape SHAPE=LOADS groups separated by ';' (e.g. \"1P3D=0.5,1,2,3;2P4D=1,2,4,6;2P4D@700K=2\"; then not with --shapes); each load runs every arm with that many times --sessions over the same --arrival-span, into OUT/[SHAPE/]load-X, then OUT/sweep.json (points and slo_capacity), sweep.md and goodput/TTFT-vs-load plots", func(v string) error {
		sp, err := bench.ParseSweep(v)
		if err != nil {
			return err
		}
		o.sweep = sp
		return nil
	})
	fs.Func("shapes", "with --local: comma list of cluster shapes <P>P<D>D[@<decode pool tokens>] (e.g. 1P3D,2P4D) run one after the other, each into OUT/SHAPE with every arm, then OUT/summary.json ({shape: {arm: summary}}) and OUT/report.md with every shape; replaces --prefill-workers and --decode-workers", func(v string) error {
		sh, err := bench.ParseShapes(v)
		if err != nil {
			return err
		}
		o.shapes = sh
		return nil
	})
	fs.Int64Var(&o.snapDelta, "snapshot-delta-tokens", 0, "with --local: the policy's snapshot_delta_tokens (a decode sidecar pushes when committed - last pushed reaches it; 0: the control plane's default, 64: every turn). Small values keep idle sessions' snapshots current at the cost of more, smaller pushes")
	fs.BoolVar(&o.seedStore, "seed-through-store", false, "with --local: E4's policy has seed_through_store (its decode workers as colocated SGLang servers, the recommended deployment: a seed's or re-prefill's P computes into its own store first and D loads the session from there, so D holds no pages while the seed waits for P)")
	fs.BoolVar(&o.seedStoreShort, "seed-through-store-when-short", false, "with --local: E4's policy has seed_through_store_when_short (kvc-sim's decode workers take both: a seed or re-prefill goes through P's store only while its decode worker is short of pages — not admitted now by the control plane's count, a refused seed's fallback, or requests waiting for pages there — and keeps the direct transfer, overlapped with the prefill, otherwise)")
	fs.BoolVar(&o.recoveryCtl, "recovery-control", false, "with --kill-decode: each arm first replays the workload once without the kill (same trace, seed and flags, a fresh cluster; records in metrics-control.jsonl), and recovery adds recovery_excess_paired_s: the delay minus the same (session, turn) request's TTFT in that run (the target still reads recovery_excess_s); doubles the run's time")
	fs.BoolVar(&o.killWorkerOnly, "kill-worker-only", false, "with --kill-decode: SIGKILL only the decode worker's kvc-sim (its sidecar stays up and reports the worker down) instead of the kvc-sim and its sidecar")
	fs.DurationVar(&o.killAt, "kill-at", 60*time.Second, "with --kill-decode: when, on the workload clock (scaled by --time-scale)")
	fs.DurationVar(&o.killDelay, "kill-delay", 0, "with --kill-after-requests: kill this long after the trigger (workload clock, scaled by --time-scale), e.g. so that the sessions' snapshot pushes after their last commits are done")
	fs.IntVar(&o.killAfter, "kill-after-requests", 0, "with --kill-decode, instead of --kill-at: kill once this many of the arm's requests have completed ok (a trigger that cannot race the requests it waits for; 0: use --kill-at)")
	fs.StringVar(&o.workerKind, "worker-kind", "sim", "with --local: sim (kvc-sim) or refworker (kvc-refworker: a real model's KV, integrations/refworker; implies --send-ids)")
	fs.StringVar(&o.refPython, "refworker-python", "python3", "with --worker-kind refworker: the Python that runs -m kvc_refworker")
	fs.StringVar(&o.refArgs, "refworker-args", "", "with --worker-kind refworker: extra kvc-refworker flags, space separated (e.g. \"--model qwen3-8b-shape --verify-recompute\")")
	fs.StringVar(&o.refDevices, "refworker-devices", "", "with --worker-kind refworker: comma list of devices (cuda:0,cuda:1,...) cycled over the workers, prefill first; each sidecar gets the matching --gpu-index")
	fs.StringVar(&o.sidecarArgs, "sidecar-args", "", "with --local: extra flags of every sidecar, space separated (e.g. \"--transport cuda\" on a GPU machine)")
	fs.StringVar(&o.cpArgs, "controlplane-args", "", "with --local: extra flags of every control plane, space separated (e.g. \"--log-level debug\"; a KVC_* environment variable does not reach them)")
	fs.StringVar(&o.gwArgs, "gateway-args", "", "with --local: extra flags of the gateway, space separated (e.g. \"--log-level debug\")")
	fs.StringVar(&o.prefillSCArgs, "prefill-sidecar-args", "", "with --local: extra flags of the prefill sidecars only (e.g. \"--store-capacity-bytes 34359738368\")")
	fs.BoolVar(&o.sendIDs, "send-ids", false, "send the context as input_ids the client keeps (history + the answers' output_ids + new tokens), as an agent does")
	fs.BoolVar(&o.sendText, "send-text", false, "send a synthetic prompt of the request's length (for real SGLang workers behind a real gateway)")
	if err := flagenv.Parse(fs, args, os.Getenv); err != nil {
		return nil, err
	}
	var errs []error
	killAtSet := false
	fs.Visit(func(f *flag.Flag) { killAtSet = killAtSet || f.Name == "kill-at" })
	if o.killAfter < 0 {
		errs = append(errs, fmt.Errorf("--kill-after-requests %d must be >= 0", o.killAfter))
	}
	if o.recoveryCtl && o.killDecode == "" {
		errs = append(errs, errors.New("--recovery-control needs --kill-decode (it pairs the kill run with a run without the kill)"))
	}
	if o.killAfter > 0 && o.killDecode == "" {
		errs = append(errs, errors.New("--kill-after-requests needs --kill-decode"))
	}
	if o.killDelay < 0 {
		errs = append(errs, fmt.Errorf("--kill-delay %s must be >= 0", o.killDelay))
	}
	if o.killDelay > 0 && o.killAfter == 0 {
		errs = append(errs, errors.New("--kill-delay needs --kill-after-requests"))
	}
	if o.killAfter > 0 && killAtSet {
		errs = append(errs, errors.New("--kill-after-requests and --kill-at exclude each other: give one"))
	}
	if o.local == (o.gatewayURL != "") {
		errs = append(errs, errors.New("give exactly one of --local and --gateway-url"))
	}
	if o.gatewayURL != "" && !strings.HasPrefix(o.gatewayURL, "http://") && !strings.HasPrefix(o.gatewayURL, "https://") {
		errs = append(errs, fmt.Errorf("--gateway-url %q is not an http(s) URL", o.gatewayURL))
	}
	for _, a := range splitList(o.arms) {
		if _, err := bench.ArmPolicy(a); err != nil && o.local {
			errs = append(errs, fmt.Errorf("--arms: %v", err))
		}
	}
	if o.workerKind != "sim" && o.workerKind != "refworker" {
		errs = append(errs, fmt.Errorf("--worker-kind %q (want sim or refworker)", o.workerKind))
	}
	if o.decode < 1 || o.decode > 16 {
		errs = append(errs, fmt.Errorf("--decode-workers %d out of range [1, 16]", o.decode))
	}
	if o.prefill < 1 || o.prefill > 16 {
		errs = append(errs, fmt.Errorf("--prefill-workers %d out of range [1, 16]", o.prefill))
	}
	if o.prefillCap < 0 || o.prefixCache < 0 || o.hostTier < 0 || o.sloTTFT < 0 || o.sloTPOT < 0 || o.killAt < 0 {
		errs = append(errs, errors.New("--prefill-capacity-tokens, --prefix-cache-tokens, --host-tier-tokens, --slo-* and --kill-at must be >= 0"))
	}
	if o.snapDelta < 0 {
		errs = append(errs, errors.New("--snapshot-delta-tokens must be >= 0"))
	}
	sweeping := len(o.sweep.Loads)+len(o.sweep.PerShape) > 0
	if sweeping && (!o.local || o.workload != "builtin") {
		errs = append(errs, errors.New("--sweep needs --local and --workload builtin"))
	}
	if len(o.sweep.PerShape) > 0 && len(o.shapes) > 0 {
		errs = append(errs, errors.New("--sweep with SHAPE=LOADS groups names its shapes: leave out --shapes"))
	}
	if len(o.shapes) > 0 && !o.local {
		errs = append(errs, errors.New("--shapes needs --local"))
	}
	if o.killDecode != "" {
		var n int
		minD, what := o.decode, "--decode-workers"
		for i, sh := range o.runShapes() {
			if i == 0 || sh.Decode < minD {
				minD, what = sh.Decode, "shape "+sh.Name+"'s decode workers"
			}
		}
		if o.killDecode != bench.KillMost {
			if _, err := fmt.Sscanf(o.killDecode, "decode-%d", &n); err != nil || n < 0 || n >= minD || o.killDecode != fmt.Sprintf("decode-%d", n) {
				errs = append(errs, fmt.Errorf("--kill-decode %q: want %s or decode-N with N below %s %d", o.killDecode, bench.KillMost, what, minD))
			}
		}
		if !o.local {
			errs = append(errs, errors.New("--kill-decode needs --local"))
		}
	}
	if len(splitList(o.arms)) == 0 {
		errs = append(errs, errors.New("--arms is empty"))
	}
	if !o.local && len(splitList(o.arms)) != 1 {
		errs = append(errs, errors.New("--gateway-url runs one arm: give --arms NAME"))
	}
	switch o.workload {
	case "builtin":
	case "mooncake":
		if o.tracePath == "" {
			errs = append(errs, errors.New("--workload mooncake needs --trace PATH"))
		}
	default:
		errs = append(errs, fmt.Errorf("--workload %q: want builtin or mooncake", o.workload))
	}
	if o.maxRequests < 0 {
		errs = append(errs, fmt.Errorf("--max-requests must be >= 0"))
	}
	if o.simTimeScale == 0 {
		o.simTimeScale = o.timeScale
	}
	if !(o.timeScale > 0) || !(o.simTimeScale > 0) || o.timeScale > 100 || o.simTimeScale > 100 {
		errs = append(errs, fmt.Errorf("--time-scale and --sim-time-scale must be in (0, 100]"))
	}
	if o.sessions < 1 {
		errs = append(errs, fmt.Errorf("--sessions must be >= 1"))
	}
	if o.capacity < 0 || o.bytesPerToken < 1 || o.bytesPerToken > 1024 {
		errs = append(errs, fmt.Errorf("--decode-capacity-tokens must be >= 0 and --bytes-per-token-per-buffer in [1, 1024]"))
	}
	if o.requestTimeout <= 0 {
		errs = append(errs, fmt.Errorf("--request-timeout must be positive"))
	}
	return o, errors.Join(errs...)
}

// runShapes are the named shapes the run covers: --shapes, or the shapes of a per-shape --sweep
// (nil: the one shape of --prefill-workers and --decode-workers).
func (o *opts) runShapes() []bench.Shape {
	if len(o.sweep.PerShape) > 0 {
		var out []bench.Shape
		for _, g := range o.sweep.PerShape {
			out = append(out, g.Shape)
		}
		return out
	}
	return o.shapes
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func run(args []string, stderr io.Writer) int {
	o, err := parse(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvc-bench:", err)
		return 2
	}
	var wl *workload.Workload
	switch o.workload {
	case "builtin":
		c := o.agentic
		c.Seed, c.Sessions = o.seed, o.sessions
		wl, err = workload.Agentic(c)
	case "mooncake":
		var f *os.File
		f, err = os.Open(o.tracePath)
		if err == nil {
			maxLines := o.maxRequests
			if o.multiTurnOnly {
				maxLines = 0 // sessions need the whole file; cut whole sessions below
			}
			wl, _, err = trace.Read(f, trace.Options{MaxRequests: maxLines, Name: "mooncake:" + filepath.Base(o.tracePath)})
			f.Close()
			if err == nil && o.multiTurnOnly {
				wl.MultiTurnOnly()
			}
		}
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvc-bench: workload:", err)
		return 2
	}
	wl.Limit(o.maxRequests)
	if wl.Requests() == 0 {
		fmt.Fprintln(stderr, "kvc-bench: the workload has no requests")
		return 2
	}
	simArgs := []string{"--bytes-per-token-per-buffer", fmt.Sprint(o.bytesPerToken), "--time-scale", fmt.Sprint(o.simTimeScale)}
	simArgs = append(simArgs, strings.Fields(o.simArgs)...)
	target := o.gatewayURL
	if o.local {
		target = fmt.Sprintf("local cluster per arm: %d prefill + %d decode kvc-sim workers with their sidecars (tcp transfer engine), 2 control planes (HA pair, embedded etcd), kvc-gateway", o.prefill, o.decode)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cfg := bench.Config{
		Local: o.local, GatewayURL: o.gatewayURL, Arms: splitList(o.arms), BinDir: o.binDir, OutDir: o.out, Workload: wl,
		Replay: bench.Options{TimeScale: o.timeScale, RequestTimeout: o.requestTimeout, SendText: o.sendText,
			SendIDs: o.sendIDs || o.workerKind == "refworker"},
		Log: stderr, TTY: bench.IsTerminal(os.Stderr), SLO: report.SLO{TTFT: o.sloTTFT.Seconds(), TPOT: o.sloTPOT.Seconds()},
		Meta: report.Meta{
			Command: "kvc-bench " + strings.Join(args, " "), Target: target, Workload: wl.Name, Stats: wl.Describe(), Notes: wl.Notes,
			TimeScale: o.timeScale, Started: time.Now(),
		},
	}
	if o.local {
		cfg.DecodeCapacityTokens, cfg.SimArgs = o.capacity, simArgs
		cfg.Decode, cfg.Prefill, cfg.PrefillCapacityTokens = o.decode, o.prefill, o.prefillCap
		cfg.Baselines = bench.Baselines{PrefixCacheTokens: o.prefixCache, HostTierTokens: o.hostTier}
		cfg.KillDecode, cfg.KillAt, cfg.KillWorkerOnly = o.killDecode, o.killAt, o.killWorkerOnly
		cfg.RecoveryControl = o.recoveryCtl
		cfg.KillAfterRequests, cfg.KillDelay = o.killAfter, o.killDelay
		if o.snapDelta > 0 {
			cfg.Policy = &kvcv1.Policy{SnapshotDeltaTokens: proto.Int64(o.snapDelta)}
		}
		cfg.SeedThroughStore = o.seedStore
		cfg.SeedThroughStoreWhenShort = o.seedStoreShort
		if o.workerKind == "refworker" {
			cfg.WorkerKind, cfg.RefworkerPython, cfg.RefworkerArgs = o.workerKind, o.refPython, strings.Fields(o.refArgs)
			cfg.RefworkerDevices = splitList(o.refDevices)
			simArgs = nil
			target = fmt.Sprintf("local cluster per arm: %d prefill + %d decode kvc-refworkers (a real model: `%s`, devices %q) with their sidecars, 2 control planes (HA pair, embedded etcd), kvc-gateway", o.prefill, o.decode, o.refArgs, o.refDevices)
			cfg.Meta.Target = target
			cfg.Meta.Notes = append(cfg.Meta.Notes, "the workers are kvc-refworkers: prefill, append-prefill and decode are real forward passes of the model and every KV byte is real attention KV; nothing is modeled (the kvc-sim paragraph on modeled timing below does not apply, and KV is checked by recompute, not by a known-bytes pattern)")
		}
		cfg.SidecarArgs = strings.Fields(o.sidecarArgs)
		cfg.PrefillSidecarArgs = strings.Fields(o.prefillSCArgs)
		cfg.ControlPlaneArgs = strings.Fields(o.cpArgs)
		cfg.GatewayArgs = strings.Fields(o.gwArgs)
		if o.advertised > 0 {
			cfg.SidecarArgs = append(cfg.SidecarArgs, "--kv-capacity-tokens", fmt.Sprint(o.advertised))
			cfg.Meta.Notes = append(cfg.Meta.Notes, fmt.Sprintf("decode sidecars report %d tokens of capacity to the control plane (the pools hold %d): the control plane admits by that count and each decode worker's LRU evicts idle sessions when it runs short", o.advertised, o.capacity))
		}
		cfg.Meta.SimTimeScale, cfg.Meta.DecodeCapacityTokens, cfg.Meta.SimArgs = o.simTimeScale, o.capacity, simArgs
		if o.workerKind != "refworker" { // a refworker's time is real: its timers run at real speed
			cfg.TimerScale = o.simTimeScale
			if o.simTimeScale != 1 {
				cfg.Meta.Notes = append(cfg.Meta.Notes, fmt.Sprintf("timers scaled with the model: every sidecar runs with --time-scale %g (heartbeat, worker health probe, idle flush, release tick and minimum idle) and the policy's reservation_timeout_ms and unreachable_grace_ms are multiplied by %g, so load reports, settles and flushes are as stale in model seconds as at real speed", o.simTimeScale, o.simTimeScale))
			}
		}
		if o.simTimeScale == o.timeScale && o.workerKind != "refworker" { // a refworker's time is real: never rescaled
			cfg.Meta.TimeDiv = o.timeScale
		}
	}
	if len(o.sweep.Loads)+len(o.sweep.PerShape) > 0 {
		return runSweep(ctx, o, cfg, stderr)
	}
	if len(o.shapes) > 0 {
		return runShapes(ctx, o, cfg, stderr)
	}
	arms, err := bench.Run(ctx, cfg)
	printArms(stderr, cfg, arms)
	fmt.Fprintf(stderr, "report: %s\n", filepath.Join(o.out, report.ReportFile))
	if err != nil {
		fmt.Fprintln(stderr, "kvc-bench:", err)
		return 1
	}
	return 0
}

// forShape is base set up for one named shape: its workers, its decode pool, its targets, its
// directory under dir.
func forShape(o *opts, base bench.Config, sh bench.Shape, dir string) bench.Config {
	cfg := base
	cfg.Prefill, cfg.Decode = sh.Prefill, sh.Decode
	if sh.DecodeCapacityTokens > 0 {
		cfg.DecodeCapacityTokens = sh.DecodeCapacityTokens
		cfg.Meta.DecodeCapacityTokens = sh.DecodeCapacityTokens
	}
	cfg.OutDir = filepath.Join(dir, sh.Name)
	cfg.Meta.Shape, cfg.Meta.Targets = sh.Name, bench.ShapeTargets(sh)
	if o.workerKind == "sim" {
		cfg.Meta.Target = fmt.Sprintf("local cluster per arm, shape %s: %d prefill + %d decode kvc-sim workers with their sidecars (tcp transfer engine), 2 control planes (HA pair, embedded etcd), kvc-gateway", sh.Name, sh.Prefill, sh.Decode)
	}
	return cfg
}

// runShapes runs every arm on each shape of o.shapes in turn, each into OUT/SHAPE, then the
// top-level summary.json and report.md.
func runShapes(ctx context.Context, o *opts, base bench.Config, stderr io.Writer) int {
	var runs []report.ShapeRun
	rc := 0
	for _, sh := range o.shapes {
		cfg := forShape(o, base, sh, o.out)
		fmt.Fprintf(stderr, "shape %s: into %s\n", sh.Name, cfg.OutDir)
		arms, meta, err := bench.RunMeta(ctx, cfg)
		printArms(stderr, cfg, arms)
		if err != nil {
			fmt.Fprintln(stderr, "kvc-bench:", sh.Name+":", err)
			if meta.Aborted == "" {
				meta.Aborted = err.Error()
			}
			rc = 1
		}
		runs = append(runs, report.ShapeRun{Name: sh.Name, Meta: meta, Arms: arms})
		if ctx.Err() != nil {
			break
		}
	}
	if err := report.WriteShapes(o.out, runs); err != nil {
		fmt.Fprintln(stderr, "kvc-bench: report:", err)
		return 1
	}
	fmt.Fprintf(stderr, "report: %s\n", filepath.Join(o.out, report.ReportFile))
	return rc
}

func printArms(stderr io.Writer, cfg bench.Config, arms []*report.Arm) {
	unit := "s"
	if cfg.Meta.TimeDiv > 0 && cfg.Meta.TimeDiv != 1 {
		unit = "model s"
	}
	for _, a := range arms {
		s := a.Summary
		fmt.Fprintf(stderr, "%s (%s): ok %d/%d  TTFT p50 %.3fs p99 %.3fs  goodput %.3f req/s  direct-to-D %.1f%% (continuing %.1f%%)  reseeds %d (p50 %.3fs, snapshot %.0f%%, stale %d)  recovery %.3fs (excess %.3fs, %d sessions, %d unrecovered)  bytes %d  verify failures %d\n",
			a.Name, unit, s.OK, s.Total, s.TTFTP50, s.TTFTP99, s.GoodputRPS, 100*s.DirectToDShare, 100*s.DirectToDShareContinuing, s.ReseedCount, s.ReseedTTFTP50, 100*s.SnapshotHitRate, s.SnapshotStale,
			s.RecoveryS, s.RecoveryExcessS, s.AffectedSessions, s.Unrecovered, s.BytesMoved, s.KVVerifyFailures)
		if s.RecoveryControl {
			fmt.Fprintf(stderr, "%s: recovery excess paired with the run without the kill %.3fs (%d fallbacks to the usual TTFT)\n", a.Name, s.RecoveryExcessPairedS, s.RecoveryPairedFallbacks)
		}
		fmt.Fprintf(stderr, "%s: TTFT p99 continuing turns %.3fs  within SLO %d/%d  prefill busy %v  decode busy %v\n", a.Name, s.TTFTP99Continuing, s.SLOMet, s.Total, s.PrefillBusyS, s.DecodeBusyS)
	}
}

// runSweep runs every arm at each load of each shape of o.sweep: the built-in workload with
// sessions scaled by the load over the same arrival span, each into its own directory, then
// sweep.json (points and SLO capacity), sweep.md and the plots.
func runSweep(ctx context.Context, o *opts, base bench.Config, stderr io.Writer) int {
	type group struct {
		cfg   bench.Config
		name  string
		pool  int64
		loads []float64
	}
	var groups []group
	switch {
	case len(o.sweep.PerShape) > 0:
		for _, g := range o.sweep.PerShape {
			groups = append(groups, group{forShape(o, base, g.Shape, o.out), g.Shape.Name, g.Shape.DecodeCapacityTokens, g.Loads})
		}
	case len(o.shapes) > 0:
		for _, sh := range o.shapes {
			groups = append(groups, group{forShape(o, base, sh, o.out), sh.Name, sh.DecodeCapacityTokens, o.sweep.Loads})
		}
	default:
		c := base
		c.OutDir = o.out
		groups = append(groups, group{c, "", 0, o.sweep.Loads})
	}
	var shapes []report.SweepShape
	rc := 0
	for _, g := range groups {
		sh := report.SweepShape{Name: g.name, DecodeCapacityTokens: g.pool}
		if sh.DecodeCapacityTokens == 0 && g.name != "" {
			sh.DecodeCapacityTokens = g.cfg.DecodeCapacityTokens
		}
		for _, x := range g.loads {
			c := o.agentic
			c.Seed, c.Sessions = o.seed, max(1, int(math.Round(float64(o.sessions)*x)))
			wl, err := workload.Agentic(c)
			if err != nil {
				fmt.Fprintln(stderr, "kvc-bench: workload:", err)
				return 2
			}
			wl.Limit(o.maxRequests)
			cfg := g.cfg
			cfg.Workload = wl
			cfg.OutDir = filepath.Join(g.cfg.OutDir, fmt.Sprintf("load-%g", x))
			cfg.Meta.Workload, cfg.Meta.Stats, cfg.Meta.Notes = wl.Name, wl.Describe(), wl.Notes
			cfg.Meta.Notes = append(append([]string(nil), cfg.Meta.Notes...), fmt.Sprintf("load sweep point %g: %d sessions over %s", x, c.Sessions, c.ArrivalSpan))
			var arms []*report.Arm
			done, ok := finishedPoint(o.out, o.sweepFrom, cfg.OutDir, base.Arms, o.sweepReuse || o.sweepGather)
			switch {
			case ok:
				fmt.Fprintf(stderr, "sweep: %s load %g (%d sessions) read from %s\n", shapeOrCluster(g.name), x, c.Sessions, cfg.OutDir)
				arms = done
			case o.sweepGather:
				fmt.Fprintf(stderr, "sweep: %s load %g (%d sessions): %d of %d arms finished in %s, not run (--sweep-gather)\n", shapeOrCluster(g.name), x, c.Sessions, len(done), len(base.Arms), cfg.OutDir)
				arms, err = done, errors.New("not every arm finished (--sweep-gather runs nothing)")
			default:
				fmt.Fprintf(stderr, "sweep: %s load %g (%d sessions) into %s\n", shapeOrCluster(g.name), x, c.Sessions, cfg.OutDir)
				arms, err = bench.Run(ctx, cfg)
			}
			pt := report.SweepPoint{Load: x, Sessions: c.Sessions, Arms: map[string]report.Summary{}, Dir: cfg.OutDir}
			if span := c.ArrivalSpan.Seconds(); span > 0 {
				pt.SessionsPS = float64(c.Sessions) / span
			}
			for _, a := range arms {
				pt.Arms[a.Name] = a.Summary
				s := a.Summary
				fmt.Fprintf(stderr, "sweep: %s load %g %s: ok %d/%d within SLO %d goodput %.3f req/s TTFT p50 %.3fs p99 %.3fs (continuing %.3fs)\n", shapeOrCluster(g.name), x, a.Name, s.OK, s.Total, s.SLOMet, s.GoodputRPS, s.TTFTP50, s.TTFTP99, s.TTFTP99Continuing)
			}
			if err != nil {
				pt.Aborted = err.Error()
				rc = 1
			}
			sh.Points = append(sh.Points, pt)
			if ctx.Err() != nil {
				break
			}
		}
		shapes = append(shapes, sh)
		if ctx.Err() != nil {
			break
		}
	}
	if err := report.WriteSweep(o.out, base.SLO, base.Arms, shapes); err != nil {
		fmt.Fprintln(stderr, "kvc-bench: sweep report:", err)
		return 1
	}
	fmt.Fprintf(stderr, "sweep report: %s\n", filepath.Join(o.out, report.SweepReport))
	return rc
}

func shapeOrCluster(name string) string {
	if name == "" {
		return "cluster"
	}
	return name
}

// finishedPoint reads a sweep point already run into dir (with --sweep-reuse): its summary.json,
// written when every arm has finished, and the same point's summary.json under each of the
// --sweep-from roots, must together hold every arm of this run; anything else (no file, a partial
// or unreadable one, an arm missing) runs the point again; the arms found are returned either way.
func finishedPoint(out string, from []string, dir string, arms []string, reuse bool) ([]*report.Arm, bool) {
	if !reuse {
		return nil, false
	}
	rel, err := filepath.Rel(out, dir)
	if err != nil {
		return nil, false
	}
	sums := map[string]report.Summary{}
	for _, root := range append([]string{out}, from...) {
		raw, err := os.ReadFile(filepath.Join(root, rel, report.SummaryFile))
		if err != nil {
			continue
		}
		var got map[string]report.Summary
		if err := json.Unmarshal(raw, &got); err != nil {
			continue
		}
		for name, s := range got {
			if _, seen := sums[name]; !seen {
				sums[name] = s
			}
		}
	}
	result := make([]*report.Arm, 0, len(arms))
	for _, name := range arms {
		if s, ok := sums[name]; ok {
			result = append(result, &report.Arm{Name: name, Summary: s})
		}
	}
	return result, len(result) == len(arms)
}
