// Command kvc-sidecar-decode runs beside one SGLang decode worker (one GPU): it owns the transfer
// engine, serves the worker's WorkerBridge on a Unix socket, tracks the sessions the worker holds
// (reported to the control plane), pushes D→P snapshots of them to their prefill sidecar and
// receives seed and reseed transfers into the worker's pages.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/sidecar-decode/internal/decode"
)

var version = "dev"

func main() { os.Exit(run(os.Args[1:], os.Getenv, os.Stderr)) }

// settings are the flags' values: the common ones and the decode core's (its runtime fields,
// filled by run once the agent runtime is up, left zero).
type settings struct {
	common sidecar.Common
	core   decode.Config
}

// parse reads and checks the flags (an error exits 2). Every decision-shaping timer is at
// --time-scale here: the idle flush, the release tick and the release's minimum idle time (the
// heartbeat and health probe interval in sidecar.Start).
func parse(args []string, getenv func(string) string, stderr io.Writer) (*settings, error) {
	fs := flag.NewFlagSet("kvc-sidecar-decode", flag.ContinueOnError)
	fs.SetOutput(stderr)
	st := &settings{}
	c := &st.common
	c.Register(fs)
	delta := fs.Int64("snapshot-delta-tokens", decode.DefaultDeltaTokens, "push a snapshot when committed - last pushed >= this (the control plane's policy overrides)")
	workers := fs.Int("push-workers", 2, "concurrent snapshot pushes")
	pushTimeout := fs.Duration("push-timeout", 120*time.Second, "budget of one snapshot push attempt")
	roomTimeout := fs.Duration("room-timeout", 120*time.Second, "a prepared room without TransferDone fails after this")
	creditPages := fs.Int64("snapshot-credit-pages", 256, "store credit kept at each snapshot store: free store pages a full push copies its first tokens into while its reservation is on the way (0 disables)")
	relHigh := fs.Float64("release-high-watermark", 0, "capacity release: above this fraction of the KV pool, release idle sessions whose snapshot is current (WorkerReleaseCommand to the worker); 0 disables (for workers that never evict, e.g. SGLang streaming sessions: 0.9)")
	relLow := fs.Float64("release-low-watermark", 0.8, "capacity release: release down to this fraction of the KV pool (below the high watermark)")
	relIdle := fs.Duration("release-min-idle", 5*time.Second, "capacity release: never release a session committed more recently than this (at --time-scale)")
	idleFlush := fs.Duration("snapshot-idle-flush", 2*time.Second, "push a session's unpushed tail, whatever --snapshot-delta-tokens says, once it had no commit for this long (at --time-scale; keeps idle sessions' snapshots current for a reseed after an eviction); 0 disables")
	if err := flagenv.Parse(fs, args, getenv); err != nil {
		return nil, err
	}
	err := c.Check()
	switch {
	case err != nil:
	case *delta <= 0:
		err = fmt.Errorf("--snapshot-delta-tokens must be positive")
	case *workers < 1 || *workers > 64:
		err = fmt.Errorf("--push-workers %d out of range [1, 64]", *workers)
	case *creditPages < 0:
		err = fmt.Errorf("--snapshot-credit-pages must not be negative")
	case *pushTimeout <= 0 || *roomTimeout <= 0:
		err = fmt.Errorf("--push-timeout and --room-timeout must be positive")
	case *idleFlush < 0 || *idleFlush > time.Hour:
		err = fmt.Errorf("--snapshot-idle-flush %v out of range [0, 1h] (0 disables)", *idleFlush)
	}
	rel := decode.ReleaseConfig{High: *relHigh, Low: *relLow, MinIdle: c.Scaled(*relIdle), Interval: c.Scaled(releaseTick)}
	if err == nil {
		if verr := rel.Validate(); verr != nil {
			err = fmt.Errorf("--release-high-watermark/--release-low-watermark/--release-min-idle: %v", verr)
		}
	}
	if err != nil {
		return nil, err
	}
	st.core = decode.Config{WorkerID: c.WorkerID, GPUIndex: int32(c.GPUIndex), WorkerURL: c.WorkerURL, TPGroup: c.TPGroup,
		Transport: c.Transport, KVCapacity: c.KVCapacityTokens, DeltaTokens: *delta, PushWorkers: *workers,
		PushTimeout: *pushTimeout, RoomTimeout: *roomTimeout, SnapshotCreditPages: *creditPages, Version: version,
		Release: rel, IdleFlush: c.Scaled(*idleFlush)}
	return st, nil
}

// releaseTick is the capacity release's check interval at real speed.
const releaseTick = time.Second

func run(args []string, getenv func(string) string, stderr io.Writer) int {
	st, err := parse(args, getenv, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvc-sidecar-decode:", err)
		return 2
	}
	c := &st.common
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rt, err := sidecar.Start(ctx, c, "kvc-sidecar-decode", stderr)
	if err != nil {
		fmt.Fprintln(stderr, "kvc-sidecar-decode:", err)
		return 1
	}
	cfg := st.core
	cfg.Node, cfg.PeerAddr, cfg.PeerDial = rt.Node, rt.PeerAddr, rt.PeerDialOptions()
	core := decode.New(cfg, rt.Engine, rt.Events, rt.Log)
	defer core.Close()
	rt.Reg.MustRegister(core.Collectors()...)
	if err := rt.Serve(ctx, core, func(cp *sidecar.ControlPlane) { core.SetReporter(cp) }); err != nil {
		rt.Log.Error().Err(err).Msg("sidecar stopped")
		return 1
	}
	return 0
}
