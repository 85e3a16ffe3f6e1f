package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/etcdembed"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Config says what cluster to start.
type Config struct {
	BinDir               string // where kvc-* binaries are (default: dir of os.Executable())
	WorkDir              string // logs, sockets, ready files, event logs (created)
	Prefill              int    // default 1
	Decode               int    // default 3
	ControlPlanes        int    // default 2 (an HA pair)
	DecodeCapacityTokens int64  // --kv-capacity-tokens of every decode kvc-sim (0: kvc-sim's default)
	// Policy is applied with AdminService/UpdatePolicy once a leader is elected, before any
	// worker connects (nil = the control plane's defaults).
	Policy  *kvcv1.Policy
	SimArgs []string // extra kvc-sim flags (timing model, bytes per token, time scale)
	Gateway bool     // start kvc-gateway
	Log     io.Writer

	// PrefillSimArgs and DecodeSimArgs go to one role's kvc-sims only, after SimArgs (the
	// baseline models' flags). In every sim argument "{worker}" is replaced by the worker's id.
	PrefillSimArgs, DecodeSimArgs []string

	// Optional extra flags per binary, and timeouts.
	ControlPlaneArgs []string
	SidecarArgs      []string
	// PrefillSidecarArgs go to prefill sidecars only, after SidecarArgs (e.g. --store-capacity-bytes).
	PrefillSidecarArgs []string
	// DecodeSidecarArgs go to decode sidecars only, after SidecarArgs (e.g. --release-high-watermark).
	DecodeSidecarArgs []string
	// SidecarWorkerURL, when set, is the --worker-url each sidecar gets for its worker (given
	// the worker, whose WorkerURL is set): a test puts a recording proxy in front of a worker's
	// API there. nil: the worker's own URL.
	SidecarWorkerURL func(w Worker) string
	GatewayArgs      []string
	// PrefillCapacityTokens is --kv-capacity-tokens of every prefill kvc-sim (0: default).
	PrefillCapacityTokens int64
	// StartTimeout bounds each start-up step (a group of processes getting ready, the wait for all
	// workers, the gateway's route stream); default 120s, generous for a loaded 2-core machine.
	StartTimeout time.Duration
	// StopGrace is how long Stop waits after SIGTERM before SIGKILL (default 10s).
	StopGrace time.Duration

	// WorkerKind is what runs next to each sidecar: "sim" (kvc-sim, the default) or
	// "refworker" (kvc-refworker: a real model's attention KV, integrations/refworker). A
	// refworker gets the same role, id, address, socket and capacity flags as kvc-sim, then
	// RefworkerArgs instead of SimArgs.
	WorkerKind string
	// RefworkerPython is the Python interpreter that runs "-m kvc_refworker" (default python3
	// on PATH; the venv of integrations/sglang/scripts/make-venv.sh has torch, transformers and
	// sglang).
	RefworkerPython string
	// RefworkerPath is prepended to PYTHONPATH for refworkers (default: the repository's
	// integrations/refworker and integrations/sglang, found from BinDir/..).
	RefworkerPath []string
	RefworkerArgs []string
	// RefworkerDevices places refworkers: worker k (prefill workers first, then decode) gets
	// --device RefworkerDevices[k % len], and its sidecar --gpu-index N for "cuda:N" (so a
	// --transport cuda sidecar opens the device its worker's pool lives on). Empty: no --device
	// (the refworker's default, cpu), sidecars --gpu-index = the worker's index in its role.
	RefworkerDevices []string
}

// Worker kinds.
const (
	WorkerKindSim       = "sim"
	WorkerKindRefworker = "refworker"
)

// Worker is one simulated worker and its sidecar.
type Worker struct {
	ID           string
	Role         string // prefill | decode
	WorkerURL    string // kvc-sim's HTTP API
	SidecarHTTP  string // the sidecar's metrics/health HTTP address (http://...)
	PeerAddr     string // the sidecar's TransferPeerService
	EventLog     string // the sidecar's JSON-lines event log
	BridgeSocket string
	ShmPath      string // kvc-sim's KV pool file
}

