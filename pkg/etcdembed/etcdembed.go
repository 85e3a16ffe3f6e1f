package etcdembed

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/storage/wal"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// Cluster states for MemberConfig.State (etcd's --initial-cluster-state).
const (
	StateNew      = embed.ClusterStateFlagNew
	StateExisting = embed.ClusterStateFlagExisting
)

// MemberConfig describes one member. ClientURL and PeerURL are http://host:port with real ports.
type MemberConfig struct {
	Name      string
	Dir       string
	ClientURL string
	PeerURL   string
	// InitialCluster is name=peerURL,...; "" means this member alone (Name=PeerURL).
	InitialCluster string
	// Token is the initial cluster token; "" keeps etcd's default.
	Token string
	// State is StateNew (default when "") or StateExisting (a member restarting into its cluster).
	State string
	// LogPath receives etcd's own log at level error; "" discards it.
	LogPath string
	// QuotaBytes is the backend quota (0: etcd's default of 2 GiB).
	QuotaBytes int64
	// CompactionRetention turns on periodic auto-compaction keeping this much history (0: off).
	CompactionRetention time.Duration
	// NoFsync skips fsync (tests only: a crash may lose acknowledged writes).
	NoFsync bool
}

// Config turns c into etcd's embed.Config.
func (c MemberConfig) Config() (*embed.Config, error) {
	cu, err := url.Parse(c.ClientURL)
	if err != nil {
		return nil, fmt.Errorf("client url %q: %w", c.ClientURL, err)
	}
	pu, err := url.Parse(c.PeerURL)
	if err != nil {
		return nil, fmt.Errorf("peer url %q: %w", c.PeerURL, err)
	}
	if cu.Host == "" || pu.Host == "" {
		return nil, fmt.Errorf("client url %q and peer url %q must be scheme://host:port", c.ClientURL, c.PeerURL)
	}
	cfg := embed.NewConfig()
	cfg.Name = c.Name
	cfg.Dir = c.Dir
	cfg.ListenClientUrls = []url.URL{*cu}
	cfg.AdvertiseClientUrls = []url.URL{*cu}
	cfg.ListenPeerUrls = []url.URL{*pu}
	cfg.AdvertisePeerUrls = []url.URL{*pu}
	cfg.InitialCluster = c.InitialCluster
	if cfg.InitialCluster == "" {
		cfg.InitialCluster = c.Name + "=" + pu.String()
	}
	if c.Token != "" {
		cfg.InitialClusterToken = c.Token
	}
	cfg.ClusterState = c.State
	if cfg.ClusterState == "" {
		cfg.ClusterState = StateNew
	}
	cfg.UnsafeNoFsync = c.NoFsync
	if c.LogPath != "" {
		cfg.LogLevel = "error"
		cfg.LogOutputs = []string{c.LogPath}
	} else {
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	}
	if c.QuotaBytes > 0 {
		cfg.QuotaBackendBytes = c.QuotaBytes
	}
	if c.CompactionRetention > 0 {
		cfg.AutoCompactionMode = embed.CompactorModePeriodic
		cfg.AutoCompactionRetention = c.CompactionRetention.String()
	}
	return cfg, nil
}

// StartMember starts the member and returns once it serves. When ctx ends first, or etcd reports
// an error, the member is stopped and the error returned. The caller closes the *embed.Etcd.
func StartMember(ctx context.Context, c MemberConfig) (*embed.Etcd, error) {
	cfg, err := c.Config()
	if err != nil {
		return nil, fmt.Errorf("member %s: %w", c.Name, err)
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("member %s: %w", c.Name, err)
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("member %s: %w", c.Name, err)
	case <-ctx.Done():
		e.Server.Stop()
		e.Close()
		return nil, fmt.Errorf("member %s: not ready: %w", c.Name, context.Cause(ctx))
	}
}

// ThrowawayWALSegmentBytes is the WAL segment size for an etcd whose data is thrown away with
// its process (tests, kvc-local's cluster): 4 MiB instead of etcd's 64 MB, so that a test run of
// many members (each preallocates its segment and the next) needs tens of MiB of disk, not GiBs.
const ThrowawayWALSegmentBytes = 4 << 20

var throwawayOnce sync.Once

