#!/usr/bin/env bash
# The GPU checks and benchmarks of the cuda transfer backend and of the sidecars, run on the GPU
# machine (two GPUs) from the repository root. The machine needs the NVIDIA driver
# (libcuda.so.1) and no Go toolchain: build the static binaries first, on any machine, with
# `make bench-gpu` (bin/gpu/: rdma.test, gpubench.test, kvc-sidecar-decode, kvc-sidecar-prefill).
#
#   bash deploy/gpu/bench-gpu.sh            # GPU unit tests, engine benchmark, sidecar benchmark
#   KVC_GPU_STEPS=tests,sidecars bash deploy/gpu/bench-gpu.sh
#
# Output goes to stdout and to $OUT (default out/gpu): gpu-tests.txt, gpu-bench.txt (engine
# level) and gpu-sidecars.txt (the real sidecar binaries). The last line of each benchmark is
# "gpu: push … GB/s, reseed … GB/s, peer-copy baseline … GB/s, ratio …"; the script ends with the
# sidecar benchmark's.
# Benchmark knobs (environment): KVC_GPU_BENCH_TOKENS (50000), KVC_GPU_BENCH_REPS (5),
# KVC_GPU_BENCH_SWEEP ("chunk:block:group:copy[:workers],…", the first is the reported configuration).
set -euo pipefail
T=${KVC_GPU_TEST_BIN:-bin/gpu/rdma.test}
S=${KVC_GPU_SIDECAR_BIN:-bin/gpu/gpubench.test}
OUT=${OUT:-out/gpu}
STEPS=${KVC_GPU_STEPS:-tests,bench,sidecars}
mkdir -p "$OUT"
for f in "$T" "$S" bin/gpu/kvc-sidecar-decode bin/gpu/kvc-sidecar-prefill; do
	if [[ ! -x $f ]]; then
		echo "missing $f: run 'make bench-gpu' first" >&2
		exit 2
	fi
done

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
if [[ ,$STEPS, == *,sidecars,* ]]; then
	# The sidecar benchmark runs the real binaries of bin/gpu (KVC_BIN_DIR); knobs
	# KVC_GPU_BENCH_TOKENS (50000) and KVC_GPU_BENCH_REPS (5).
	step gpu-sidecars env KVC_GPU_BENCH=1 KVC_BIN_DIR="$PWD/bin/gpu" "$S" -test.run '^TestSidecarBenchGPU$' -test.v -test.count=1 -test.timeout 900s || status=$?
	grep '^gpu:' "$OUT/gpu-sidecars.txt" | tail -1 || true
fi
exit $status
