// Package app is kvc-controlplane: options (flags and KVC_* environment variables), and Run,
// which wires etcd (external or embedded), the store, the leader election, the state, the
// gRPC services (admin, sidecar, router) behind the leader gate, and the observability
// HTTP server, all as siblings of one errgroup.
package app
