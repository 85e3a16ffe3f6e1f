// Package gpubench is the sidecar-level benchmark of issue 7: the real kvc-sidecar-decode and
// kvc-sidecar-prefill binaries move a 50,000-token Qwen3-30B-A3B-shaped session D→P (snapshot
// push) and P→D′ (reseed), every byte verified, against a contiguous peer copy of the same size
// measured in the same run. Its test process plays the workers (it owns the KV pools and
// registers them over the WorkerBridge sockets) and a scripted control plane (pkg/sidecar/cptest).
//
// TestSidecarBenchGPU runs on a machine with two GPUs when KVC_GPU_BENCH=1 (deploy/gpu/
// bench-gpu.sh); TestSidecarBenchCPU runs the same flow at small scale with the tcp transport
// and shared-memory pools everywhere, so the harness itself is tested in CPU-only CI.
package gpubench
