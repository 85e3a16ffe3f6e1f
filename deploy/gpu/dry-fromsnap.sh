#!/usr/bin/env bash
# The CPU dry run of run-fromsnap.sh (issue 24): every phase end to end on this machine, with the
# tiny model in fp32, kvc-refworkers on CPU and --transport tcp sidecars, so that the script, the
# workers' served lines (P's per-phase breakdown, D's first token from P's aux row), the
# re-homing after --kill-after-requests and the report are exercised before a GPU run. The
# figures mean nothing (tiny model, 2 shared cores); the report's last line must come out and
# mismatches must be 0.
#
#   make build && bash deploy/gpu/dry-fromsnap.sh        (OUT [out/dry-fromsnap], KVC_BIN_DIR [bin])
#
# The first turn holds the workload's shared system prompts (up to 9500 tokens), and the tail stays
# above the policy's direct-to-D limit (8192 tokens), so that the large append is a
# PD_FALLBACK served by prefill from the snapshot (E4) or a re-prefill (E3), as on the GPU.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${KVC_VENV:-$HOME/.cache/kvcentric/venv-sglang-0.5.23-a352308ee9a5}
if [[ -z ${KVC_PYTHON:-} && -x $VENV/bin/python ]]; then
	export KVC_PYTHON=$VENV/bin/python
fi
export KVC_BIN_DIR=${KVC_BIN_DIR:-bin}
export OUT=${OUT:-out/dry-fromsnap}
export KVC_REAL_MODEL=tiny KVC_REAL_DEVICES=cpu KVC_REAL_SIDECAR_ARGS="--transport tcp"
export KVC_REAL_REFWORKER_ARGS=${KVC_REAL_REFWORKER_ARGS:---transfer-api bridge}
export KVC_FS_PHASES=${KVC_FS_PHASES:-fromsnap:10240 limit rehome report}
export KVC_FS_TAIL=${KVC_FS_TAIL:-8448}
export KVC_FS_SESSIONS=${KVC_FS_SESSIONS:-2} KVC_FS_SPACING=${KVC_FS_SPACING:-20s}
export KVC_FS_REHOME_SESSIONS=${KVC_FS_REHOME_SESSIONS:-4} KVC_FS_REHOME_CONTEXT=${KVC_FS_REHOME_CONTEXT:-10240}
export KVC_FS_REHOME_SPACING=${KVC_FS_REHOME_SPACING:-2s} KVC_FS_REHOME_THINK=${KVC_FS_REHOME_THINK:-30s}
export KVC_FS_DECODE_CAPACITY=${KVC_FS_DECODE_CAPACITY:-48000} KVC_FS_REHOME_DECODE_CAPACITY=${KVC_FS_REHOME_DECODE_CAPACITY:-48000} KVC_FS_PREFILL_CAPACITY=${KVC_FS_PREFILL_CAPACITY:-24576}
export KVC_FS_STORE_BYTES=${KVC_FS_STORE_BYTES:-536870912} KVC_FS_LIMIT_REPS=${KVC_FS_LIMIT_REPS:-1}
export KVC_REFWORKER_THREADS=${KVC_REFWORKER_THREADS:-1}
rm -rf "$OUT"
exec nice -n 10 bash deploy/gpu/run-fromsnap.sh
