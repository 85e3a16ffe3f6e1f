package app

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kvcentric/kvcentric/controlplane/internal/embedetcd"
	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/controlplane/internal/router"
	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// EtcdTLSNames are the flags of the etcd client certificate (etcdctl's names).
var EtcdTLSNames = tlsx.Names{Cert: "etcd-cert", Key: "etcd-key", CA: "etcd-cacert"}

// Options are kvc-controlplane's settings.
type Options struct {
	NodeID                 string
	GRPCAddr               string
	HTTPAddr               string
	AdvertiseAddr          string
	EtcdEndpoints          string
	EtcdPrefix             string
	DataDir                string
	EmbeddedEtcdClientAddr string
	EmbeddedEtcdPeerAddr   string
	// EmbeddedEtcdQuota and EmbeddedEtcdCompaction bound the embedded etcd's size.
	EmbeddedEtcdQuota      int64
	EmbeddedEtcdCompaction time.Duration
	// EtcdCallTimeout bounds every single etcd call on a request path.
	EtcdCallTimeout       time.Duration
	ElectionTTL           time.Duration
	ElectionRenewDeadline time.Duration
	UnreachableGrace      time.Duration
	// DrainSnapshotWait bounds a drain's wait for a session's snapshot before its release.
	DrainSnapshotWait time.Duration
	// NewSessionShare bounds new sessions' reservations per decode worker (router, policy
	// newsession.go).
	NewSessionShare float64
	// RehomeFill: the share of a decode worker's capacity a re-home may fill it to (router
	// rehome.go).
	RehomeFill           float64
	SessionTTL           time.Duration
	FlushDelay           time.Duration
	VolatileFlush        time.Duration
	ShutdownGrace        time.Duration
	EtcdDialTimeout      time.Duration
	GRPCKeepaliveTime    time.Duration
	GRPCKeepaliveTimeout time.Duration
	ReadyFile            string
	// Tracing: OTLP/gRPC collector (empty: none), plaintext to it, sample ratio of new traces.
	OTLPEndpoint     string
	OTLPInsecure     bool
	TraceSampleRatio float64
	LogLevel         string
	LogFormat        string
	// TLS is the gRPC server's mTLS identity (role controlplane); none: plaintext.
	TLS tlsx.Files
	// EtcdTLS is the client certificate for an external etcd with client-cert auth.
	EtcdTLS tlsx.Files

	// traceExporter replaces the OTLP exporter (tests: in memory).
	traceExporter sdktrace.SpanExporter
}

// NewOptions returns the defaults.
func NewOptions() *Options {
	host, _ := os.Hostname()
	if kvcv1.ValidateID("node_id", host) != nil {
		host = "kvc-controlplane"
	}
	return &Options{
		NodeID:                 host,
		GRPCAddr:               "127.0.0.1:7400",
		HTTPAddr:               "127.0.0.1:7401",
		EtcdPrefix:             "/kvc/v1/",
		DataDir:                "kvc-controlplane-data",
		EmbeddedEtcdClientAddr: "127.0.0.1:2379",
		EmbeddedEtcdPeerAddr:   "127.0.0.1:2380",
		EmbeddedEtcdQuota:      embedetcd.DefaultQuotaBytes,
		EmbeddedEtcdCompaction: embedetcd.DefaultCompactionRetention,
		EtcdCallTimeout:        kvstore.DefaultCallTimeout,
		ElectionTTL:            5 * time.Second,
		UnreachableGrace:       30 * time.Second,
		DrainSnapshotWait:      state.DefaultDrainSnapshotWait,
		NewSessionShare:        policy.DefaultNewSessionShare,
		RehomeFill:             router.DefaultRehomeFill,
		SessionTTL:             24 * time.Hour,
		FlushDelay:             50 * time.Millisecond,
		VolatileFlush:          2 * time.Second,
		ShutdownGrace:          5 * time.Second,
		EtcdDialTimeout:        5 * time.Second,
		GRPCKeepaliveTime:      grpcx.ServerKeepaliveTime,
		GRPCKeepaliveTimeout:   grpcx.ServerKeepaliveTimeout,
		TraceSampleRatio:       1,
		LogLevel:               "info",
		LogFormat:              "json",
	}
}

