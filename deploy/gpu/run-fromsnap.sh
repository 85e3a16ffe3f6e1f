#!/usr/bin/env bash
# Prefill from the snapshot and re-homing on a GPU, with real attention KV, against re-prefill
# (issue 24). Beside run-real.sh, with the same binaries (bash deploy/gpu/prepare-real.sh ->
# bin/real.tar.xz, carried to the GPU machine) and the same parts: kvc-refworkers with a real dense
# model's full configuration (default Qwen3-8B's shape, random weights from a fixed seed),
# --transport cuda sidecars, the control-plane HA pair on embedded etcd and the gateway, every
# request recomputed from scratch in its decode worker and compared (--verify-recompute).
#
# Phases (KVC_FS_PHASES, run in order; each writes under $OUT, so they can run in separate calls):
#   fromsnap:P  sessions whose first turn is a P-token context and whose second turn appends a
#               KVC_FS_TAIL-token tail (above the direct-to-D limit: PD_FALLBACK onto the session's
#               own D, REAL_LARGE_APPEND). Arm E4 (snapshots on) serves it by prefill from the
#               snapshot: P loads the session's snapshot prefix from its sidecar's store
#               (--store-memory host: page-locked host memory) into its pool and prefills only the
#               tail; arm E3 (the same system, snapshots off) re-prefills the whole context. Both
#               send D only the tail's pages (D keeps the prefix it holds). Same run, same
#               workload seed, so the same contexts. -> $OUT/fromsnap-P/
#   limit       in-process on the same device (python -m kvc_refworker.limit): the tail's prefill
#               with the prefix KV already in the pool plus one host->GPU copy of the prefix KV,
#               at the prefix and tail lengths the fromsnap phases loaded. -> $OUT/limit.json
#   rehome      E3 and E4 with a decode worker's engine killed (--kill-decode decode-0
#               --kill-worker-only: its sidecar lives and reports it down, as when an engine
#               crashes under systemd) KVC_FS_REHOME_KILL_DELAY [10s] after every session's first
#               turn completed ok (--kill-after-requests = sessions: no race with open first turns;
#               the delay lets the D->P snapshot pushes after the last commits land: killed at once,
#               the sessions committed last had no snapshot yet, and their next turns re-prefilled,
#               as the GPU run of 2026-12-02 07:15 showed); each decode pool
#               KVC_FS_REHOME_DECODE_CAPACITY [80000] tokens, so the survivor holds all four
#               sessions after their second turns (60000 made it evict one mid-run): E4 re-homes
#               its sessions onto the other decode worker from the store before their next turn;
#               E3 re-prefills them at their next turn. -> $OUT/rehome/
#   report      deploy/gpu/fromsnap_report.py: $OUT/gpu-prefill.md, whose last line (also this
#               script's) is
#     gpu-prefill: from_snapshot p50 X ms, reprefill p50 Y ms, limit p50 Z ms, over-limit Q, mismatches N
#
# Knobs (environment; defaults in brackets):
#   KVC_FS_PHASES ["fromsnap:16384 fromsnap:32768 limit rehome report"]
#   KVC_FS_TAIL [9216]            tokens of the large append
#   KVC_FS_SESSIONS [5]           sessions per fromsnap phase (rehome: KVC_FS_REHOME_SESSIONS [4])
#   KVC_FS_DECODE [1]             decode workers of the fromsnap phases (one GPU: fewer processes, so
#                                 a 32K prefix + 9K tail and its check fit); rehome: KVC_FS_REHOME_DECODE [2]
#   KVC_FS_SPACING [12s]          session i starts at i x this (no two timed turns overlap)
#   KVC_REAL_MODEL [qwen3-8b-shape]   KVC_REAL_DEVICES [cuda:0..]   KVC_REAL_SIDECAR_ARGS [--transport cuda]
#   KVC_FS_DECODE_CAPACITY [60000]    KV tokens per decode worker's pool; the sidecars advertise 3x it,
#                                     so the worker's LRU evicts finished sessions (no turn waits)
#   KVC_FS_STORE_BYTES [28 GiB]   KVC_FS_STORE_MEMORY [host]
#   KVC_REAL_VERIFY [1]           KVC_PYTHON [python3]  KVC_BIN_DIR [bin/real]  OUT [out/fromsnap]
# For a CPU dry run: KVC_REAL_MODEL=tiny KVC_REAL_DEVICES=cpu KVC_REAL_SIDECAR_ARGS="--transport tcp"
#   KVC_FS_PHASES="fromsnap:10240 limit rehome report" with a tail just above 8192 (deploy/gpu/dry-fromsnap.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${KVC_BIN_DIR:-bin/real}
OUT=${OUT:-out/fromsnap}
PY=${KVC_PYTHON:-python3}
MODEL=${KVC_REAL_MODEL:-qwen3-8b-shape}
PHASES=${KVC_FS_PHASES:-fromsnap:16384 fromsnap:32768 limit rehome report}
TAIL=${KVC_FS_TAIL:-9216}
SIDECAR_ARGS=${KVC_REAL_SIDECAR_ARGS:---transport cuda}
DCAP=${KVC_FS_DECODE_CAPACITY:-60000}
STORE="--store-capacity-bytes ${KVC_FS_STORE_BYTES:-30064771072} --store-memory ${KVC_FS_STORE_MEMORY:-host}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run-fromsnap.log") 2>&1

