package embedetcd

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"go.etcd.io/etcd/server/v3/embed"

	"github.com/kvcentric/kvcentric/pkg/etcdembed"
)

// Server is a running embedded etcd.
type Server struct {
	e         *embed.Etcd
	clientURL string
}

// Config for Start.
type Config struct {
	Name       string
	Dir        string
	ClientAddr string // host:port
	PeerAddr   string // host:port
	// QuotaBytes is the backend quota: past it etcd refuses writes (NOSPACE alarm) instead of
	// filling the disk. 0 means DefaultQuotaBytes.
	QuotaBytes int64
	// CompactionRetention keeps this much history: older revisions are compacted every
	// retention (etcd's periodic auto-compaction). 0 means DefaultCompactionRetention; a
	// negative value turns auto-compaction off.
	CompactionRetention time.Duration
}

// Defaults of the embedded etcd's limits (etcd itself defaults to a 2 GiB quota and no
// compaction at all: every overwritten value is kept forever).
const (
	DefaultQuotaBytes          = 1 << 30
	DefaultCompactionRetention = 10 * time.Minute
)

// Start starts the member and waits until it serves (bounded by ctx). When a port is 0 it
// picks a free one, and picks again if another process takes it first.
func Start(ctx context.Context, c Config) (*Server, error) {
	anyPort := strings.HasSuffix(c.ClientAddr, ":0") || strings.HasSuffix(c.PeerAddr, ":0")
	for attempt := 0; ; attempt++ {
		s, err := start(ctx, c)
		if err == nil || !anyPort || attempt == 4 || !etcdembed.IsAddrInUse(err) {
			return s, err
		}
	}
}

func start(ctx context.Context, c Config) (*Server, error) {
	cu, err := resolve(c.ClientAddr)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd client addr: %w", err)
	}
	pu, err := resolve(c.PeerAddr)
	if err != nil {
		return nil, fmt.Errorf("embedded etcd peer addr: %w", err)
	}
	retention := c.CompactionRetention
	switch {
	case retention == 0:
		retention = DefaultCompactionRetention
	case retention < 0:
		retention = 0 // off
	}
	quota := c.QuotaBytes
	if quota == 0 {
		quota = DefaultQuotaBytes
	}
	// A full (or read-only) data dir: one line naming it, not etcd's panic and stack trace.
	if err := etcdembed.CheckDir(c.Dir, etcdembed.MinFreeBytes); err != nil {
		return nil, fmt.Errorf("embedded etcd: %w", err)
	}
	sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	e, err := etcdembed.StartMember(sctx, etcdembed.MemberConfig{
		Name:                c.Name,
		Dir:                 c.Dir,
		ClientURL:           cu.String(),
		PeerURL:             pu.String(),
		QuotaBytes:          quota,
		CompactionRetention: retention,
	})
	if err != nil {
		return nil, fmt.Errorf("embedded etcd: %w", err)
	}
	return &Server{e: e, clientURL: cu.String()}, nil
}

// ClientURL is the client URL to dial (http://host:port).
func (s *Server) ClientURL() string { return s.clientURL }

// ClientAddr is the client host:port.
func (s *Server) ClientAddr() string {
	u, _ := url.Parse(s.clientURL)
	return u.Host
}

// Err reports a fatal server error.
func (s *Server) Err() <-chan error { return s.e.Err() }

// Close stops the member.
func (s *Server) Close() { s.e.Close() }

// resolve turns host:port into an http URL, replacing port 0 with a free port.
func resolve(addr string) (*url.URL, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if port == "0" {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return nil, err
		}
		port = fmt.Sprint(l.Addr().(*net.TCPAddr).Port)
		_ = l.Close()
	}
	return url.Parse("http://" + net.JoinHostPort(host, port))
}
