// Package faults is `make test-faults`: it starts a whole kvcentric cluster as real processes
// on loopback — a 3-member etcd (embedded in the test process through pkg/etcdtest), two
// kvc-controlplane replicas reaching etcd through black-holing proxies (pkg/netproxy), one
// prefill and three decode kvc-sim workers with their sidecars (one decode sidecar reaches the
// control planes through proxies too), and kvc-gateway — drives bounded multi-turn session
// traffic through the gateway (Load), and injects one fault after another (Scenarios): leader
// and standby kill -9, sidecar and worker kill -9 + restart, all sidecars restarted, etcd
// restart and quorum loss, a half-open sidecar link, the leader cut off from etcd, a gateway
// body flood.
//
// Every answer is recorded (mode, decode worker, fail-open) and turned into a per-session
// history of a residency register (check.go defines what an acknowledged write is), closed by
// AdminService/GetSession reads at a quiescent point after each scenario; porcupine checks the
// history for linearizability, and lost writes are counted. Each scenario prints
//
//	fault: NAME recovery X s, failed F, lost L, duplicated D
//
// and the run ends with
//
//	faults: S scenarios, recovered R, lost L, duplicated D, max recovery X s
//
// Scenario criteria and bounds are in docs/reliability.md. TestFaults runs only with
// KVC_FAULTS set (ci, all, or names) and KVC_BIN_DIR naming the built binaries.
//
// # Concurrency Model
//
// The load generator runs a pacer and Clients goroutines in an errgroup, each owning a fixed
// subset of sessions (so a session's turns are sequential); results are appended under a
// mutex. A scenario runs the load in the background while the runner injects the fault and
// polls the cluster; the load is stopped (every request answered or timed out) before the
// quiescent reads and the checks.
package faults