// AddFlags registers every option on fs.
func (o *Options) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.NodeID, "node-id", o.NodeID, "this replica's id (unique among replicas)")
	fs.StringVar(&o.GRPCAddr, "grpc-addr", o.GRPCAddr, "gRPC listen address (port 0 picks one)")
	fs.StringVar(&o.HTTPAddr, "http-addr", o.HTTPAddr, "HTTP listen address for /metrics, /healthz, /readyz")
	fs.StringVar(&o.AdvertiseAddr, "advertise-addr", o.AdvertiseAddr, "gRPC address other parts dial to reach this replica (default: the bound --grpc-addr)")
	fs.StringVar(&o.EtcdEndpoints, "etcd-endpoints", o.EtcdEndpoints, "comma-separated etcd client URLs; empty starts an embedded single-member etcd in --data-dir")
	fs.StringVar(&o.EtcdPrefix, "etcd-prefix", o.EtcdPrefix, "etcd key prefix (must start and end with '/')")
	fs.StringVar(&o.DataDir, "data-dir", o.DataDir, "embedded etcd data directory")
	fs.StringVar(&o.EmbeddedEtcdClientAddr, "embedded-etcd-client-addr", o.EmbeddedEtcdClientAddr, "embedded etcd client listen address (port 0 picks one)")
	fs.StringVar(&o.EmbeddedEtcdPeerAddr, "embedded-etcd-peer-addr", o.EmbeddedEtcdPeerAddr, "embedded etcd peer listen address (port 0 picks one)")
	fs.Int64Var(&o.EmbeddedEtcdQuota, "embedded-etcd-quota-bytes", o.EmbeddedEtcdQuota, "embedded etcd backend quota: past it etcd refuses writes (RESOURCE_EXHAUSTED) instead of filling the disk")
	fs.DurationVar(&o.EmbeddedEtcdCompaction, "embedded-etcd-compaction-retention", o.EmbeddedEtcdCompaction, "embedded etcd periodic auto-compaction: history older than this is compacted (0: off)")
	fs.DurationVar(&o.EtcdCallTimeout, "etcd-call-timeout", o.EtcdCallTimeout, "bound on every single etcd call made for a request (admin reads, UpdatePolicy): past it the call fails UNAVAILABLE, with or without a client deadline")
	fs.DurationVar(&o.ElectionTTL, "election-ttl", o.ElectionTTL, "leader lease TTL (whole seconds, >= 2s): a dead leader is replaced after about this long")
	fs.DurationVar(&o.ElectionRenewDeadline, "election-renew-deadline", o.ElectionRenewDeadline, "the leader stops acting this long after the last lease renewal etcd answered; below --election-ttl (0: two thirds of it)")
	fs.DurationVar(&o.UnreachableGrace, "unreachable-grace", o.UnreachableGrace, "default unreachable_grace_ms: an unreachable worker's residency is dropped after this")
	fs.DurationVar(&o.DrainSnapshotWait, "drain-snapshot-wait", o.DrainSnapshotWait, "a drain releases each resident session once its snapshot can reseed it, or after this long without one (its next turn then re-prefills)")
	fs.Float64Var(&o.NewSessionShare, "new-session-share", o.NewSessionShare, "share of a decode worker's KV capacity that reservations of new sessions awaiting their outcome may take beyond its free room, in [0, 1] (0: no bound; 0.5 for clusters shared by tenants); past it on every decode worker a new session is refused (RESOURCE_EXHAUSTED NO_D_CAPACITY, the gateway's 503 no_d_capacity) instead of evicting the worker's resident sessions")
	fs.Float64Var(&o.RehomeFill, "rehome-fill", o.RehomeFill, "share of a decode worker's KV capacity a re-home of a lost decode worker's sessions may fill it to, its idle sessions counted as used, in [0, 1] (0: no re-homes): keep it at or below the decode sidecars' --release-low-watermark so that a re-home never makes a worker release idle sessions (a session with no room stays lost: its next turn reseeds)")
	fs.StringVar(&o.OTLPEndpoint, "otlp-endpoint", o.OTLPEndpoint, "OpenTelemetry traces: OTLP/gRPC collector host:port (empty: the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _PROTOCOL ... variables, and without them no export; W3C trace context is still propagated)")
	fs.BoolVar(&o.OTLPInsecure, "otlp-insecure", o.OTLPInsecure, "send traces to --otlp-endpoint without TLS")
	fs.Float64Var(&o.TraceSampleRatio, "trace-sample-ratio", o.TraceSampleRatio, "fraction of new traces sampled, in (0, 1]; OTEL_TRACES_SAMPLER, when set, decides instead (a caller's sampled flag is followed)")
	fs.DurationVar(&o.SessionTTL, "session-ttl", o.SessionTTL, "default session_ttl_ms: idle sessions expire after this")
	fs.DurationVar(&o.FlushDelay, "flush-delay", o.FlushDelay, "write-behind delay: every change reaches etcd within about this long")
	fs.DurationVar(&o.VolatileFlush, "volatile-flush", o.VolatileFlush, "how often changes to a session's volatile fields only (turn, last_seen, kv_committed_len, d_rejects) are persisted; residency changes are written at once (0: write every change at once)")
	fs.DurationVar(&o.ShutdownGrace, "shutdown-grace", o.ShutdownGrace, "how long a stop waits for calls to finish")
	fs.DurationVar(&o.EtcdDialTimeout, "etcd-dial-timeout", o.EtcdDialTimeout, "etcd dial timeout")
	fs.DurationVar(&o.GRPCKeepaliveTime, "grpc-keepalive-time", o.GRPCKeepaliveTime, "the gRPC server pings a client it has read nothing from for this long (>= 1s); a sidecar behind a dead link is marked unreachable within this plus --grpc-keepalive-timeout")
	fs.DurationVar(&o.GRPCKeepaliveTimeout, "grpc-keepalive-timeout", o.GRPCKeepaliveTimeout, "how long the gRPC server waits for a ping ack before it closes the connection")
	fs.StringVar(&o.ReadyFile, "ready-file", o.ReadyFile, "write a JSON ready file here once serving")
	fs.StringVar(&o.LogLevel, "log-level", o.LogLevel, "debug, info, warn or error")
	fs.StringVar(&o.LogFormat, "log-format", o.LogFormat, "json or console")
	o.TLS.Register(fs, tlsx.GRPCNames, "of this replica (role controlplane): mutual TLS on the gRPC port, per-method authorization by the caller's role")
	o.EtcdTLS.Register(fs, EtcdTLSNames, "for an external etcd with client-certificate auth (https:// endpoints)")
}

