// Package policybench holds the routing benchmarks behind `make bench-policy`: decisions in
// process (policy plus reservation) and over one loopback Route stream, for a cluster of 8
// prefill and 32 decode workers with 100,000 resident sessions, and the memory that 1,000,000
// session records take as the control plane's state holds them. The last line it prints is
//
//	policy: <ns> ns/decision in-process, <n> decisions/s over one Route stream, p99 <µs> µs
package policybench
