// Package etcdtest starts real embedded etcd servers for tests of any module: a single member
// or a 3-member cluster on loopback, with data in t.TempDir(), and a handle to kill and restart
// members (to test failover, quorum loss and restarts).
//
// Ports are chosen free at start (the peer port too, so parallel tests never collide on the
// etcd defaults 2379/2380); a member restarts on the same ports with the same data.
//
// Members are started by pkg/etcdembed; programs that bring up a throwaway etcd of their own
// (kvc-local's cluster) use etcdembed.StartSingle, so no binary links this package or testing.
package etcdtest
