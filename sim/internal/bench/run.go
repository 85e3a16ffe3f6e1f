package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sim/internal/cluster"
	"github.com/kvcentric/kvcentric/sim/internal/report"
	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

// ArmPolicy is the policy an arm runs its local cluster with: E1 plain P/D (KV-centric routing
// off), E3 KV-centric without D→P snapshots, E4 KV-centric with them.
func ArmPolicy(arm string) (*kvcv1.Policy, error) {
	switch arm {
	case "E1":
		return &kvcv1.Policy{KvCentricEnabled: proto.Bool(false), SnapshotsEnabled: proto.Bool(false)}, nil
	case "E3":
		return &kvcv1.Policy{KvCentricEnabled: proto.Bool(true), SnapshotsEnabled: proto.Bool(false)}, nil
	case "E4":
		return &kvcv1.Policy{KvCentricEnabled: proto.Bool(true), SnapshotsEnabled: proto.Bool(true)}, nil
	}
	return nil, fmt.Errorf("unknown arm %q (want E1, E3 or E4)", arm)
}

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
	// WorkerKind "refworker" runs kvc-refworkers (a real model) instead of kvc-sim; see
	// cluster.Config for the Refworker fields.
	WorkerKind       string
	RefworkerPython  string
	RefworkerArgs    []string
	RefworkerDevices []string
	// Policy is merged over each arm's policy (nil: none).
	Policy *kvcv1.Policy
	Log    io.Writer // progress lines
	TTY    bool
}

// Run replays the workload for every arm, then writes metrics.jsonl, summary.json, report.md
// and the plots into OutDir. It returns the arms' statistics.
func Run(ctx context.Context, cfg Config) ([]*report.Arm, error) {
	// Absolute, so that paths in the report and in logs do not depend on the working directory
	// (the cluster makes its own WorkDir absolute too).
	abs, err := filepath.Abs(cfg.OutDir)
	if err != nil {
		return nil, err
	}
	cfg.OutDir = abs
	if err := os.MkdirAll(cfg.OutDir, 0o755); err != nil {
		return nil, err
	}
	mf, err := os.Create(filepath.Join(cfg.OutDir, "metrics.jsonl"))
	if err != nil {
		return nil, err
	}
	defer mf.Close()
	meta := cfg.Meta
	meta.ArmPolicies = map[string]string{}
	meta.ArmWall = map[string]time.Duration{}
	var arms []*report.Arm
	var runErr error
	for _, arm := range cfg.Arms {
		t0 := time.Now()
		recs, err := runArm(ctx, cfg, arm, mf, &meta)
		meta.ArmWall[arm] = time.Since(t0)
		if len(recs) > 0 || err == nil {
			arms = append(arms, report.Compute(arm, recs, meta.TimeDiv))
		}
		if err != nil {
			runErr = fmt.Errorf("arm %s: %w", arm, err)
			meta.Aborted = runErr.Error()
			break
		}
	}
	if werr := report.Write(cfg.OutDir, meta, arms); werr != nil {
		return arms, errors.Join(runErr, werr)
	}
	return arms, runErr
}

func runArm(ctx context.Context, cfg Config, arm string, out io.Writer, meta *report.Meta) ([]report.Record, error) {
	url := cfg.GatewayURL
	if cfg.Local {
		pol, err := ArmPolicy(arm)
		if err != nil {
			return nil, err
		}
		if cfg.Policy != nil {
			proto.Merge(pol, cfg.Policy)
		}
		meta.ArmPolicies[arm] = strings.ReplaceAll(protojson.MarshalOptions{}.Format(pol), "  ", " ")
		work := filepath.Join(cfg.OutDir, "cluster-"+arm)
		_ = os.RemoveAll(work)
		decode := cfg.Decode
		if decode <= 0 {
			decode = 3
		}
		fmt.Fprintf(cfg.Log, "%s: starting a local cluster (1 P + %d D, 2 control planes, gateway) in %s\n", arm, decode, work)
		ccfg := cluster.Config{
			BinDir: cfg.BinDir, WorkDir: work, Prefill: 1, Decode: decode, ControlPlanes: 2,
			DecodeCapacityTokens: cfg.DecodeCapacityTokens, Policy: pol, SimArgs: cfg.SimArgs, SidecarArgs: cfg.SidecarArgs,
			Gateway: true, Log: prefixWriter{cfg.Log, arm + ": "},
			WorkerKind: cfg.WorkerKind, RefworkerPython: cfg.RefworkerPython, RefworkerArgs: cfg.RefworkerArgs,
			RefworkerDevices: cfg.RefworkerDevices, PrefillSidecarArgs: cfg.PrefillSidecarArgs,
		}
		// Every process binds port 0 and reports what it bound: no port race to retry.
		c, err := cluster.Start(ctx, ccfg)
		if err != nil {
			return nil, err
		}
		defer func() {
			if err := c.Stop(); err != nil {
				fmt.Fprintf(cfg.Log, "%s: stopping the cluster: %v\n", arm, err)
			}
		}()
		url = c.GatewayURL
	}
	opt := cfg.Replay
	opt.Arm = arm
	opt.Out = out
	pr := NewProgress(cfg.Log, cfg.TTY, arm)
	opt.Progress = pr.Update
	fmt.Fprintf(cfg.Log, "%s: replaying %d requests of %d sessions against %s\n", arm, cfg.Workload.Requests(), len(cfg.Workload.Sessions), url)
	return Replay(ctx, url, cfg.Workload, opt)
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