// Cluster is a running local cluster.
type Cluster struct {
	EtcdEndpoints     []string
	ControlPlaneAddrs []string // gRPC
	ControlPlaneHTTP  []string // http://host:port of each control plane's /metrics (same order)
	GatewayURL        string   // http://host:port ("" without gateway)
	Workers           []Worker
	Processes         []*Process

	cfg      Config
	etcd     *embed.Etcd
	sockDir  string
	ownSock  bool
	stopOnce sync.Once
	stopErr  error
	// gatewayArgs are every gateway's flags on this cluster (StartGateway).
	gatewayArgs []string
}

func (c *Cluster) logf(format string, a ...any) {
	if c.cfg.Log != nil {
		fmt.Fprintf(c.cfg.Log, format+"\n", a...)
	}
}

// Binaries are the programs a cluster runs.
var Binaries = []string{"kvc-controlplane", "kvc-sidecar-prefill", "kvc-sidecar-decode", "kvc-sim", "kvc-gateway"}

// MissingBinaries lists the binaries of Binaries absent from dir.
func MissingBinaries(dir string, gateway bool) []string {
	var out []string
	for _, b := range Binaries {
		if b == "kvc-gateway" && !gateway {
			continue
		}
		if st, err := os.Stat(filepath.Join(dir, b)); err != nil || st.IsDir() {
			out = append(out, b)
		}
	}
	return out
}

func (cfg *Config) defaults() error {
	if cfg.BinDir == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("bin dir: %w", err)
		}
		cfg.BinDir = filepath.Dir(exe)
	}
	if cfg.WorkDir == "" {
		return errors.New("cluster: WorkDir is required")
	}
	switch cfg.WorkerKind {
	case "":
		cfg.WorkerKind = WorkerKindSim
	case WorkerKindSim, WorkerKindRefworker:
	default:
		return fmt.Errorf("cluster: worker kind %q (want sim or refworker)", cfg.WorkerKind)
	}
	// Children get absolute paths (sockets, logs, data), whatever their working directory.
	abs, err := filepath.Abs(cfg.WorkDir)
	if err != nil {
		return fmt.Errorf("cluster: work dir: %w", err)
	}
	cfg.WorkDir = abs
	if cfg.BinDir, err = filepath.Abs(cfg.BinDir); err != nil {
		return fmt.Errorf("cluster: bin dir: %w", err)
	}
	if cfg.WorkerKind == WorkerKindRefworker {
		if cfg.RefworkerPython == "" {
			cfg.RefworkerPython = "python3"
		}
		if len(cfg.RefworkerPath) == 0 {
			root := repoRoot(cfg.BinDir)
			cfg.RefworkerPath = []string{filepath.Join(root, "integrations", "refworker"), filepath.Join(root, "integrations", "sglang")}
		}
		for i, d := range cfg.RefworkerPath {
			if cfg.RefworkerPath[i], err = filepath.Abs(d); err != nil {
				return fmt.Errorf("cluster: refworker path: %w", err)
			}
		}
	}
	if cfg.Prefill == 0 {
		cfg.Prefill = 1
	}
	if cfg.Decode == 0 {
		cfg.Decode = 3
	}
	if cfg.ControlPlanes == 0 {
		cfg.ControlPlanes = 2
	}
	switch {
	case cfg.Prefill < 0 || cfg.Prefill > 16:
		return fmt.Errorf("cluster: %d prefill workers out of range [1, 16]", cfg.Prefill)
	case cfg.Decode < 0 || cfg.Decode > 16:
		return fmt.Errorf("cluster: %d decode workers out of range [1, 16]", cfg.Decode)
	case cfg.ControlPlanes < 0 || cfg.ControlPlanes > 5:
		return fmt.Errorf("cluster: %d control planes out of range [1, 5]", cfg.ControlPlanes)
	case cfg.DecodeCapacityTokens < 0 || cfg.PrefillCapacityTokens < 0:
		return errors.New("cluster: negative capacity")
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = 120 * time.Second
	}
	if cfg.StopGrace <= 0 {
		cfg.StopGrace = 10 * time.Second
	}
	return nil
}

