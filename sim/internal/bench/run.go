package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sim/internal/cluster"
	"github.com/kvcentric/kvcentric/sim/internal/report"
	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

// Arms are the arms kvc-bench knows, in report order.
var Arms = []string{"E1", "PD", "SGL", "LLMD", "E3", "E4"}

// ArmPolicy is the policy an arm runs its local cluster with: E1, PD, SGL and LLMD are plain P/D
// to the control plane (KV-centric routing off; what differs is the workers' cache features,
// ArmSimArgs), E3 KV-centric without D→P snapshots, E4 KV-centric with them.
func ArmPolicy(arm string) (*kvcv1.Policy, error) {
	switch arm {
	case "E1", "PD", "SGL", "LLMD":
		return &kvcv1.Policy{KvCentricEnabled: proto.Bool(false), SnapshotsEnabled: proto.Bool(false)}, nil
	case "E3":
		return &kvcv1.Policy{KvCentricEnabled: proto.Bool(true), SnapshotsEnabled: proto.Bool(false)}, nil
	case "E4":
		return &kvcv1.Policy{KvCentricEnabled: proto.Bool(true), SnapshotsEnabled: proto.Bool(true)}, nil
	}
	return nil, fmt.Errorf("unknown arm %q (want one of %s)", arm, strings.Join(Arms, ", "))
}

// ArmPolicyFor is ArmPolicy with E4's seed_through_store set when seedThroughStore (kvc-bench
// --seed-through-store): E4 as the recommended SGLang deployment, colocated decode workers
// whose seeds and re-prefills go through P's store, so a decode worker holds no pages while a
// seed waits in P's queue (docs/routing.md §12); and E4's seed_through_store_when_short when
// whenShort (--seed-through-store-when-short: kvc-sim's decode workers take both, and a seed
// goes through the store only while its decode worker is short of pages). The other arms are
// unchanged.
func ArmPolicyFor(arm string, seedThroughStore, whenShort bool) (*kvcv1.Policy, error) {
	pol, err := ArmPolicy(arm)
	if err == nil && arm == "E4" {
		if seedThroughStore {
			pol.SeedThroughStore = proto.Bool(true)
		}
		if whenShort {
			pol.SeedThroughStoreWhenShort = proto.Bool(true)
		}
	}
	return pol, err
}

// Baselines are the sizes of the baseline models' caches (tokens).
type Baselines struct {
	// PrefixCacheTokens is every arm's prefill radix cache but E1's (0: the prefill pool's
	// capacity, PrefillCapacity).
	PrefixCacheTokens int64
	PrefillCapacity   int64
	// HostTierTokens is each decode host's CPU tier in LLMD (0: unbounded).
	HostTierTokens int64
}

// ArmSimArgs are the per-role kvc-sim flags that make an arm's workers the system it stands
// for (docs/benchmark.md, "Arms"); work is the arm's cluster directory (tiers live there), decode
// the number of decode workers.
func ArmSimArgs(arm, work string, decode int, b Baselines) (prefill, dec []string) {
	if arm == "E1" {
		return nil, nil
	}
	pc := b.PrefixCacheTokens
	if pc <= 0 {
		pc = b.PrefillCapacity
	}
	if pc <= 0 {
		pc = 92104 // kvc-sim's default pool
	}
	prefill = []string{"--prefix-cache-tokens", fmt.Sprint(pc)}
	switch arm {
	case "SGL":
		l3 := filepath.Join(work, "tier-l3")
		prefill = append(prefill, "--pull-dirs", l3)
		dec = []string{"--decode-radix", "--offload-dir", l3, "--restore-dirs", l3}
	case "LLMD":
		var hosts []string
		for i := 0; i < decode; i++ {
			hosts = append(hosts, hostTier(work, fmt.Sprintf("decode-%d", i)))
		}
		prefill = append(prefill, "--pull-dirs", strings.Join(hosts, ","))
		dec = []string{"--offload-dir", hostTier(work, "{worker}")}
		if b.HostTierTokens > 0 {
			dec = append(dec, "--offload-capacity-tokens", fmt.Sprint(b.HostTierTokens))
		}
	case "E4": // SGLang streaming sessions: freed only by the decode sidecar's release (ArmDecodeSidecarArgs)
		dec = []string{"--evict", "watermark"}
	}
	if arm == "E3" || arm == "E4" {
		// The gateway sends the decision's prefill priority as SGLang's request priority: P's
		// radix evicts the prefixes of sessions bound direct-to-D first (docs/sglang.md).
		prefill = append(prefill, "--radix-eviction-policy", "priority")
	}
	return prefill, dec
}

