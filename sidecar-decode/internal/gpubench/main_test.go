package gpubench

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/launch"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/sidecar-decode/internal/proctest"
	"go.uber.org/goleak"
)

var bins = map[string]string{}

// TestMain finds the sidecar binaries in $KVC_BIN_DIR (bin/gpu on the GPU machine, which has
// no Go toolchain) or builds them (CGO_ENABLED=0).
func TestMain(m *testing.M) {
	var cleanup func()
	var err error
	bins, cleanup, err = launch.Binaries(os.Getenv("KVC_BIN_DIR"),
		map[string]string{"kvc-sidecar-decode": "../..", "kvc-sidecar-prefill": "../../../sidecar-prefill"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		cleanup()
		os.Exit(1)
	}
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) { cleanup(); os.Exit(code) }))
}

// proc is a running sidecar binary.
type proc = launch.Process

// start runs bin with args plus --ready-file and waits for the ready file; Stop gives a sidecar
// 20 s (a GPU sidecar frees gigabytes of pinned memory on its way out).
func start(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	p := launch.StartT(t, launch.Spec{Name: name, Bin: bin, Args: args}, 60*time.Second)
	p.StopGrace = 20 * time.Second
	return p
}

// readEvents parses a sidecar's event log (missing: none yet).
func readEvents(t *testing.T, path string) []sidecar.Event {
	t.Helper()
	return proctest.ReadEvents(t, path)
}

// waitFor polls cond (a read of another process's event log) until it holds.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	launch.WaitForT(t, what, d, 5*time.Millisecond, cond)
}
