#!/usr/bin/env bash
# The real-model run (issue 12 item 4): one prefill and N decode kvc-refworkers (a Qwen3-8B-shaped
# model with random weights computing real attention KV) next to their real sidecars
# (--transport cuda: KV moves GPU to GPU through CUDA IPC), the real control-plane HA pair on an
# embedded etcd and the real gateway; kvc-bench replays the built-in agentic workload (contexts
# of 16K tokens and more) for E1 (plain P/D), E3 (KV-centric, no snapshots) and E4 (KV-centric
# with D->P snapshots), every request recomputed from scratch in its decode worker and compared.
#
# Run on the GPU machine from the repository root (no Go needed there):
#   1. on a machine with Go:  bash deploy/gpu/prepare-real.sh   -> bin/real.tar.xz (~33 MiB)
#   2. carry the repository (integrations/refworker, integrations/sglang, deploy/) and
#      bin/real.tar.xz to the GPU machine
#   3. there:                 bash deploy/gpu/run-real.sh
# It needs Python 3.10+ with torch (CUDA), transformers (5.x; 4.51+ works) and grpcio: the
# GPU machine's own (torch 2.11+cu130, transformers 5.17) - nothing is downloaded. sglang is not
# needed there (the refworker then uses its built-in pool of SGLang's exact geometry).
#
# Output: $OUT (default out/real): report.md (per-arm, per-mode TTFT tables and the recompute
# table), summary.json, metrics.jsonl (one line per request), run-real.log (everything), the
# clusters' logs (cluster-E*/), and real-summary.txt whose last line - also this script's last
# line - is
#   real: reseed_snapshot p50 X ms, reseed_prefill p50 Y ms, ratio R, mismatches N
# (TTFT p50 of the successful RESEED_SNAPSHOT and RESEED_PREFILL requests with contexts >=
# KVC_REAL_MIN_CONTEXT tokens, over all arms of this run; R = X/Y; N = recompute mismatches of
# all requests). The exit status is 0 only when both reseed modes were measured and N = 0.
#
# Knobs (environment; defaults in brackets):
#   KVC_REAL_MODEL [qwen3-8b-shape]     refworker model (tiny: a CPU-sized one, for a dry run)
#   KVC_REAL_DECODE [2]                 decode workers (one H200 holds 1 P + 2 D of 8B comfortably;
#                                       3 D fit with KVC_REAL_DECODE_CAPACITY=40000)
#   KVC_REAL_DEVICES [cuda:0..cuda:G-1] devices cycled over the workers, prefill first (G = GPUs
#                                       nvidia-smi lists): 1 GPU -> all on cuda:0; 4 GPUs -> P on 0,
#                                       D0 on 1, D1 on 2, ...; "cpu" for a dry run without a GPU
#   KVC_REAL_SIDECAR_ARGS [--transport cuda]   ("--transport tcp" for a dry run)
#   KVC_REAL_ARMS [E1,E3,E4]
#   KVC_REAL_SESSIONS [6]  KVC_REAL_MIN_TURNS [3]  KVC_REAL_MAX_TURNS [5]
#   KVC_REAL_CTX_MIN [16384]  KVC_REAL_CTX_MAX [24576]   first-turn contexts (tokens)
#   KVC_REAL_DECODE_CAPACITY [56000]    KV tokens per decode worker's pool (below the working
#                                       set: evictions, hence reseeds)
#   KVC_REAL_ADVERTISED [3 x capacity]  capacity the decode sidecars report to the control plane:
#                                       above the pool, so the control plane sends sessions to
#                                       a full D whose LRU then evicts idle ones (instead of
#                                       answering NO_D_CAPACITY with plain P/D)
#   KVC_REAL_STORE_MEMORY [cuda]        where the prefill sidecar's snapshot store lives: cuda (device
#                                       memory of P's GPU: a reseed is a device-to-device copy) or
#                                       host (a page-locked memfd: host-to-device at ~55 GB/s)
#   KVC_REAL_STORE_BYTES [24 GiB]       the prefill sidecar's snapshot store; a 16K-token snapshot
#                                       of this model is 2.4 GB
#   KVC_REAL_PREFILL_CAPACITY [65536]   KV tokens of the prefill worker's pool (>= the largest input;
#                                       several prefills hold pages until their transfer ends)
#   KVC_REAL_TIME_SCALE [1]             workload clock (arrivals, think times 1-6 s); much lower
#                                       and a session's next turn can evict it before its
#                                       2.4 GB D->P push finished (then SNAPSHOT_MISSING)
#   KVC_REAL_MIN_CONTEXT [16384]        reseeds counted in the final line have inputs >= this
#   KVC_REAL_VERIFY [1]                 --verify-recompute on every worker (0: off; N is then n/a)
#   KVC_REAL_REFWORKER_ARGS []          extra kvc-refworker flags
#   KVC_PYTHON [python3]  KVC_BIN_DIR [bin/real]  OUT [out/real]
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${KVC_BIN_DIR:-bin/real}
OUT=${OUT:-out/real}
PY=${KVC_PYTHON:-python3}
MODEL=${KVC_REAL_MODEL:-qwen3-8b-shape}
NDEC=${KVC_REAL_DECODE:-2}
ARMS=${KVC_REAL_ARMS:-E1,E3,E4}
SIDECAR_ARGS=${KVC_REAL_SIDECAR_ARGS:---transport cuda}
MINCTX=${KVC_REAL_MIN_CONTEXT:-16384}
mkdir -p "$OUT"
exec > >(tee "$OUT/run-real.log") 2>&1

