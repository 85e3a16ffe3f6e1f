// Package routertest is an in-memory router.Cluster for tests and benchmarks: the same
// contract as the control plane's state (records copied out, UpdateSession's fn applied under
// the lock, commands queued per worker, copy-on-write worker snapshots), without etcd.
package routertest
