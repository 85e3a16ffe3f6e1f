package cluster

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/kvcentric/kvcentric/pkg/launch"
)

// Process is one child process of the cluster: pkg/launch's, with its role.
type Process struct {
	*launch.Process
	Role string // controlplane, sidecar-prefill, sidecar-decode, sim-prefill, sim-decode, gateway

	killed atomic.Bool // killed on purpose (KillLeader): its exit is not a failure
}

// spawn starts bin with args (plus --ready-file), output to logDir/name.log.
func spawn(bin, name, role, logDir string, args []string) (*Process, error) {
	return spawnEnv(bin, name, role, logDir, args, nil)
}

// spawnEnv is spawn with extra environment variables (replacing the parent's of the same name).
func spawnEnv(bin, name, role, logDir string, args, env []string) (*Process, error) {
	p, err := launch.Start(launch.Spec{Name: name, Bin: bin, Args: args, Dir: logDir, Env: env})
	if err != nil {
		return nil, err
	}
	return &Process{Process: p, Role: role}, nil
}

// waitReady waits for the ready file, failing fast (with the log's tail) when the process exits
// first.
func (p *Process) waitReady(ctx context.Context) error {
	_, err := p.WaitReady(ctx)
	return err
}

// stop sends SIGTERM, waits up to grace, then SIGKILLs. It reports an unclean exit.
func (p *Process) stop(grace time.Duration) error { return p.Stop(grace) }

// kill sends SIGKILL and waits for the exit; the exit is not a failure.
func (p *Process) kill() {
	p.killed.Store(true)
	p.Kill()
}