. deploy/gpu/lib.sh
if [[ $PHASES == *fromsnap* || $PHASES == *rehome* ]]; then
	real_binaries
fi
real_devices
DEV0=${KVC_REAL_DEVICES%%,*}
export PYTHONPATH="$PWD/integrations/refworker:$PWD/integrations/sglang${PYTHONPATH:+:$PYTHONPATH}"
VERIFY=""
if [[ ${KVC_REAL_VERIFY:-1} == 1 ]]; then VERIFY="--verify-recompute"; fi
REFARGS="--model $MODEL $VERIFY --prealloc-wait 120 --transfer-timeout 300 --bridge-wait 600 ${KVC_REAL_REFWORKER_ARGS:-}"

bench() { # out-dir decode-workers extra-flags...
	local out=$1 decode=$2 dcap=${DCAP_OF:-$DCAP}
	shift 2
	"$BIN/kvc-bench" --local --bin-dir "$BIN" --arms E3,E4 --out "$out" \
		--worker-kind refworker --refworker-python "$PY" --refworker-devices "$KVC_REAL_DEVICES" \
		--refworker-args "$REFARGS" --sidecar-args "$SIDECAR_ARGS" --decode "$decode" \
		--decode-capacity-tokens "$dcap" --decode-advertised-tokens $((3 * dcap)) \
		--prefill-capacity-tokens "${KVC_FS_PREFILL_CAPACITY:-49152}" \
		--prefill-sidecar-args "$STORE" --edit-prob 0 --long-think-prob 0 --time-scale 1 \
		--request-timeout 900s "$@" || echo "kvc-bench exited $?"
	# The clusters' logs and event files, as one file (a device call returns files, not deep folders).
	(cd "$out" && find . -path './cluster-*' \( -name '*.log' -o -name '*.events.jsonl' \) -print0 |
		tar --null -czf cluster-logs.tgz -T -) || true
}

for phase in $PHASES; do
	date -u +"phase $phase start %Y-%m-%dT%H:%M:%SZ"
	case $phase in
	fromsnap:*)
		P=${phase#fromsnap:}
		set -x
		bench "$OUT/fromsnap-$P" "${KVC_FS_DECODE:-1}" --sessions "${KVC_FS_SESSIONS:-5}" --min-turns 2 --max-turns 2 \
			--initial-min-tokens "$P" --initial-max-tokens "$P" --arrival-spacing "${KVC_FS_SPACING:-12s}" \
			--think-min 6s --think-max 8s --large-append-prob 1 \
			--large-append-min-tokens "$TAIL" --large-append-max-tokens "$TAIL"
		set +x
		;;
	limit)
		# The lengths the fromsnap phases loaded (their median loaded prefix and computed tail).
		NOMINAL=$({ tr ' ' '\n' <<<"$PHASES" | sed -n 's/^fromsnap://p'; ls -d "$OUT"/fromsnap-* 2>/dev/null | sed 's/.*fromsnap-//'; } | sort -nu | paste -sd, -)
		read -r PREFIXES TAILS < <("$PY" deploy/gpu/fromsnap_report.py --lengths "$OUT" "$TAIL" "${NOMINAL:-16384,32768}")
		set -x
		"$PY" -m kvc_refworker.limit --model "$MODEL" --device "$DEV0" --prefix "$PREFIXES" --tail "$TAILS" \
			--reps "${KVC_FS_LIMIT_REPS:-5}" --out "$OUT/limit.json"
		set +x
		;;
	rehome)
		set -x
		RS=${KVC_FS_REHOME_SESSIONS:-4}
		DCAP_OF=${KVC_FS_REHOME_DECODE_CAPACITY:-80000} bench "$OUT/rehome" "${KVC_FS_REHOME_DECODE:-2}" --sessions "$RS" --min-turns 2 --max-turns 2 \
			--initial-min-tokens "${KVC_FS_REHOME_CONTEXT:-16384}" --initial-max-tokens "${KVC_FS_REHOME_CONTEXT:-16384}" \
			--arrival-spacing "${KVC_FS_REHOME_SPACING:-5s}" --think-min "${KVC_FS_REHOME_THINK:-40s}" \
			--think-max "${KVC_FS_REHOME_THINK:-40s}" --large-append-prob 0 \
			--kill-decode decode-0 --kill-worker-only --kill-after-requests "$RS" --kill-delay "${KVC_FS_REHOME_KILL_DELAY:-10s}"
		set +x
		;;
	report)
		"$PY" deploy/gpu/fromsnap_report.py "$OUT" ${KVC_REAL_VERIFY:-1} | tee "$OUT/gpu-prefill.md"
		exit "${PIPESTATUS[0]}"
		;;
	*)
		echo "unknown phase $phase (want fromsnap:P, limit, rehome, report)" >&2
		exit 2
		;;
	esac
done
