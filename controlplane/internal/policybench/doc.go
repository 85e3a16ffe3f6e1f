// Package policybench holds the routing benchmarks behind `make bench-policy`, for a cluster of
// 8 prefill and 32 decode workers with 100,000 resident sessions. It prints, in order: the
// router over the in-memory routertest.Cluster (isolates the policy and the router), how the
// real path was set up and how many etcd writes its decisions caused, the heap a real
// state.State leader holds per session (scaled to 1,000,000), and last the headline measured on
// the real leader path — state.State leading under an etcd fence (embedded etcd, the
// write-behind batcher flushing to it), workers attached and reporting residency through the
// state's sidecar API, router.New(state) in process and served by pkg/grpcx on a loopback
// listener:
//
//	policy: <ns> ns/decision in-process, <n> decisions/s over one Route stream, p99 <µs> µs; open loop at 50000/s: <n> decisions/s, p99 <µs> µs
package policybench