// ThrowawayWAL makes every member this process starts afterwards preallocate WAL segments of
// ThrowawayWALSegmentBytes. etcd keeps the size in a package variable (wal.SegmentSizeBytes), so
// this is process-wide: call it before the first member starts, from every path that starts one
// (it is idempotent and safe for concurrent use). A production member (kvc-controlplane's
// embedded etcd) never calls it.
func ThrowawayWAL() {
	throwawayOnce.Do(func() { wal.SegmentSizeBytes = ThrowawayWALSegmentBytes })
}

// MinFreeBytes is the room CheckDir asks of a data dir: etcd preallocates a 64 MiB WAL segment
// and grows its database file, and on a full disk it panics inside its own goroutines (a stack
// trace, "failed to open database") instead of returning an error.
const MinFreeBytes = 80 << 20

// CheckDir makes dir (and its parents) and checks it can hold an etcd member: writable, at
// least need bytes free. Its error is one line naming the path. Call it before StartMember on
// a data dir that may be full.
func CheckDir(dir string, need uint64) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("etcd data dir %s: %w", dir, err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Errorf("etcd data dir %s: %w", dir, err)
	}
	if free := st.Bavail * uint64(st.Bsize); free < need {
		return fmt.Errorf("etcd data dir %s: %.1f MiB free on its filesystem, etcd needs at least %d MiB (free some space or choose another --data-dir)",
			dir, float64(free)/(1<<20), need>>20)
	}
	f, err := os.CreateTemp(dir, ".write-check-*")
	if err != nil {
		return fmt.Errorf("etcd data dir %s: not writable: %w", dir, err)
	}
	name := f.Name()
	_, werr := f.Write([]byte("kvc"))
	cerr := f.Close()
	_ = os.Remove(name)
	if err := errors.Join(werr, cerr); err != nil {
		return fmt.Errorf("etcd data dir %s: not writable: %w", dir, err)
	}
	return nil
}

// SingleTimeout bounds StartSingle's wait for the member to serve.
const SingleTimeout = 30 * time.Second

// StartSingle starts a one-member etcd on free loopback ports with data under dir (one
// subdirectory per attempt: a start that loses a port to another process between the pick and
// the bind is retried) and etcd's own log at level error appended to logPath ("" discards it).
// It returns once the member serves, with its client URL; the caller closes the *embed.Etcd.
func StartSingle(ctx context.Context, dir, logPath string) (*embed.Etcd, string, error) {
	if err := CheckDir(dir, MinFreeBytes); err != nil {
		return nil, "", fmt.Errorf("embedded etcd: %w", err)
	}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		ports, err := FreePorts(2)
		if err != nil {
			return nil, "", err
		}
		c := MemberConfig{
			Name:      "m0",
			Dir:       filepath.Join(dir, fmt.Sprintf("etcd-%d", attempt)),
			ClientURL: fmt.Sprintf("http://127.0.0.1:%d", ports[0]),
			PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
			Token:     fmt.Sprintf("etcd-single-%d", attempt),
			LogPath:   logPath,
		}
		sctx, cancel := context.WithTimeout(ctx, SingleTimeout)
		e, err := StartMember(sctx, c)
		cancel()
		if err == nil {
			return e, c.ClientURL, nil
		}
		lastErr = err
		if !IsAddrInUse(err) {
			break
		}
	}
	return nil, "", fmt.Errorf("embedded etcd: %w", lastErr)
}

// FreePorts returns n distinct free TCP ports on 127.0.0.1 (held open together while picked, so
// they differ; another process may still take one before etcd binds it: see IsAddrInUse).
func FreePorts(n int) ([]int, error) {
	var lis []net.Listener
	defer func() {
		for _, l := range lis {
			_ = l.Close()
		}
	}()
	ports := make([]int, 0, n)
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lis = append(lis, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// IsAddrInUse reports whether err is a bind failure on a port another process holds: a start
// on picked ports may then be retried on new ones.
func IsAddrInUse(err error) bool {
	if err == nil {
		return false
	}
	// etcd wraps the bind error with %v in places, so the text is the fallback.
	return errors.Is(err, syscall.EADDRINUSE) || strings.Contains(err.Error(), "address already in use")
}