// Endpoints returns the etcd endpoints (nil: embedded).
func (o *Options) Endpoints() []string {
	var out []string
	for _, e := range strings.Split(o.EtcdEndpoints, ",") {
		if e = strings.TrimSpace(e); e != "" {
			out = append(out, e)
		}
	}
	return out
}

// Validate checks the options; every problem is reported.
func (o *Options) Validate() error {
	var errs []error
	if err := kvcv1.ValidateID("--node-id", o.NodeID); err != nil {
		errs = append(errs, err)
	}
	addr := func(name, v string, optional bool) {
		if v == "" && optional {
			return
		}
		if _, _, err := net.SplitHostPort(v); err != nil {
			errs = append(errs, fmt.Errorf("%s %q: want host:port", name, v))
		}
	}
	addr("--grpc-addr", o.GRPCAddr, false)
	addr("--http-addr", o.HTTPAddr, false)
	addr("--advertise-addr", o.AdvertiseAddr, true)
	if len(o.Endpoints()) == 0 {
		if o.DataDir == "" {
			errs = append(errs, errors.New("--data-dir is required for the embedded etcd (no --etcd-endpoints)"))
		}
		addr("--embedded-etcd-client-addr", o.EmbeddedEtcdClientAddr, false)
		addr("--embedded-etcd-peer-addr", o.EmbeddedEtcdPeerAddr, false)
		if o.EmbeddedEtcdQuota < 16<<20 || o.EmbeddedEtcdQuota > 8<<30 {
			errs = append(errs, fmt.Errorf("--embedded-etcd-quota-bytes %d must be within [16 MiB, 8 GiB]", o.EmbeddedEtcdQuota))
		}
		if o.EmbeddedEtcdCompaction < 0 || (o.EmbeddedEtcdCompaction > 0 && o.EmbeddedEtcdCompaction < time.Second) {
			errs = append(errs, fmt.Errorf("--embedded-etcd-compaction-retention %s must be 0 (off) or at least 1s", o.EmbeddedEtcdCompaction))
		}
	}
	for _, e := range o.Endpoints() {
		if !strings.Contains(e, "://") {
			if _, _, err := net.SplitHostPort(e); err != nil {
				errs = append(errs, fmt.Errorf("--etcd-endpoints entry %q: want a URL or host:port", e))
			}
		}
	}
	if !strings.HasPrefix(o.EtcdPrefix, "/") || !strings.HasSuffix(o.EtcdPrefix, "/") || len(o.EtcdPrefix) < 2 {
		errs = append(errs, fmt.Errorf("--etcd-prefix %q must start and end with '/'", o.EtcdPrefix))
	}
	if o.ElectionTTL < 2*time.Second || o.ElectionTTL%time.Second != 0 {
		errs = append(errs, fmt.Errorf("--election-ttl %s must be whole seconds and at least 2s", o.ElectionTTL))
	}
	if o.ElectionRenewDeadline < 0 || (o.ElectionRenewDeadline > 0 && o.ElectionRenewDeadline >= o.ElectionTTL) {
		errs = append(errs, fmt.Errorf("--election-renew-deadline %s must be below --election-ttl %s (0: two thirds of it)", o.ElectionRenewDeadline, o.ElectionTTL))
	}
	pos := func(name string, d time.Duration, allowZero bool) {
		if d < 0 || (d == 0 && !allowZero) {
			errs = append(errs, fmt.Errorf("%s %s must be positive", name, d))
		}
	}
	pos("--unreachable-grace", o.UnreachableGrace, true)
	pos("--drain-snapshot-wait", o.DrainSnapshotWait, false)
	if !(o.NewSessionShare >= 0 && o.NewSessionShare <= 1) {
		errs = append(errs, fmt.Errorf("--new-session-share %v must be in [0, 1] (0: no bound)", o.NewSessionShare))
	}
	if !(o.RehomeFill >= 0 && o.RehomeFill <= 1) {
		errs = append(errs, fmt.Errorf("--rehome-fill %v must be in [0, 1] (0: no re-homes)", o.RehomeFill))
	}
	if o.TraceSampleRatio <= 0 || o.TraceSampleRatio > 1 {
		errs = append(errs, fmt.Errorf("--trace-sample-ratio %v must be in (0, 1]", o.TraceSampleRatio))
	}
	if o.SessionTTL < time.Second {
		errs = append(errs, fmt.Errorf("--session-ttl %s must be at least 1s", o.SessionTTL))
	}
	pos("--flush-delay", o.FlushDelay, false)
	pos("--volatile-flush", o.VolatileFlush, true)
	pos("--shutdown-grace", o.ShutdownGrace, false)
	pos("--etcd-dial-timeout", o.EtcdDialTimeout, false)
	if o.EtcdCallTimeout < 100*time.Millisecond || o.EtcdCallTimeout > time.Minute {
		errs = append(errs, fmt.Errorf("--etcd-call-timeout %s must be within [100ms, 1m]", o.EtcdCallTimeout))
	}
	if o.GRPCKeepaliveTime < time.Second {
		errs = append(errs, fmt.Errorf("--grpc-keepalive-time %s must be at least 1s", o.GRPCKeepaliveTime))
	}
	pos("--grpc-keepalive-timeout", o.GRPCKeepaliveTimeout, false)
	if err := o.TLS.Check(tlsx.GRPCNames); err != nil {
		errs = append(errs, err)
	}
	if err := o.EtcdTLS.Check(EtcdTLSNames); err != nil {
		errs = append(errs, err)
	}
	if o.EtcdTLS.Enabled() && len(o.Endpoints()) == 0 {
		errs = append(errs, errors.New("--etcd-cert/--etcd-key/--etcd-cacert need --etcd-endpoints (the embedded etcd is plaintext on loopback)"))
	}
	switch o.LogFormat {
	case "json", "console":
	default:
		errs = append(errs, fmt.Errorf("--log-format %q: want json or console", o.LogFormat))
	}
	switch strings.ToLower(o.LogLevel) {
	case "debug", "info", "warn", "error":
	default:
		errs = append(errs, fmt.Errorf("--log-level %q: want debug, info, warn or error", o.LogLevel))
	}
	return errors.Join(errs...)
}