// Start brings up the cluster: an embedded etcd in this process, the control planes, the
// policy, then per worker its sidecar and kvc-sim, then the gateway; each waited for through its
// ready file. It waits until the leader lists every worker as READY. On any failure everything
// started so far is stopped and the error carries the failing process's log tail.
func Start(ctx context.Context, cfg Config) (*Cluster, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	miss := MissingBinaries(cfg.BinDir, cfg.Gateway)
	if cfg.WorkerKind == WorkerKindRefworker {
		miss = slices.DeleteFunc(miss, func(b string) bool { return b == "kvc-sim" })
	}
	if len(miss) > 0 {
		return nil, fmt.Errorf("cluster: missing binaries in %s: %s (run make build)", cfg.BinDir, strings.Join(miss, ", "))
	}
	if err := os.MkdirAll(cfg.WorkDir, 0o755); err != nil {
		return nil, fmt.Errorf("cluster: work dir: %w", err)
	}
	c := &Cluster{cfg: cfg}
	if err := c.start(ctx); err != nil {
		_ = c.Stop()
		return nil, err
	}
	return c, nil
}

func (c *Cluster) bin(name string) string { return filepath.Join(c.cfg.BinDir, name) }

func (c *Cluster) spawnProc(bin, name, role string, args []string) (*Process, error) {
	p, err := spawn(c.bin(bin), name, role, c.cfg.WorkDir, args)
	if err != nil {
		return nil, err
	}
	c.Processes = append(c.Processes, p)
	return p, nil
}

// repoRoot is the first of binDir's parents (bin/, bin/real/ ...), then the working directory,
// that holds integrations/refworker; binDir's parent when none does.
func repoRoot(binDir string) string {
	cands := []string{filepath.Dir(binDir), filepath.Dir(filepath.Dir(binDir))}
	if wd, err := os.Getwd(); err == nil {
		cands = append(cands, wd)
	}
	for _, d := range cands {
		if st, err := os.Stat(filepath.Join(d, "integrations", "refworker", "kvc_refworker")); err == nil && st.IsDir() {
			return d
		}
	}
	return cands[0]
}

// spawnRefworker starts "python -m kvc_refworker args" with the refworker packages on
// PYTHONPATH (the process is named and stopped like a kvc-sim).
func (c *Cluster) spawnRefworker(name, role string, args []string) (*Process, error) {
	py := c.cfg.RefworkerPython
	if !strings.ContainsRune(py, filepath.Separator) {
		lp, err := exec.LookPath(py)
		if err != nil {
			return nil, fmt.Errorf("%s: refworker python: %w", name, err)
		}
		py = lp
	}
	path := strings.Join(c.cfg.RefworkerPath, string(os.PathListSeparator))
	if old := os.Getenv("PYTHONPATH"); old != "" {
		path += string(os.PathListSeparator) + old
	}
	p, err := spawnEnv(py, name, role, c.cfg.WorkDir, append([]string{"-m", "kvc_refworker"}, args...),
		[]string{"PYTHONPATH=" + path, "PYTHONUNBUFFERED=1"})
	if err != nil {
		return nil, err
	}
	c.Processes = append(c.Processes, p)
	return p, nil
}

func (c *Cluster) waitAll(ctx context.Context, ps ...*Process) error {
	wctx, cancel := context.WithTimeout(ctx, c.cfg.StartTimeout)
	defer cancel()
	errs := make([]error, len(ps))
	var wg sync.WaitGroup
	for i, p := range ps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = p.waitReady(wctx)
			if errs[i] != nil {
				cancel() // fail fast: one failure ends the others' waits
			}
		}()
	}
	wg.Wait()
	for _, e := range errs { // the first real failure, not the cancellations it caused
		if e != nil && !errors.Is(e, context.Canceled) {
			return e
		}
	}
	return errors.Join(errs...)
}

