// Package etcdtest starts real embedded etcd servers for tests of any module: a single member
// or a 3-member cluster on loopback, with data in t.TempDir(), and a handle to kill and restart
// members (to test failover, quorum loss and restarts).
//
// Ports are chosen free at start (the peer port too, so parallel tests never collide on the
// etcd defaults 2379/2380); a member restarts on the same ports with the same data.
package etcdtest