. deploy/gpu/lib.sh
real_binaries
real_devices
export PYTHONPATH="$PWD/integrations/refworker:$PWD/integrations/sglang${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - "$MODEL" "$KVC_REAL_DEVICES" <<'PYEOF'
import sys, torch, transformers, grpc
from kvc_refworker import model
spec = model.spec_for(sys.argv[1])
print("python %s, torch %s, transformers %s, grpcio %s" % (sys.version.split()[0], torch.__version__, transformers.__version__, grpc.__version__))
print("model %s: %d layers, hidden %d, %d heads / %d KV heads, head_dim %d, %s, %d KV bytes per token" % (
    spec.name, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.dtype,
    2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.empty((), dtype=spec.dtype).element_size()))
if "cuda" in sys.argv[2]:
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print("cuda:%d %s, %.0f GiB" % (i, p.name, p.total_memory / 2**30))
PYEOF
date -u +"start %Y-%m-%dT%H:%M:%SZ"
VERIFY=""
if [[ ${KVC_REAL_VERIFY:-1} == 1 ]]; then VERIFY="--verify-recompute"; fi
REFARGS="--model $MODEL $VERIFY --prealloc-wait 120 --transfer-timeout 300 --bridge-wait 600 ${KVC_REAL_REFWORKER_ARGS:-}"
set -x
"$BIN/kvc-bench" --local --bin-dir "$BIN" --arms "$ARMS" --out "$OUT" \
	--worker-kind refworker --refworker-python "$PY" --refworker-devices "$KVC_REAL_DEVICES" \
	--refworker-args "$REFARGS" --sidecar-args "$SIDECAR_ARGS" --decode "$NDEC" \
	--decode-capacity-tokens "${KVC_REAL_DECODE_CAPACITY:-56000}" --prefill-capacity-tokens "${KVC_REAL_PREFILL_CAPACITY:-65536}" \
	--decode-advertised-tokens "${KVC_REAL_ADVERTISED:-$((3 * ${KVC_REAL_DECODE_CAPACITY:-56000}))}" \
	--prefill-sidecar-args "--store-capacity-bytes ${KVC_REAL_STORE_BYTES:-25769803776} --store-memory ${KVC_REAL_STORE_MEMORY:-cuda}" \
	--sessions "${KVC_REAL_SESSIONS:-6}" --min-turns "${KVC_REAL_MIN_TURNS:-3}" --max-turns "${KVC_REAL_MAX_TURNS:-5}" \
	--initial-min-tokens "${KVC_REAL_CTX_MIN:-16384}" --initial-max-tokens "${KVC_REAL_CTX_MAX:-24576}" \
	--large-append-prob 0 --time-scale "${KVC_REAL_TIME_SCALE:-1}" --request-timeout 900s || echo "kvc-bench exited $?"
set +x
date -u +"end %Y-%m-%dT%H:%M:%SZ"
"$PY" - "$OUT" "$MINCTX" "${KVC_REAL_VERIFY:-1}" <<'PYEOF' | tee "$OUT/real-summary.txt"
import json, math, sys
out, minctx, verify = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
recs = [json.loads(l) for l in open(out + "/metrics.jsonl") if l.strip()]

def p50(xs):
    xs = sorted(xs)
    return xs[max(0, math.ceil(0.5 * len(xs)) - 1)] if xs else float("nan")

print("| arm | mode | requests | ok | TTFT p50 ms | TTFT p99 ms | mean input | checked | mismatches | worker TTFT p50 ms | worker prefill p50 ms | receive wait p50 ms | device wait p50 ms | pages wait p50 ms |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for arm in sorted({r["arm"] for r in recs}):
    for mode in sorted({r["execution_mode"] for r in recs if r["arm"] == arm}):
        rs = [r for r in recs if r["arm"] == arm and r["execution_mode"] == mode]
        ok = [r for r in rs if r["ok"]]
        t = sorted(r["ttft_s"] * 1000 for r in ok)
        p99 = t[max(0, math.ceil(0.99 * len(t)) - 1)] if t else float("nan")
        print("| %s | %s | %d | %d | %.1f | %.1f | %.0f | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f |" % (
            arm, mode, len(rs), len(ok), p50(t), p99, sum(r["input_tokens"] for r in rs) / len(rs),
            sum(1 for r in rs if r.get("recompute_checked")), sum(r.get("recompute_mismatches", 0) for r in rs),
            p50([r.get("worker_ttft_ms", 0) for r in ok]), p50([r.get("worker_prefill_ms", 0) for r in ok]),
            p50([r.get("receive_wait_ms", 0) for r in ok]), p50([r.get("gpu_wait_ms", 0) for r in ok]),
            p50([r.get("alloc_ms", 0) for r in ok])))
big = [r for r in recs if r["ok"] and r["input_tokens"] >= minctx]
snap = [r["ttft_s"] * 1000 for r in big if r["execution_mode"] == "RESEED_SNAPSHOT"]
pref = [r["ttft_s"] * 1000 for r in big if r["execution_mode"] == "RESEED_PREFILL"]
mism = sum(r.get("recompute_mismatches", 0) for r in recs)
unchecked = sum(1 for r in recs if r["ok"] and not r.get("recompute_checked"))
failed = sum(1 for r in recs if not r["ok"])
print("requests %d, failed %d, unchecked ok requests %d; reseeds with input >= %d: %d via snapshot, %d via re-prefill" % (
    len(recs), failed, unchecked, minctx, len(snap), len(pref)))
x, y = p50(snap), p50(pref)
r = x / y if snap and pref else float("nan")
n = str(mism) if verify else "n/a (KVC_REAL_VERIFY=0)"
print("real: reseed_snapshot p50 %.1f ms, reseed_prefill p50 %.1f ms, ratio %.3f, mismatches %s" % (x, y, r, n))
sys.exit(0 if snap and pref and verify and mism == 0 else 1)
PYEOF