func (c *Cluster) start(ctx context.Context) error {
	cfg := c.cfg
	// Unix socket paths are limited to 108 bytes: use a short directory when WorkDir is deep.
	c.sockDir = filepath.Join(cfg.WorkDir, "sock")
	if len(c.sockDir) > 80 {
		d, err := os.MkdirTemp("", "kvc-")
		if err != nil {
			return err
		}
		c.sockDir, c.ownSock = d, true
	} else if err := os.MkdirAll(c.sockDir, 0o700); err != nil {
		return err
	}

	c.logf("starting embedded etcd")
	etcdembed.ThrowawayWAL() // the cluster's etcd goes with it
	e, ep, err := etcdembed.StartSingle(ctx, cfg.WorkDir, filepath.Join(cfg.WorkDir, "etcd.log"))
	if err != nil {
		return err
	}
	c.etcd = e
	c.EtcdEndpoints = []string{ep}
	c.logf("etcd            %s", ep)

	var cps []*Process
	for i := 0; i < cfg.ControlPlanes; i++ {
		name := fmt.Sprintf("cp-%d", i)
		args := append([]string{
			"--node-id", name, "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
			"--etcd-endpoints", ep, "--data-dir", filepath.Join(cfg.WorkDir, name), "--insecure",
		}, cfg.ControlPlaneArgs...)
		p, err := c.spawnProc("kvc-controlplane", name, "controlplane", args)
		if err != nil {
			return err
		}
		cps = append(cps, p)
	}
	if err := c.waitAll(ctx, cps...); err != nil {
		return err
	}
	for _, p := range cps {
		c.ControlPlaneAddrs = append(c.ControlPlaneAddrs, p.ReadyString("grpc_addr"))
		if h := p.ReadyString("http_addr"); h != "" {
			c.ControlPlaneHTTP = append(c.ControlPlaneHTTP, "http://"+h)
		}
		c.logf("control plane   %s grpc %s http %s", p.Name, p.ReadyString("grpc_addr"), p.ReadyString("http_addr"))
	}
	if cfg.Policy != nil {
		if err := c.applyPolicy(ctx, cfg.Policy); err != nil {
			return err
		}
		c.logf("policy applied")
	}

	cpList := strings.Join(c.ControlPlaneAddrs, ",")
	// Every port is bound by the process that serves on it (port 0) and read back from what it
	// writes: kvc-sim first (its addr file, written once bound), since its sidecar advertises the
	// worker's URL; then the sidecars; then both ready files.
	type pair struct {
		w            Worker
		gpu          int
		sidecar, sim *Process
	}
	var pairs []*pair
	var all []*Process
	k := 0 // worker number across roles (refworker placement)
	for _, rc := range []struct {
		role string
		n    int
	}{{"prefill", cfg.Prefill}, {"decode", cfg.Decode}} {
		for i := 0; i < rc.n; i++ {
			id := fmt.Sprintf("%s-%d", rc.role, i)
			w := Worker{ID: id, Role: rc.role,
				BridgeSocket: filepath.Join(c.sockDir, id+".sock"),
				EventLog:     filepath.Join(cfg.WorkDir, id+".events.jsonl")}
			_ = os.Remove(w.BridgeSocket)
			_ = os.Remove(c.addrFile("sim-" + id)) // a reused work dir's old one
			simArgs := []string{"--role", rc.role, "--worker-id", id, "--http-addr", "127.0.0.1:0", "--bridge-socket", w.BridgeSocket,
				"--addr-file", c.addrFile("sim-" + id)}
			capTokens := cfg.DecodeCapacityTokens
			if rc.role == "prefill" {
				capTokens = cfg.PrefillCapacityTokens
			}
			if capTokens > 0 {
				simArgs = append(simArgs, "--kv-capacity-tokens", strconv.FormatInt(capTokens, 10))
			}
			var sim *Process
			var err error
			gpu := i
			if cfg.WorkerKind == WorkerKindRefworker {
				rargs := append([]string(nil), simArgs...)
				if n := len(cfg.RefworkerDevices); n > 0 {
					dev := cfg.RefworkerDevices[k%n]
					rargs = append(rargs, "--device", dev)
					if d, ok := strings.CutPrefix(dev, "cuda:"); ok {
						if g, err := strconv.Atoi(d); err == nil {
							gpu = g
						}
					} else if dev == "cuda" {
						gpu = 0
					}
				}
				sim, err = c.spawnRefworker("sim-"+id, "sim-"+rc.role, append(rargs, cfg.RefworkerArgs...))
			} else {
				extra := append(append([]string(nil), cfg.SimArgs...), cfg.DecodeSimArgs...)
				if rc.role == "prefill" {
					extra = append(append([]string(nil), cfg.SimArgs...), cfg.PrefillSimArgs...)
				}
				for j := range extra {
					extra[j] = strings.ReplaceAll(extra[j], "{worker}", id)
				}
				sim, err = c.spawnProc("kvc-sim", "sim-"+id, "sim-"+rc.role, append(simArgs, extra...))
			}
			if err != nil {
				return err
			}
			pairs = append(pairs, &pair{w: w, gpu: gpu, sim: sim})
			k++
		}
	}
	sims := make([]*Process, len(pairs))
	for i, pr := range pairs {
		sims[i] = pr.sim
	}
	addrs, err := c.waitAddrs(ctx, sims)
	if err != nil {
		return err
	}
	for i, pr := range pairs {
		pr.w.WorkerURL = httpURL(addrs[i])
	}
	for _, pr := range pairs {
		w := pr.w
		workerURL := w.WorkerURL
		if cfg.SidecarWorkerURL != nil {
			workerURL = cfg.SidecarWorkerURL(w)
		}
		scArgs := append([]string{
			"--worker-id", w.ID, "--node", "local", "--gpu-index", strconv.Itoa(pr.gpu),
			"--worker-url", workerURL, "--control-plane", cpList, "--bridge-socket", w.BridgeSocket,
			"--http-addr", "127.0.0.1:0", "--peer-addr", "127.0.0.1:0", "--transport", "tcp",
			"--transfer-addr", "127.0.0.1:0", "--event-log", w.EventLog, "--insecure",
		}, cfg.SidecarArgs...)
		if w.Role == "prefill" {
			scArgs = append(scArgs, cfg.PrefillSidecarArgs...)
		} else {
			scArgs = append(scArgs, cfg.DecodeSidecarArgs...)
		}
		sc, err := c.spawnProc("kvc-sidecar-"+w.Role, "sidecar-"+w.ID, "sidecar-"+w.Role, scArgs)
		if err != nil {
			return err
		}
		pr.sidecar = sc
		all = append(all, sc, pr.sim)
	}
	if err := c.waitAll(ctx, all...); err != nil {
		return err
	}
	var prefillURLs, decodeURLs []string
	for _, pr := range pairs {
		w := pr.w
		w.SidecarHTTP = httpURL(pr.sidecar.ReadyString("http_addr"))
		w.PeerAddr = pr.sidecar.ReadyString("peer_addr")
		w.ShmPath = pr.sim.ReadyString("shm_path")
		if a := httpURL(pr.sim.ReadyString("http_addr")); a != w.WorkerURL {
			return fmt.Errorf("%s: serving on %q, but its addr file said %q", pr.sim.Name, a, w.WorkerURL)
		}
		c.Workers = append(c.Workers, w)
		if w.Role == "prefill" {
			// URL|PEER_ADDR: fail-open P/D needs the prefill sidecar's peer address too.
			prefillURLs = append(prefillURLs, w.WorkerURL+"|"+w.PeerAddr)
		} else {
			decodeURLs = append(decodeURLs, w.WorkerURL)
		}
	}
	if err := c.waitWorkers(ctx); err != nil {
		return err
	}
	c.logf("workers         %d prefill, %d decode registered", cfg.Prefill, cfg.Decode)

	c.gatewayArgs = []string{
		"--http-addr", "127.0.0.1:0", "--control-plane", cpList, "--insecure",
		"--prefill-urls", strings.Join(prefillURLs, ","), "--decode-urls", strings.Join(decodeURLs, ","),
	}
	if cfg.Gateway {
		url, err := c.StartGateway(ctx, "gateway", cfg.GatewayArgs...)
		if err != nil {
			return err
		}
		c.GatewayURL = url
		c.logf("gateway         %s", c.GatewayURL)
	}
	return nil
}