// ArmDecodeSidecarArgs are the decode sidecars' flags of an arm: E4's capacity release, the only
// thing that frees a streaming session on its decode workers (sidecar-decode's flag help).
func ArmDecodeSidecarArgs(arm string) []string {
	if arm == "E4" {
		return []string{"--release-high-watermark", "0.9"}
	}
	return nil
}

// ArmGatewayArgs are the gateway's flags of an arm: the baselines' gateways do not resume a
// request whose decode worker dies mid-stream (SGLang's router and llm-d's gateway do not;
// docs/gateway.md), the kvcentric arms' do (the gateway's default).
func ArmGatewayArgs(arm string) []string {
	switch arm {
	case "E1", "PD", "SGL", "LLMD":
		return []string{"--resume-mid-stream=false"}
	}
	return nil
}

// hostTier is the CPU tier directory of a decode worker's host (LLMD): it dies with the node.
func hostTier(work, worker string) string { return filepath.Join(work, "tier-host-"+worker) }

// Config is a whole kvc-bench run.
type Config struct {
	// Local starts a fresh cluster per arm; otherwise GatewayURL is used for one arm.
	Local      bool
	GatewayURL string
	Arms       []string
	BinDir     string
	OutDir     string
	Workload   *workload.Workload
	Meta       report.Meta
	Replay     Options // Arm and Out are set per arm
	// Cluster shape and worker flags for Local.
	Decode               int // decode workers (default 3)
	DecodeCapacityTokens int64
	SimArgs              []string
	SidecarArgs          []string
	PrefillSidecarArgs   []string
	// ControlPlaneArgs go to every control plane of each arm's cluster (e.g. "--log-level
	// debug"): a KVC_* environment variable does not reach them (pkg/launch.ChildEnv strips it).
	ControlPlaneArgs []string
	// GatewayArgs go to each arm's gateway (e.g. "--log-level debug": its "request" lines then
	// carry the decision's and open_session's time).
	GatewayArgs []string
	// WorkerKind "refworker" runs kvc-refworkers (a real model) instead of kvc-sim; see
	// cluster.Config for the Refworker fields.
	WorkerKind       string
	RefworkerPython  string
	RefworkerArgs    []string
	RefworkerDevices []string
	// Prefill workers (default 1), their pool, and the baseline models' cache sizes.
	Prefill               int
	PrefillCapacityTokens int64
	Baselines             Baselines
	// KillDecode names a decode worker (e.g. "decode-1") whose kvc-sim and sidecar are SIGKILLed
	// KillAt into each arm's replay (workload clock, scaled by Replay.TimeScale); KillMost
	// ("most") takes the one holding the most sessions at that moment (Holders), in every arm;
	// "" = none.
	KillDecode string
	KillAt     time.Duration
	// KillAfterRequests > 0 replaces KillAt: the kill comes once this many of the arm's
	// requests have completed ok (e.g. every session's first turn), whatever the time.
	KillAfterRequests int
	// KillDelay: with KillAfterRequests, the kill comes this long after the trigger (workload
	// clock, scaled by Replay.TimeScale).
	KillDelay time.Duration
	// KillWorkerOnly: the kill takes only the decode worker's kvc-sim (its process died, its
	// sidecar stays up and reports it: WORKER_DOWN) instead of the kvc-sim and its sidecar.
	KillWorkerOnly bool
	// RecoveryControl (with KillDecode): each arm first replays the workload once without the
	// kill on a fresh cluster (same trace, seed and flags; records into metrics-control.jsonl,
	// cluster under control/), and the kill run's recovery figures add the paired excess against
	// it (report.Options.Control).
	RecoveryControl bool
	// SLO of goodput.
	SLO report.SLO
	// Policy is merged over each arm's policy (nil: none).
	Policy *kvcv1.Policy
	// SeedThroughStore sets E4's seed_through_store, SeedThroughStoreWhenShort its
	// seed_through_store_when_short (ArmPolicyFor).
	SeedThroughStore          bool
	SeedThroughStoreWhenShort bool
	// TimerScale (Local) runs every decision-shaping timer of the sidecars and the control plane
	// this many times as fast (ScaleTimers): kvc-sim's time scale, so that at --time-scale X the
	// model sees the same staleness of load reports, idle flushes, release ticks and reservation
	// settles as at real speed. 0 or 1: real speed.
	TimerScale float64
	Log        io.Writer // progress lines
	TTY        bool
}

// Run replays the workload for every arm, then writes metrics.jsonl, summary.json, report.md
// and the plots into OutDir. It returns the arms' statistics.
func Run(ctx context.Context, cfg Config) ([]*report.Arm, error) {
	arms, _, err := RunMeta(ctx, cfg)
	return arms, err
}

