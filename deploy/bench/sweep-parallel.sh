#!/usr/bin/env bash
# The load sweep with every point (or, with SPLIT_ARMS=1, every point and arm) in a kvc-bench
# process of its own, side by side, then gathered into one OUT/sweep.json with --sweep-gather
# (and --sweep-from for the per-arm directories): for a machine with more cores than the sweep
# has points (`make bench-sweep` runs them one after another). Needs only the static binaries.
#
#   deploy/bench/sweep-parallel.sh BIN_DIR OUT "SWEEP" ARMS SESSIONS [kvc-bench flags...]
#   e.g. deploy/bench/sweep-parallel.sh bin out/sweep "1P3D=0.5,1;2P4D=1,2" PD,SGL,E4 8 --local ...
#
# JOBS (default: unbounded) caps the kvc-bench processes running at once: each runs a whole
# cluster, and a CPU-starved cluster stretches its transfers and timers, so keep the machine's
# load average below its cores (OUT/logs/loadavg.log samples /proc/loadavg every 10 s).
# GATHER=0 skips the final gather (a partial run whose directories another run gathers).
set -euo pipefail
bin=$1 out=$2 sweep=$3 arms=$4 sessions=$5
shift 5
mkdir -p "$out/logs"
jobs=${JOBS:-0}
case $jobs in
''|*[!0-9]*) echo "sweep-parallel: JOBS=$jobs must be a whole number (0: unbounded)" >&2; exit 2 ;;
esac
(while :; do echo "$(date -u +%H:%M:%S) $(cat /proc/loadavg)"; sleep 10; done) >>"$out/logs/loadavg.log" 2>/dev/null &
sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT
rc=0
# throttle waits until fewer than JOBS processes run (one finished process's status kept in rc).
throttle() {
	while [ "$jobs" -gt 0 ] && [ "$(jobs -rp | grep -vc "^$sampler\$")" -ge "$jobs" ]; do
		wait -n || rc=1
	done
}
from=()
IFS=',' read -ra armlist <<<"$arms"
if [ "${SPLIT_ARMS:-0}" = 1 ]; then
	for a in "${armlist[@]}"; do from+=("$out/arm-$a"); done
fi
IFS=';' read -ra groups <<<"$sweep"
for g in "${groups[@]}"; do
	shape=${g%%=*} loads=${g#*=}
	IFS=',' read -ra xs <<<"$loads"
	for x in "${xs[@]}"; do
		if [ "${SPLIT_ARMS:-0}" = 1 ]; then
			for a in "${armlist[@]}"; do
				throttle
				"$bin/kvc-bench" "$@" --arms "$a" --sessions "$sessions" --sweep "$shape=$x" --out "$out/arm-$a" \
					>"$out/logs/$shape-$x-$a.log" 2>&1 &
			done
		else
			throttle
			"$bin/kvc-bench" "$@" --arms "$arms" --sessions "$sessions" --sweep "$shape=$x" --out "$out" \
				>"$out/logs/$shape-$x.log" 2>&1 &
		fi
	done
done
# the rest (the sampler never ends, so wait -n returns for a kvc-bench)
while [ "$(jobs -rp | grep -vc "^$sampler\$")" -gt 0 ]; do wait -n || rc=1; done
[ "$rc" = 0 ] || echo "sweep-parallel: a kvc-bench run failed (see $out/logs)" >&2
[ "${GATHER:-1}" = 1 ] || exit $rc
fromflag=()
if [ ${#from[@]} -gt 0 ]; then fromflag=(--sweep-from "$(IFS=,; echo "${from[*]}")"); fi
"$bin/kvc-bench" "$@" --arms "$arms" --sessions "$sessions" --sweep "$sweep" --sweep-gather "${fromflag[@]}" --out "$out"
exit $rc
