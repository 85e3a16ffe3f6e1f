package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"

	"github.com/kvcentric/kvcentric/pkg/etcdembed"
)

// StartTimeout bounds how long a member (or the whole cluster) may take to become ready.
const StartTimeout = 30 * time.Second

// Cluster is a running embedded etcd cluster. Every method is safe for concurrent use.
type Cluster struct {
	tb      testing.TB
	token   string
	members []*Member
}

// Member is one etcd member of a Cluster.
type Member struct {
	Name      string
	Dir       string
	ClientURL string // http://127.0.0.1:PORT
	PeerURL   string // http://127.0.0.1:PORT

	cluster *Cluster
	mu      sync.Mutex
	e       *embed.Etcd
}

// Test members are thrown away with their test: small WAL segments keep a run of hundreds of
// members within tens of MiB of disk (a CI disk near full failed with "failed to create WAL").
func init() { etcdembed.ThrowawayWAL() }

// minFreeBytes is the room a test member asks of its data dir: two WAL segments and a database.
const minFreeBytes = 3*etcdembed.ThrowawayWALSegmentBytes + 4<<20

// Start starts a single-member cluster and registers its shutdown with tb.Cleanup.
func Start(tb testing.TB) *Cluster { return StartN(tb, 1) }

// StartN starts an n-member cluster (n = 1 or 3 in practice) on loopback and waits until it
// serves. It fails the test when the cluster does not start within StartTimeout.
func StartN(tb testing.TB, n int) *Cluster {
	tb.Helper()
	if n < 1 {
		tb.Fatalf("etcdtest: cluster size %d", n)
	}
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		c, err := tryStart(tb, n, attempt)
		if err == nil {
			tb.Cleanup(c.Close)
			return c
		}
		lastErr = err
		if !etcdembed.IsAddrInUse(err) {
			break
		}
	}
	tb.Fatalf("etcdtest: start %d-member cluster: %v", n, lastErr)
	return nil
}

func tryStart(tb testing.TB, n, attempt int) (*Cluster, error) {
	base := tb.TempDir()
	c := &Cluster{tb: tb, token: fmt.Sprintf("etcdtest-%d", attempt)}
	ports, err := etcdembed.FreePorts(2 * n)
	if err != nil {
		return nil, err
	}
	var initial []string
	for i := 0; i < n; i++ {
		m := &Member{
			Name:      fmt.Sprintf("m%d", i),
			Dir:       filepath.Join(base, fmt.Sprintf("m%d", i)),
			ClientURL: fmt.Sprintf("http://127.0.0.1:%d", ports[2*i]),
			PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[2*i+1]),
			cluster:   c,
		}
		c.members = append(c.members, m)
		initial = append(initial, m.Name+"="+m.PeerURL)
	}
	initialCluster := strings.Join(initial, ",")
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, m := range c.members {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = m.start(initialCluster, etcdembed.StateNew)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (m *Member) start(initialCluster, state string) error {
	// etcd panics inside its own goroutines on a full disk; a test fails with one line instead.
	if err := etcdembed.CheckDir(m.Dir, minFreeBytes); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), StartTimeout)
	defer cancel()
	e, err := etcdembed.StartMember(ctx, etcdembed.MemberConfig{
		Name:           m.Name,
		Dir:            m.Dir,
		ClientURL:      m.ClientURL,
		PeerURL:        m.PeerURL,
		InitialCluster: initialCluster,
		Token:          m.cluster.token,
		State:          state,
		NoFsync:        true,
	})
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.e = e
	m.mu.Unlock()
	return nil
}

// Endpoints returns the client URLs of all members (also of stopped ones).
func (c *Cluster) Endpoints() []string {
	out := make([]string, len(c.members))
	for i, m := range c.members {
		out[i] = m.ClientURL
	}
	return out
}

// Members returns the members in start order.
func (c *Cluster) Members() []*Member { return c.members }

// Member returns member i.
func (c *Cluster) Member(i int) *Member { return c.members[i] }

// Client returns a client for all endpoints, closed at test cleanup.
func (c *Cluster) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   c.Endpoints(),
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		tb.Fatalf("etcdtest: client: %v", err)
	}
	tb.Cleanup(func() { _ = cli.Close() })
	return cli
}

// Close stops every running member (test cleanup). A member that cannot hand over leadership
// (a follower, a lone member) stops the way etcd's own close does it, client servers first, then
// storage: the only order in which etcd never serves a request from storage it has already closed
// (a hard stop under an in-flight read panics inside bbolt: nil Tx in Bucket). Followers go first;
// a leader of several members is then killed, as Kill does.
func (c *Cluster) Close() {
	var leaders []*Member
	for _, m := range c.members {
		if len(c.members) > 1 && m.isLeader() {
			leaders = append(leaders, m)
			continue
		}
		if e := m.take(); e != nil {
			e.Close()
		}
	}
	for _, m := range leaders {
		m.Kill()
	}
}

// Kill stops the member at once (its raft node halts before anything else: no leadership
// transfer, no grace for clients). Data stays in Dir.
func (m *Member) Kill() {
	if e := m.take(); e != nil {
		e.Server.HardStop()
		e.Close()
	}
}

// take detaches the running etcd from the member (nil when it is stopped).
func (m *Member) take() *embed.Etcd {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.e
	m.e = nil
	return e
}

// isLeader reports whether the member runs and is its cluster's raft leader.
func (m *Member) isLeader() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.e != nil && m.e.Server.Leader() == m.e.Server.MemberID()
}

// Running reports whether the member is started.
func (m *Member) Running() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.e != nil
}

// Restart starts a killed member again on the same ports with its data.
func (m *Member) Restart(tb testing.TB) {
	tb.Helper()
	if m.Running() {
		tb.Fatalf("etcdtest: member %s is running", m.Name)
	}
	var initial []string
	for _, o := range m.cluster.members {
		initial = append(initial, o.Name+"="+o.PeerURL)
	}
	if err := m.start(strings.Join(initial, ","), etcdembed.StateExisting); err != nil {
		tb.Fatalf("etcdtest: restart: %v", err)
	}
}

// WaitHealthy waits until a quorum answers a linearizable read, or ctx ends.
func (c *Cluster) WaitHealthy(ctx context.Context, cli *clientv3.Client) error {
	for {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		_, err := cli.Get(rctx, "etcdtest-health")
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("etcdtest: not healthy: %w", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
