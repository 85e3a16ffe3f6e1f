package cluster

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"strings"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// startEtcd runs a single-member etcd in this process on free loopback ports, data under dir.
func startEtcd(dir string) (*embed.Etcd, string, error) {
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		ports, err := freePorts(2)
		if err != nil {
			return nil, "", err
		}
		cu, _ := url.Parse(fmt.Sprintf("http://127.0.0.1:%d", ports[0]))
		pu, _ := url.Parse(fmt.Sprintf("http://127.0.0.1:%d", ports[1]))
		cfg := embed.NewConfig()
		cfg.Name = "kvc-local"
		cfg.Dir = filepath.Join(dir, fmt.Sprintf("etcd-%d", attempt))
		cfg.ListenClientUrls = []url.URL{*cu}
		cfg.AdvertiseClientUrls = []url.URL{*cu}
		cfg.ListenPeerUrls = []url.URL{*pu}
		cfg.AdvertisePeerUrls = []url.URL{*pu}
		cfg.InitialCluster = cfg.Name + "=" + pu.String()
		cfg.InitialClusterToken = "kvc-local"
		cfg.UnsafeNoFsync = true
		cfg.LogLevel = "error"
		cfg.LogOutputs = []string{filepath.Join(dir, "etcd.log")}
		e, err := embed.StartEtcd(cfg)
		if err != nil {
			lastErr = err
			if strings.Contains(err.Error(), "address already in use") {
				continue
			}
			return nil, "", fmt.Errorf("embedded etcd: %w", err)
		}
		select {
		case <-e.Server.ReadyNotify():
			return e, cu.String(), nil
		case err := <-e.Err():
			e.Close()
			lastErr = err
		case <-time.After(30 * time.Second):
			e.Close()
			return nil, "", errors.New("embedded etcd: not ready after 30s")
		}
	}
	return nil, "", fmt.Errorf("embedded etcd: %w", lastErr)
}

// freePorts reserves n distinct free loopback ports (released before returning; a small race
// with other processes remains, which callers retry).
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			_ = l.Close()
		}
	}()
	out := make([]int, 0, n)
	for i := 0; i < n; i++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}
