#!/usr/bin/env bash
# The load sweep with every point in a kvc-bench process of its own, side by side, then gathered
# into one sweep.json with --sweep-reuse: for a machine with more cores than points (the sweep
# itself is `make bench-sweep`, one point after another). Needs only the static binaries.
#
#   deploy/bench/sweep-parallel.sh BIN_DIR OUT "SWEEP" ARMS SESSIONS [kvc-bench flags...]
#   e.g. deploy/bench/sweep-parallel.sh bin out/sweep "1P3D=0.5,1;2P4D=1,2" PD,SGL,E4 8 --local ...
set -euo pipefail
bin=$1 out=$2 sweep=$3 arms=$4 sessions=$5
shift 5
mkdir -p "$out/logs"
pids=()
IFS=';' read -ra groups <<<"$sweep"
for g in "${groups[@]}"; do
	shape=${g%%=*} loads=${g#*=}
	IFS=',' read -ra xs <<<"$loads"
	for x in "${xs[@]}"; do
		"$bin/kvc-bench" "$@" --arms "$arms" --sessions "$sessions" --sweep "$shape=$x" --out "$out" \
			>"$out/logs/$shape-$x.log" 2>&1 &
		pids+=($!)
	done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
"$bin/kvc-bench" "$@" --arms "$arms" --sessions "$sessions" --sweep "$sweep" --sweep-reuse --out "$out"
exit $rc
