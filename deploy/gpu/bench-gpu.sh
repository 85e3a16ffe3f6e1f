#!/usr/bin/env bash
# The GPU checks and benchmark of the cuda transfer backend, run on the GPU machine from the
# repository root. The machine needs the NVIDIA driver (libcuda.so.1) and no Go toolchain: build
# the static test binary first, on any machine, with `make bench-gpu` (bin/gpu/rdma.test).
#
#   bash deploy/gpu/bench-gpu.sh            # GPU unit tests, then the benchmark
#   KVC_GPU_STEPS=bench bash deploy/gpu/bench-gpu.sh
#
# Output goes to stdout and to $OUT (default out/gpu): gpu-tests.txt, gpu-bench.txt. The last
# line of the benchmark is "gpu: push … GB/s, reseed … GB/s, peer-copy baseline … GB/s, ratio …".
# Benchmark knobs (environment): KVC_GPU_BENCH_TOKENS (50000), KVC_GPU_BENCH_REPS (5),
# KVC_GPU_BENCH_SWEEP ("chunk:block:group:copy[:workers],…", the first is the reported configuration).
set -euo pipefail
T=${KVC_GPU_TEST_BIN:-bin/gpu/rdma.test}
OUT=${OUT:-out/gpu}
STEPS=${KVC_GPU_STEPS:-tests,bench}
mkdir -p "$OUT"
if [[ ! -x $T ]]; then
	echo "missing $T: run 'make bench-gpu' first" >&2
	exit 2
fi

header() {
	echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
	if command -v nvidia-smi >/dev/null; then
		nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | sed 's/^/nvidia-smi: /'
		nvidia-smi topo -m 2>/dev/null | sed -n '1,3p' | sed 's/^/topo: /'
	fi
	echo "host: $(nproc) CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
}

# step NAME CMD...: run CMD after the header, into $OUT/NAME.txt and stdout; CMD's exit status.
step() {
	local name=$1
	shift
	{
		header
		"$@"
	} 2>&1 | tee "$OUT/$name.txt"
	return "${PIPESTATUS[0]}"
}

status=0
if [[ ,$STEPS, == *,tests,* ]]; then
	step gpu-tests "$T" -test.run 'CUDA' -test.v -test.count=1 -test.timeout 300s || status=$?
fi
if [[ ,$STEPS, == *,bench,* ]]; then
	step gpu-bench env KVC_GPU_BENCH=1 "$T" -test.run '^TestCUDABenchGPU$' -test.v -test.count=1 -test.timeout 900s || status=$?
	grep '^gpu:' "$OUT/gpu-bench.txt" | tail -1 || true
fi
exit $status