// RunMeta is Run that also returns the report's Meta (for a report over several runs).
func RunMeta(ctx context.Context, cfg Config) ([]*report.Arm, report.Meta, error) {
	arms, meta, err := run(ctx, cfg)
	return arms, meta, err
}

func run(ctx context.Context, cfg Config) ([]*report.Arm, report.Meta, error) {
	// Absolute, so that paths in the report and in logs do not depend on the working directory
	// (the cluster makes its own WorkDir absolute too).
	abs, err := filepath.Abs(cfg.OutDir)
	if err != nil {
		return nil, cfg.Meta, err
	}
	cfg.OutDir = abs
	if err := os.MkdirAll(cfg.OutDir, 0o755); err != nil {
		return nil, cfg.Meta, err
	}
	mf, err := os.Create(filepath.Join(cfg.OutDir, "metrics.jsonl"))
	if err != nil {
		return nil, cfg.Meta, err
	}
	defer mf.Close()
	meta := cfg.Meta
	meta.ArmPolicies = map[string]string{}
	meta.ArmWall = map[string]time.Duration{}
	meta.ArmKills = map[string]float64{}
	meta.ArmSimArgs = map[string]string{}
	meta.ArmGatewayArgs = map[string]string{}
	meta.ArmPushBytes = map[string]int64{}
	meta.ArmKillTargets = map[string]report.KillTarget{}
	meta.SLO = cfg.SLO
	if cfg.KillDecode != "" {
		meta.KillWorker = cfg.KillDecode
		meta.KillWorkerOnly = cfg.KillWorkerOnly
	}
	var cf io.Writer
	if cfg.RecoveryControl && cfg.KillDecode != "" {
		f, err := os.Create(filepath.Join(cfg.OutDir, ControlMetricsFile))
		if err != nil {
			return nil, cfg.Meta, err
		}
		defer f.Close()
		cf = f
	}
	var arms []*report.Arm
	var runErr error
	for _, arm := range cfg.Arms {
		var control []report.Record
		if cf != nil {
			recs, err := runControl(ctx, cfg, arm, cf)
			if err != nil {
				runErr = fmt.Errorf("arm %s: the control run without the kill: %w", arm, err)
				meta.Aborted = runErr.Error()
				break
			}
			control = recs
		}
		t0 := time.Now()
		var nodes report.NodeFigures
		recs, err := runArm(ctx, cfg, arm, mf, &meta, &nodes)
		meta.ArmWall[arm] = time.Since(t0)
		if len(recs) > 0 || err == nil {
			opt := report.Options{SLO: cfg.SLO, Control: control}
			kt, killed := meta.ArmKillTargets[arm]
			if at, ok := meta.ArmKills[arm]; ok && killed {
				opt.Kill = &report.Kill{Worker: kt.Worker, AtS: at}
			}
			a := report.ComputeWith(arm, recs, meta.TimeDiv, opt)
			a.Summary.SetNodes(nodes, meta.TimeDiv)
			if killed {
				a.Summary.SetKill(kt)
			}
			arms = append(arms, a)
		}
		if err != nil {
			runErr = fmt.Errorf("arm %s: %w", arm, err)
			meta.Aborted = runErr.Error()
			break
		}
	}
	if werr := report.Write(cfg.OutDir, meta, arms); werr != nil {
		return arms, meta, errors.Join(runErr, werr)
	}
	return arms, meta, runErr
}

// ControlMetricsFile holds the records of the replays without the kill (Config.RecoveryControl).
const ControlMetricsFile = "metrics-control.jsonl"

// runControl replays arm once as the kill run would but without the kill, on a fresh cluster
// under OutDir/control (its figures other than the records are not kept), and returns its records
// (never nil on success).
func runControl(ctx context.Context, cfg Config, arm string, out io.Writer) ([]report.Record, error) {
	c := cfg
	c.KillDecode, c.KillAfterRequests = "", 0
	c.OutDir = filepath.Join(cfg.OutDir, "control")
	if err := os.MkdirAll(c.OutDir, 0o755); err != nil {
		return nil, err
	}
	c.Log = prefixWriter{cfg.Log, "control "}
	scratch := report.Meta{ArmPolicies: map[string]string{}, ArmWall: map[string]time.Duration{}, ArmKills: map[string]float64{},
		ArmSimArgs: map[string]string{}, ArmGatewayArgs: map[string]string{}, ArmPushBytes: map[string]int64{}, ArmKillTargets: map[string]report.KillTarget{}}
	var nodes report.NodeFigures
	recs, err := runArm(ctx, c, arm, out, &scratch, &nodes)
	if err == nil && recs == nil {
		recs = []report.Record{}
	}
	return recs, err
}