// StartGateway starts one more kvc-gateway process named name on the cluster (its control
// planes, its workers as the fail-open lists), with extra flags after the cluster's, and returns
// its URL once its route stream is up. Stop stops it with the cluster.
func (c *Cluster) StartGateway(ctx context.Context, name string, extra ...string) (string, error) {
	if c.gatewayArgs == nil {
		return "", errors.New("start gateway: the cluster's workers are not up")
	}
	gw, err := c.spawnProc("kvc-gateway", name, "gateway", append(slices.Clone(c.gatewayArgs), extra...))
	if err != nil {
		return "", err
	}
	if err := c.waitAll(ctx, gw); err != nil {
		return "", err
	}
	url := httpURL(gw.ReadyString("http_addr"))
	return url, c.waitGatewayConnected(ctx, url)
}

func (c *Cluster) addrFile(name string) string {
	return filepath.Join(c.cfg.WorkDir, name+".addr.json")
}

// waitAddrs waits for each process's addr file (written once its HTTP port is bound; a process
// that exits first fails the wait with its log tail) and returns their http_addr, in order.
func (c *Cluster) waitAddrs(ctx context.Context, ps []*Process) ([]string, error) {
	wctx, cancel := context.WithTimeout(ctx, c.cfg.StartTimeout)
	defer cancel()
	out := make([]string, len(ps))
	for i, p := range ps {
		m, err := p.WaitJSON(wctx, c.addrFile(p.Name), "listening")
		if err != nil {
			return nil, err
		}
		if out[i], _ = m["http_addr"].(string); out[i] == "" {
			return nil, fmt.Errorf("%s: addr file %s has no http_addr", p.Name, c.addrFile(p.Name))
		}
	}
	return out, nil
}

