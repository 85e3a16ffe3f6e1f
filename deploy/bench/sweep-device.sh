#!/usr/bin/env bash
# On the device machine (16 cores, no Go): sweep points (each point and arm its own kvc-bench process, at most JOBS at once), outputs
# (summary.json, report.md, metrics.jsonl, logs, load samples) as one tarball under $OUT.
# The static binaries travel as bin/sweep.tar.xz (a sweep/ folder of kvc-bench, kvc-sim,
# kvc-controlplane, kvc-gateway and both sidecars, built with CGO_ENABLED=0 -ldflags "-s -w");
# SWEEP, ARMS, TAG, JOBS (default 4) and BUDGET (seconds, default 540) as below. The points of
# several calls are gathered on any machine with kvc-bench --sweep-gather --sweep-from DIR,... .
# EXTRA: more kvc-bench flags for every point (e.g. EXTRA="--seed-through-store"); each TAG has
# its own output folder, so two calls of this script with different TAGs may run side by side.
# Keep the machine's load average well below its cores: E4's release-and-reseed cycle at the top
# of 1P3D is CPU-contention-sensitive (docs/benchmark.md, "The top of 1P3D on a quiet device"):
# JOBS=4 on 16 cores kept the load average under 5.
set -u
cd "$(dirname "$0")/../.."
# extracted once per machine: a second call beside a running one must not rewrite its binaries
[ -x /tmp/kvc/sweep/kvc-bench ] || { mkdir -p /tmp/kvc && tar -C /tmp/kvc -xJf bin/sweep.tar.xz; }
nproc; uptime
SWEEP=${SWEEP:-"2P4D=8,6,4,2,1;1P3D=3,2,1,0.5;2P4D@700K=2"}
ARMS=${ARMS:-PD,SGL,LLMD}
TAG=${TAG:-base}
start=$(date +%s)
JOBS=${JOBS:-4} GATHER=0 SPLIT_ARMS=1 timeout ${BUDGET:-540} bash deploy/bench/sweep-parallel.sh /tmp/kvc/sweep /tmp/kvc/out/$TAG "$SWEEP" "$ARMS" 8 \
  --local --bin-dir /tmp/kvc/sweep --time-scale 0.3 --sim-args "--page-size 64 --layers 8 --prealloc-wait 20s" \
  --decode-capacity-tokens 88000 --send-ids --slo-ttft 2s --slo-tpot 50ms ${EXTRA:-}
echo "sweep rc=$? after $(( $(date +%s) - start )) s"; uptime
cd /tmp/kvc/out/$TAG && find . \( -name 'summary.json' -o -name 'report.md' -o -name 'metrics.jsonl' -o -path './logs/*' \) -print0 | xargs -0 tar -czf $OUT/sweep-$TAG.tgz
for f in logs/*.log; do echo "== $f"; tail -2 "$f"; done 2>&1 | cut -c1-300
tail -5 logs/loadavg.log; awk '{print $2}' logs/loadavg.log | sort -n | tail -1
ls -la $OUT