func runArm(ctx context.Context, cfg Config, arm string, out io.Writer, meta *report.Meta, nodes *report.NodeFigures) ([]report.Record, error) {
	url := cfg.GatewayURL
	var cl *cluster.Cluster
	if cfg.Local {
		pol, err := ArmPolicyFor(arm, cfg.SeedThroughStore, cfg.SeedThroughStoreWhenShort)
		if err != nil {
			return nil, err
		}
		if cfg.Policy != nil {
			proto.Merge(pol, cfg.Policy)
		}
		ScalePolicyTimers(pol, cfg.TimerScale)
		meta.ArmPolicies[arm] = strings.ReplaceAll(protojson.MarshalOptions{}.Format(pol), "  ", " ")
		work := filepath.Join(cfg.OutDir, "cluster-"+arm)
		_ = os.RemoveAll(work)
		decode := cfg.Decode
		if decode <= 0 {
			decode = 3
		}
		prefill := max(cfg.Prefill, 1)
		bl := cfg.Baselines
		bl.PrefillCapacity = cfg.PrefillCapacityTokens
		psa, dsa := ArmSimArgs(arm, work, decode, bl)
		if len(psa)+len(dsa) > 0 {
			meta.ArmSimArgs[arm] = fmt.Sprintf("prefill `%s`; decode `%s`", strings.Join(psa, " "), strings.Join(dsa, " "))
		}
		if ga := ArmGatewayArgs(arm); len(ga) > 0 {
			meta.ArmGatewayArgs[arm] = strings.Join(ga, " ")
		}
		fmt.Fprintf(cfg.Log, "%s: starting a local cluster (%d P + %d D, 2 control planes, gateway) in %s\n", arm, prefill, decode, work)
		ccfg := cluster.Config{
			BinDir: cfg.BinDir, WorkDir: work, Prefill: prefill, Decode: decode, ControlPlanes: 2,
			PrefillCapacityTokens: cfg.PrefillCapacityTokens, PrefillSimArgs: psa, DecodeSimArgs: dsa,
			DecodeCapacityTokens: cfg.DecodeCapacityTokens, Policy: pol, SimArgs: cfg.SimArgs, SidecarArgs: append(SidecarTimerArgs(cfg.TimerScale), cfg.SidecarArgs...),
			Gateway: true, Log: prefixWriter{cfg.Log, arm + ": "},
			WorkerKind: cfg.WorkerKind, RefworkerPython: cfg.RefworkerPython, RefworkerArgs: cfg.RefworkerArgs,
			RefworkerDevices: cfg.RefworkerDevices, PrefillSidecarArgs: cfg.PrefillSidecarArgs, DecodeSidecarArgs: ArmDecodeSidecarArgs(arm),
			GatewayArgs: append(ArmGatewayArgs(arm), cfg.GatewayArgs...), ControlPlaneArgs: cfg.ControlPlaneArgs,
		}
		// Every process binds port 0 and reports what it bound: no port race to retry.
		c, err := cluster.Start(ctx, ccfg)
		if err != nil {
			return nil, err
		}
		defer func() {
			// Metrics from the live processes first, then the event logs they flushed on exit.
			*nodes = scrapeNodes(c)
			if err := c.Stop(); err != nil {
				fmt.Fprintf(cfg.Log, "%s: stopping the cluster: %v\n", arm, err)
			}
			addLogBytes(c, nodes)
		}()
		url = c.GatewayURL
		cl = c
	}
	opt := cfg.Replay
	opt.Arm = arm
	opt.Out = out
	opt.Holders = NewHolders()
	pr := NewProgress(cfg.Log, cfg.TTY, arm)
	opt.Progress = pr.Update
	fmt.Fprintf(cfg.Log, "%s: replaying %d requests of %d sessions against %s\n", arm, cfg.Workload.Requests(), len(cfg.Workload.Sessions), url)
	if cl == nil {
		return Replay(ctx, url, cfg.Workload, opt)
	}
	defer func() { meta.ArmPushBytes[arm] = pushBytes(cl) }()
	if cfg.KillDecode == "" {
		return Replay(ctx, url, cfg.Workload, opt)
	}
	// The kill: the decode worker's kvc-sim and sidecar die together (a node lost), and with
	// them its host's CPU tier (LLMD); with KillWorkerOnly only the kvc-sim (the engine crashed,
	// its sidecar lives and reports it down) and the tier, which lives in the engine's memory.
	start := time.Now()
	kctx, cancel := context.WithCancel(ctx)
	defer cancel()
	killed := make(chan float64, 1)
	var after *afterRequests
	if cfg.KillAfterRequests > 0 {
		after = newAfterRequests(cfg.KillAfterRequests)
		opt.Progress = after.wrap(opt.Progress)
	}
	go func() {
		if after != nil {
			select {
			case <-after.fired:
			case <-kctx.Done():
				fmt.Fprintf(cfg.Log, "%s: no kill: fewer than %d requests completed ok\n", arm, cfg.KillAfterRequests)
				close(killed)
				return
			}
			if !sleepUntil(kctx, time.Now().Add(time.Duration(float64(cfg.KillDelay)*opt.TimeScale))) {
				close(killed)
				return
			}
		} else if !sleepUntil(kctx, start.Add(time.Duration(float64(cfg.KillAt)*opt.TimeScale))) {
			close(killed)
			return
		}
		kt := killTarget(cl, cfg.KillDecode, opt.Holders)
		at := time.Since(start).Seconds()
		names := []string{"sim-" + kt.Worker, "sidecar-" + kt.Worker}
		if cfg.KillWorkerOnly {
			names = names[:1]
		}
		for _, name := range names {
			if err := cl.Kill(name); err != nil {
				fmt.Fprintf(cfg.Log, "%s: kill: %v\n", arm, err)
			}
		}
		_ = os.RemoveAll(hostTier(filepath.Join(cfg.OutDir, "cluster-"+arm), kt.Worker))
		fmt.Fprintf(cfg.Log, "%s: killed %s at %.1f s into the replay (it held %d sessions, %d resident in its pool)\n", arm, kt.Worker, at, kt.Sessions, kt.Resident)
		meta.ArmKillTargets[arm] = kt
		killed <- at
	}()
	recs, err := Replay(ctx, url, cfg.Workload, opt)
	cancel()
	if at, ok := <-killed; ok {
		meta.ArmKills[arm] = at
	}
	return recs, err
}