func httpURL(addr string) string {
	if addr == "" || strings.HasPrefix(addr, "http://") || strings.HasPrefix(addr, "https://") {
		return addr
	}
	return "http://" + addr
}

// dial opens a client to a control plane.
func dial(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient(addr, append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
}

// Leader asks the live control planes who leads; it returns the leader's node id and address.
func (c *Cluster) Leader(ctx context.Context) (id, addr string, err error) {
	err = errors.New("no control plane")
	for _, p := range c.Processes {
		if p.Role != "controlplane" || !p.Alive() {
			continue
		}
		conn, e := dial(p.ReadyString("grpc_addr"))
		if e != nil {
			err = e
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		resp, e := kvcv1.NewAdminServiceClient(conn).GetLeader(cctx, &kvcv1.GetLeaderRequest{})
		cancel()
		_ = conn.Close()
		if e != nil {
			err = fmt.Errorf("%s: %w", p.Name, e)
			continue
		}
		if resp.GetLeaderId() == "" || resp.GetLeaderAddr() == "" {
			err = fmt.Errorf("%s: no leader elected yet", p.Name)
			continue
		}
		return resp.GetLeaderId(), resp.GetLeaderAddr(), nil
	}
	return "", "", err
}

// retry calls f until it succeeds or the start timeout passes.
func (c *Cluster) retry(ctx context.Context, what string, f func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.StartTimeout)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		err := f(ctx)
		if err == nil {
			return nil
		}
		for _, p := range c.Processes {
			if !p.Alive() && !p.killed.Load() {
				return fmt.Errorf("%s: %s (pid %d) exited (%v); last log lines of %s:\n%s",
					what, p.Name, p.PID, p.ExitErr(), p.LogPath, p.Tail(25))
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: %w (last error: %v)", what, ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// onLeader runs f against the current leader's AdminService.
func (c *Cluster) onLeader(ctx context.Context, f func(ctx context.Context, cl kvcv1.AdminServiceClient) error) error {
	_, addr, err := c.Leader(ctx)
	if err != nil {
		return err
	}
	conn, err := dial(addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return f(cctx, kvcv1.NewAdminServiceClient(conn))
}

// ApplyPolicy merges p into the leader's policy (AdminService/UpdatePolicy).
func (c *Cluster) ApplyPolicy(ctx context.Context, p *kvcv1.Policy) error {
	return c.applyPolicy(ctx, p)
}

func (c *Cluster) applyPolicy(ctx context.Context, p *kvcv1.Policy) error {
	return c.retry(ctx, "apply policy", func(ctx context.Context) error {
		return c.onLeader(ctx, func(ctx context.Context, cl kvcv1.AdminServiceClient) error {
			_, err := cl.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: p})
			return err
		})
	})
}

// waitWorkers waits until the leader lists every worker as READY.
func (c *Cluster) waitWorkers(ctx context.Context) error {
	want := map[string]bool{}
	for _, w := range c.Workers {
		want[w.ID] = true
	}
	return c.retry(ctx, "wait for workers to register", func(ctx context.Context) error {
		return c.onLeader(ctx, func(ctx context.Context, cl kvcv1.AdminServiceClient) error {
			resp, err := cl.ListWorkers(ctx, &kvcv1.ListWorkersRequest{})
			if err != nil {
				return err
			}
			ready := 0
			for _, w := range resp.GetWorkers() {
				if want[w.GetWorkerId()] && w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
					ready++
				}
			}
			if ready < len(want) {
				return fmt.Errorf("%d of %d workers ready", ready, len(want))
			}
			return nil
		})
	})
}

// WaitGatewayConnected waits (up to the start timeout) until the gateway reports its Route
// stream to the control-plane leader up (metric kvc_gateway_control_plane_connected 1); until
// then it serves fail-open.
func (c *Cluster) WaitGatewayConnected(ctx context.Context) error {
	if c.GatewayURL == "" {
		return nil
	}
	return c.waitGatewayConnected(ctx, c.GatewayURL)
}

func (c *Cluster) waitGatewayConnected(ctx context.Context, url string) error {
	cl := &http.Client{Timeout: 2 * time.Second}
	return c.retry(ctx, "wait for the gateway's route stream", func(ctx context.Context) error {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
		resp, err := cl.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "kvc_gateway_control_plane_connected "); ok && strings.TrimSpace(v) == "1" {
				return nil
			}
		}
		return errors.New("route stream not up")
	})
}

