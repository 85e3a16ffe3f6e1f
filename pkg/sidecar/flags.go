package sidecar

import (
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

// Common holds the flags both sidecars take.
type Common struct {
	WorkerID          string
	Node              string
	GPUIndex          int
	WorkerURL         string
	TPGroup           string // --tp-group (default: --worker-url); HelloTP sends it
	ControlPlane      string
	BridgeSocket      string
	PeerAddr          string
	AdvertisePeerAddr string
	HTTPAddr          string
	Transport         string
	TransferAddr      string
	TransferAdvertise string
	TransferConns     int
	TransferSlice     uint64
	MooncakeLib       string
	MooncakeMetadata  string
	MooncakeProtocol  string
	MooncakeDevices   string
	EventLog          string
	EventLogRotation  Rotation
	KVCapacityTokens  int64
	ReadyFile         string
	LogLevel          string
	LogFormat         string
	Heartbeat         time.Duration
	CPLease           time.Duration
	FaultDelay        time.Duration
	// TimeScale multiplies every decision-shaping timer of the sidecar (Scaled): 1 at real
	// speed; a simulation run at --time-scale X (kvc-bench) passes the same X, so the control
	// plane sees load reports, idle flushes and releases as stale in model seconds as at real
	// speed.
	TimeScale float64
	// Worker process health (WorkerHealth): probe interval (0: no periodic probe), failures in
	// a row that mark the worker down, and the timeout of one probe.
	WorkerHealthInterval  time.Duration
	WorkerHealthThreshold int
	WorkerHealthTimeout   time.Duration
	// TLS is the mTLS identity (--tls-cert/--tls-key/--tls-ca): control-plane stream, peer
	// server and peer clients. None: plaintext.
	TLS tlsx.Files
	// OpenTelemetry traces (obs.SetupTracing), as on the control plane and the gateway:
	// --otlp-endpoint (empty: no export; W3C trace context is still propagated),
	// --otlp-insecure, --trace-sample-ratio.
	OTLPEndpoint     string
	OTLPInsecure     bool
	TraceSampleRatio float64
}

// Register defines the common flags on fs.
func (c *Common) Register(fs *flag.FlagSet) {
	fs.StringVar(&c.WorkerID, "worker-id", "", "worker id reported to the control plane (required)")
	fs.StringVar(&c.Node, "node", "", "node name (default: hostname)")
	fs.IntVar(&c.GPUIndex, "gpu-index", 0, "GPU index of the worker")
	fs.StringVar(&c.WorkerURL, "worker-url", "", "HTTP URL of the SGLang worker (reported in hello)")
	fs.StringVar(&c.TPGroup, "tp-group", "", "tensor parallelism: the worker group this rank belongs to, the same on every rank of one SGLang server (its --tp-size ranks, one sidecar each); the control plane routes the group as one worker (default: --worker-url)")
	fs.StringVar(&c.ControlPlane, "control-plane", "", "comma list of control plane gRPC addresses (empty: run without a control plane)")
	fs.StringVar(&c.BridgeSocket, "bridge-socket", "", "Unix socket path of the WorkerBridge service (mode 0600; required)")
	fs.StringVar(&c.PeerAddr, "peer-addr", "127.0.0.1:0", "listen address of the TransferPeerService")
	fs.StringVar(&c.AdvertisePeerAddr, "advertise-peer-addr", "", "peer address other sidecars use (default: the bound address)")
	fs.StringVar(&c.HTTPAddr, "http-addr", "127.0.0.1:0", "listen address of /metrics, /healthz, /readyz and the sidecar HTTP API")
	fs.StringVar(&c.Transport, "transport", "tcp", "transfer backend: tcp, cuda or mooncake")
	fs.StringVar(&c.TransferAddr, "transfer-addr", "127.0.0.1:0", "transfer engine listen address (tcp)")
	fs.StringVar(&c.TransferAdvertise, "transfer-advertise-addr", "", "transfer segment name peers use (default: the bound address)")
	fs.IntVar(&c.TransferConns, "transfer-conns", 4, "parallel connections per peer (tcp)")
	fs.Uint64Var(&c.TransferSlice, "transfer-slice-bytes", 0, "split large requests into slices of this size over the connections (tcp; 0: backend default)")
	fs.StringVar(&c.MooncakeLib, "mooncake-lib", "", "path of libtransfer_engine.so (mooncake)")
	fs.StringVar(&c.MooncakeMetadata, "mooncake-metadata", "P2PHANDSHAKE", "Mooncake metadata connection string (mooncake)")
	fs.StringVar(&c.MooncakeProtocol, "mooncake-protocol", "rdma", "Mooncake transport protocol: rdma or tcp (mooncake)")
	fs.StringVar(&c.MooncakeDevices, "mooncake-devices", "", "RDMA devices, comma list (mooncake, rdma protocol)")
	fs.StringVar(&c.EventLog, "event-log", "", "JSON-lines event log path (empty: none)")
	fs.IntVar(&c.EventLogRotation.MaxMB, "event-log-max-mb", 100, "rotate the event log once it would pass this many megabytes (the old file is kept as a backup with the time in its name)")
	fs.IntVar(&c.EventLogRotation.MaxBackups, "event-log-max-backups", 5, "rotated event log files kept; the oldest past this are removed")
	fs.Int64Var(&c.KVCapacityTokens, "kv-capacity-tokens", 0, "KV capacity reported to the control plane (0: what the pool implies)")
	fs.StringVar(&c.ReadyFile, "ready-file", "", "write a JSON ready file with the bound addresses here")
	fs.StringVar(&c.LogLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&c.LogFormat, "log-format", "json", "json or console")
	fs.DurationVar(&c.Heartbeat, "heartbeat", time.Second, "load report interval")
	fs.Float64Var(&c.TimeScale, "time-scale", 1, "multiplies every decision-shaping timer (--heartbeat, --worker-health-interval and, on a decode sidecar, --snapshot-idle-flush, --release-min-idle and the 1s release tick), in (0, 100]: a simulation run at time scale X (kvc-bench --time-scale X) passes the same X so the timers keep their model-time length; 1 at real speed")
	fs.DurationVar(&c.CPLease, "cp-lease", cpclient.DefaultLease, "the control planes' --election-ttl: a control plane that answers nothing for half of it (paused, its link frozen) is left for the next")
	fs.DurationVar(&c.FaultDelay, "fault-transfer-delay", 0, "fault injection: delay before each transfer request (tests only)")
	fs.DurationVar(&c.WorkerHealthInterval, "worker-health-interval", DefaultHealthInterval, "probe GET <worker-url>/health this often (0: only when the worker's bridge connection closes)")
	fs.IntVar(&c.WorkerHealthThreshold, "worker-health-threshold", DefaultHealthThreshold, "failed /health probes in a row that mark the worker down (out of routing)")
	fs.DurationVar(&c.WorkerHealthTimeout, "worker-health-timeout", DefaultHealthTimeout, "timeout of one /health probe")
	c.TLS.Register(fs, tlsx.GRPCNames, "of this sidecar (role sidecar) for mutual TLS to the control plane and peer sidecars")
	fs.StringVar(&c.OTLPEndpoint, "otlp-endpoint", "", "OpenTelemetry traces: OTLP/gRPC collector host:port (empty: the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _PROTOCOL ... variables, and without them no export; W3C trace context is still propagated)")
	fs.BoolVar(&c.OTLPInsecure, "otlp-insecure", false, "send traces to --otlp-endpoint without TLS")
	fs.Float64Var(&c.TraceSampleRatio, "trace-sample-ratio", 1, "fraction of new traces sampled, in (0, 1]; OTEL_TRACES_SAMPLER, when set, decides instead (a caller's sampled flag is followed)")
}

// Scaled is d at the sidecar's time scale (d itself when TimeScale is 0 or 1).
func (c *Common) Scaled(d time.Duration) time.Duration {
	if !(c.TimeScale > 0) || c.TimeScale == 1 {
		return d
	}
	return time.Duration(float64(d) * c.TimeScale)
}

// Check validates the common flags.
func (c *Common) Check() error {
	switch {
	case c.WorkerID == "":
		return fmt.Errorf("--worker-id is required")
	case c.BridgeSocket == "":
		return fmt.Errorf("--bridge-socket is required")
	case c.TransferConns < 1 || c.TransferConns > 64:
		return fmt.Errorf("--transfer-conns %d out of range [1, 64]", c.TransferConns)
	case c.GPUIndex < 0:
		return fmt.Errorf("--gpu-index must be >= 0")
	case c.KVCapacityTokens < 0:
		return fmt.Errorf("--kv-capacity-tokens must be >= 0")
	case !(c.TimeScale > 0) || c.TimeScale > 100:
		return fmt.Errorf("--time-scale %v out of range (0, 100]", c.TimeScale)
	case c.Scaled(c.Heartbeat) < 10*time.Millisecond:
		return fmt.Errorf("--heartbeat %v too short (at --time-scale %v: %v; at least 10ms)", c.Heartbeat, c.TimeScale, c.Scaled(c.Heartbeat))
	case c.CPLease < 100*time.Millisecond:
		return fmt.Errorf("--cp-lease %v too short (the control planes' --election-ttl, at least 2s there)", c.CPLease)
	case c.FaultDelay < 0:
		return fmt.Errorf("--fault-transfer-delay must be >= 0")
	case c.WorkerHealthInterval != 0 && c.Scaled(c.WorkerHealthInterval) < 10*time.Millisecond:
		return fmt.Errorf("--worker-health-interval %v: want 0 (off) or at least 10ms (after --time-scale %v)", c.WorkerHealthInterval, c.TimeScale)
	case c.WorkerHealthThreshold < 1 || c.WorkerHealthThreshold > 1000:
		return fmt.Errorf("--worker-health-threshold %d out of range [1, 1000]", c.WorkerHealthThreshold)
	case c.WorkerHealthTimeout < time.Millisecond:
		return fmt.Errorf("--worker-health-timeout %v too short", c.WorkerHealthTimeout)
	case len(c.TPGroup) > kvxfer.MaxTPGroupLen:
		return fmt.Errorf("--tp-group is %d bytes (at most %d)", len(c.TPGroup), kvxfer.MaxTPGroupLen)
	case c.TraceSampleRatio < 0 || c.TraceSampleRatio > 1:
		return fmt.Errorf("--trace-sample-ratio %v must be in (0, 1]", c.TraceSampleRatio)
	}
	if err := c.EventLogRotation.Check(); err != nil {
		return err
	}
	if err := c.TLS.Check(tlsx.GRPCNames); err != nil {
		return err
	}
	switch c.Transport {
	case "tcp", "cuda", "mooncake":
	default:
		return fmt.Errorf("--transport %q: want tcp, cuda or mooncake", c.Transport)
	}
	return nil
}

// Endpoints splits --control-plane.
func (c *Common) Endpoints() []string {
	var out []string
	for _, s := range strings.Split(c.ControlPlane, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}