// killTarget is the decode worker the kill takes: the named one, or with KillMost the one
// holding the most sessions now (Holders; a tie goes to more resident sessions in its pool, then
// the lower id), and what it holds.
func killTarget(cl *cluster.Cluster, which string, h *Holders) report.KillTarget {
	var ids []string
	for _, w := range cl.Workers {
		if w.Role == "decode" {
			ids = append(ids, w.ID)
		}
	}
	resident := residentSessions(cl)
	kt := report.KillTarget{Worker: which}
	if which == KillMost {
		kt.Worker, kt.Sessions = h.Most(ids, resident)
	} else {
		kt.Sessions = h.Count(which)
	}
	kt.Resident = -1
	if n, ok := resident[kt.Worker]; ok {
		kt.Resident = n
	}
	return kt
}

// residentSessions reads each live decode worker's kvc_sim_resident_sessions (a worker that does
// not answer is left out).
func residentSessions(cl *cluster.Cluster) map[string]int {
	hc := &http.Client{Timeout: 2 * time.Second}
	out := map[string]int{}
	for _, w := range cl.Workers {
		if w.Role != "decode" || w.WorkerURL == "" {
			continue
		}
		if m, err := scrape(hc, w.WorkerURL, "kvc_sim_resident_sessions"); err == nil {
			out[w.ID] = int(m["kvc_sim_resident_sessions"])
		}
	}
	return out
}

// prefixWriter prefixes each write (the cluster writes whole lines).
type prefixWriter struct {
	w      io.Writer
	prefix string
}

func (p prefixWriter) Write(b []byte) (int, error) {
	if p.w == nil {
		return len(b), nil
	}
	if _, err := io.WriteString(p.w, p.prefix+string(b)); err != nil {
		return 0, err
	}
	return len(b), nil
}

// pushBytes is the D→P snapshot bytes the live decode sidecars pushed (the sum of their
// kvc_snapshot_push_bytes histograms; a killed worker's count is lost with it).
func pushBytes(c *cluster.Cluster) int64 {
	hc := &http.Client{Timeout: 5 * time.Second}
	var total float64
	for _, w := range c.Workers {
		if w.Role != "decode" || w.SidecarHTTP == "" {
			continue
		}
		resp, err := hc.Get(strings.TrimRight(w.SidecarHTTP, "/") + "/metrics")
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "kvc_snapshot_push_bytes_sum "); ok {
				if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
					total += f
				}
			}
		}
		resp.Body.Close()
	}
	return int64(total)
}