// Process returns the process named name (nil when none).
func (c *Cluster) Process(name string) *Process {
	for _, p := range c.Processes {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// KillLeader SIGKILLs the current control-plane leader (for failover demos and tests) and
// returns after it exited.
func (c *Cluster) KillLeader() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id, _, err := c.Leader(ctx)
	if err != nil {
		return fmt.Errorf("kill leader: %w", err)
	}
	p := c.Process(id)
	if p == nil || p.Role != "controlplane" {
		return fmt.Errorf("kill leader: leader %q is not a control plane of this cluster", id)
	}
	c.logf("killing control-plane leader %s (pid %d)", p.Name, p.PID)
	p.kill()
	return nil
}

// Kill SIGKILLs the process named name (e.g. "sim-decode-1", a worker dying mid-run) and
// returns after it exited. It is not restarted.
func (c *Cluster) Kill(name string) error {
	p := c.Process(name)
	if p == nil {
		return fmt.Errorf("kill: no process %q", name)
	}
	c.logf("killing %s (pid %d)", p.Name, p.PID)
	p.kill()
	return nil
}

// Stop stops every process (gateway, workers, decode then prefill sidecars, control planes) with
// SIGTERM, SIGKILL after the grace period, stops etcd and removes sockets and leftover KV pool
// files. It reports processes that did not stop cleanly. Safe to call more than once.
func (c *Cluster) Stop() error {
	c.stopOnce.Do(func() {
		var errs []error
		// Decode sidecars push snapshots to prefill sidecars: stop them first.
		groups := [][]string{{"gateway"}, {"sim-prefill", "sim-decode"}, {"sidecar-decode"}, {"sidecar-prefill"}, {"controlplane"}}
		for _, g := range groups {
			var wg sync.WaitGroup
			var mu sync.Mutex
			for _, p := range c.Processes {
				if !contains(g, p.Role) {
					continue
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					if err := p.stop(c.cfg.StopGrace); err != nil {
						mu.Lock()
						errs = append(errs, err)
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
		}
		if c.etcd != nil {
			c.etcd.Close()
		}
		for _, w := range c.Workers {
			if w.ShmPath != "" && strings.HasPrefix(w.ShmPath, "/dev/shm/") {
				_ = os.Remove(w.ShmPath)
			}
			_ = os.Remove(w.BridgeSocket)
		}
		for _, p := range c.Processes {
			if s, _ := p.Ready()["shm_path"].(string); strings.HasPrefix(s, "/dev/shm/") {
				_ = os.Remove(s)
			}
		}
		if c.ownSock {
			_ = os.RemoveAll(c.sockDir)
		}
		c.stopErr = errors.Join(errs...)
		if c.stopErr == nil {
			c.logf("cluster stopped")
		}
	})
	return c.stopErr
}

func contains(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

// BannerChat is the chat request PrintAddrs shows (an OpenAI chat completion, the API most
// clients speak).
const BannerChat = `{"model": "kvc-sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}`

// PrintAddrs writes where everything listens, with grpcurl and curl examples: a chat request
// first.
func (c *Cluster) PrintAddrs(w io.Writer) {
	fmt.Fprintf(w, "etcd:            %s\n", strings.Join(c.EtcdEndpoints, ","))
	for _, p := range c.Processes {
		if p.Role == "controlplane" {
			fmt.Fprintf(w, "control plane:   %-10s grpc %s  http %s  (pid %d, log %s)\n", p.Name,
				p.ReadyString("grpc_addr"), httpURL(p.ReadyString("http_addr")), p.PID, p.LogPath)
		}
	}
	for _, wk := range c.Workers {
		fmt.Fprintf(w, "%-7s worker:  %-10s %s  sidecar %s  peer %s  bridge %s\n", wk.Role, wk.ID,
			wk.WorkerURL, wk.SidecarHTTP, wk.PeerAddr, wk.BridgeSocket)
	}
	if c.GatewayURL != "" {
		fmt.Fprintf(w, "gateway:         %s\n", c.GatewayURL)
	}
	fmt.Fprintf(w, "logs:            %s\n\n", c.cfg.WorkDir)
	if len(c.ControlPlaneAddrs) > 0 {
		fmt.Fprintf(w, "try:\n  grpcurl -plaintext %s kvc.v1.AdminService/GetLeader\n", c.ControlPlaneAddrs[0])
		fmt.Fprintf(w, "  grpcurl -plaintext %s kvc.v1.AdminService/ListWorkers\n", c.ControlPlaneAddrs[0])
	}
	if c.GatewayURL != "" {
		fmt.Fprintf(w, "  curl -s %s/v1/chat/completions -H 'X-Session-ID: demo-1' -d '%s'\n", c.GatewayURL, BannerChat)
		fmt.Fprintf(w, "  curl -s %s/generate -H 'X-Session-ID: demo-2' -d '{\"text\": \"hello\", \"sampling_params\": {\"max_new_tokens\": 8}}'\n", c.GatewayURL)
	}
	for _, wk := range c.Workers {
		if wk.Role == "decode" {
			fmt.Fprintf(w, "  curl -s %s/kvc/sessions\n", wk.WorkerURL)
			break
		}
	}
}
