// Package cluster brings up a whole kvcentric cluster as real processes on loopback: an
// embedded etcd (in this process), a control-plane HA pair, per worker a sidecar and a kvc-sim,
// and the gateway. Each process is waited for through its ready file (docs/interfaces.md), with a
// deadline and its log tail on failure. kvc-local and kvc-bench --local use it.
package cluster
