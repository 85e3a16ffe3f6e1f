// Command kvc-sidecar-prefill runs beside one SGLang prefill worker (one GPU): it owns the
// transfer engine, serves the worker's WorkerBridge on a Unix socket, keeps the
// PrefillSnapshotStore (D→P snapshots, in its own host memory or, with --store-memory cuda, in
// GPU memory), writes seeds and reseeds into
// decode workers' pages, and reports to the control plane.
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
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/prefill"
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

var version = "dev"

func main() { os.Exit(run(os.Args[1:], os.Getenv, os.Stderr)) }

func run(args []string, getenv func(string) string, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvc-sidecar-prefill", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var c sidecar.Common
	c.Register(fs)
	storeBytes := fs.Int64("store-capacity-bytes", 8<<30, "snapshot store capacity in bytes")
	storeMem := fs.String("store-memory", store.MemoryHost, "snapshot store memory: host (with --transport cuda a page-locked shared-memory file, a memfd, that decode sidecars map and push into) or cuda (device memory of --gpu-index; --transport cuda only)")
	roomTimeout := fs.Duration("room-timeout", 60*time.Second, "a transfer room whose other half never comes is failed after this")
	creditTimeout := fs.Duration("snapshot-credit-timeout", 5*time.Minute, "a decode writer's store credit (free pages it may push into before its reservation) left unused this long is freed")
	if err := flagenv.Parse(fs, args, getenv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, "kvc-sidecar-prefill:", err)
		return 2
	}
	err := c.Check()
	switch {
	case err != nil:
	case *storeBytes <= 0:
		err = fmt.Errorf("--store-capacity-bytes must be positive")
	case *storeMem != store.MemoryHost && *storeMem != store.MemoryCUDA:
		err = fmt.Errorf("--store-memory %q: want host or cuda", *storeMem)
	case *storeMem == store.MemoryCUDA && c.Transport != "cuda":
		err = fmt.Errorf("--store-memory cuda needs --transport cuda (got %s)", c.Transport)
	case *roomTimeout <= 0:
		err = fmt.Errorf("--room-timeout must be positive")
	case *creditTimeout <= 0:
		err = fmt.Errorf("--snapshot-credit-timeout must be positive")
	}
	if err != nil {
		fmt.Fprintln(stderr, "kvc-sidecar-prefill:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rt, err := sidecar.Start(ctx, &c, "kvc-sidecar-prefill", stderr)
	if err != nil {
		fmt.Fprintln(stderr, "kvc-sidecar-prefill:", err)
		return 1
	}
	core := prefill.New(prefill.Config{WorkerID: c.WorkerID, Node: rt.Node, GPUIndex: int32(c.GPUIndex), WorkerURL: c.WorkerURL, TPGroup: c.TPGroup,
		Transport: c.Transport, PeerAddr: rt.PeerAddr, StoreBytes: *storeBytes, StoreMemory: *storeMem, KVCapacity: c.KVCapacityTokens,
		RoomTimeout: *roomTimeout, CreditTimeout: *creditTimeout, Version: version, PeerDial: rt.PeerDialOptions()}, rt.Engine, rt.Events, rt.Log)
	defer core.Close()
	rt.Reg.MustRegister(core.Collectors()...)
	if err := rt.Serve(ctx, core, func(cp *sidecar.ControlPlane) { core.SetReporter(cp) }); err != nil {
		rt.Log.Error().Err(err).Msg("sidecar stopped")
		return 1
	}
	return 0
}
