package etcdtest

import (
	"fmt"
	"path/filepath"

	"go.etcd.io/etcd/server/v3/embed"
)

// StartSingle starts a one-member etcd outside a test: data under dir (one subdirectory per
// attempt), free loopback ports (a start that loses a port to another process between the pick
// and the bind is retried), etcd's own log at level error appended to logPath ("" discards it).
// It returns once the member serves, with its client URL; the caller closes the *embed.Etcd.
func StartSingle(dir, logPath string) (*embed.Etcd, string, error) {
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		ports, err := freePorts(2)
		if err != nil {
			return nil, "", err
		}
		m := &Member{
			Name:      "m0",
			Dir:       filepath.Join(dir, fmt.Sprintf("etcd-%d", attempt)),
			ClientURL: fmt.Sprintf("http://127.0.0.1:%d", ports[0]),
			PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[1]),
			cluster:   &Cluster{token: fmt.Sprintf("etcd-single-%d", attempt)},
			logPath:   logPath,
		}
		m.cluster.members = []*Member{m}
		err = m.start(m.Name+"="+m.PeerURL, embed.ClusterStateFlagNew)
		if err == nil {
			return m.e, m.ClientURL, nil
		}
		lastErr = err
		if !isAddrInUse(err) {
			break
		}
	}
	return nil, "", fmt.Errorf("embedded etcd: %w", lastErr)
}
