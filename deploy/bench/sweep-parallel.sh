#!/usr/bin/env bash
# The load sweep with every point (or, with SPLIT_ARMS=1, every point and arm) in a kvc-bench
# process of its own, side by side, then gathered into one OUT/sweep.json with --sweep-gather
# (and --sweep-from for the per-arm directories): for a machine with more cores than the sweep
# has points (`make bench-sweep` runs them one after another). Needs only the static binaries.
#
#   deploy/bench/sweep-parallel.sh BIN_DIR OUT "SWEEP" ARMS SESSIONS [kvc-bench flags...]
#   e.g. deploy/bench/sweep-parallel.sh bin out/sweep "1P3D=0.5,1;2P4D=1,2" PD,SGL,E4 8 --local ...
set -euo pipefail
bin=$1 out=$2 sweep=$3 arms=$4 sessions=$5
shift 5
mkdir -p "$out/logs"
pids=()
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
				"$bin/kvc-bench" "$@" --arms "$a" --sessions "$sessions" --sweep "$shape=$x" --out "$out/arm-$a" \
					>"$out/logs/$shape-$x-$a.log" 2>&1 &
				pids+=($!)
			done
		else
			"$bin/kvc-bench" "$@" --arms "$arms" --sessions "$sessions" --sweep "$shape=$x" --out "$out" \
				>"$out/logs/$shape-$x.log" 2>&1 &
			pids+=($!)
		fi
	done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
fromflag=()
if [ ${#from[@]} -gt 0 ]; then fromflag=(--sweep-from "$(IFS=,; echo "${from[*]}")"); fi
"$bin/kvc-bench" "$@" --arms "$arms" --sessions "$sessions" --sweep "$sweep" --sweep-gather "${fromflag[@]}" --out "$out"
exit $rc
