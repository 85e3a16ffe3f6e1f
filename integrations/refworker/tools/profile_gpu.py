"""Where a decode worker's time goes on the GPU: prefill from scratch, append-prefill of a tail on
a long past (the DIRECT_TO_D and RESEED_SNAPSHOT path: gather from the pool, forward, write
back), a decode step, for transformers' stock SDPA attention and the refworker's own (model.py
_kvc_attention); plus the copies a reseed makes (pinned host -> device, device -> device).
Prints one line per figure and a profiler table per attention for one append.

Usage: python tools/profile_gpu.py [--model qwen3-8b-shape] [--past 16384] [--tails 257,600,333,600]"""

import argparse
import os
import statistics
import sys
import time

here = os.path.dirname(__file__)
sys.path[:0] = [os.path.join(here, ".."), os.path.join(here, "..", "..", "sglang")]

import torch  # noqa: E402

from kvc_refworker import model as M  # noqa: E402
from kvc_refworker.pool import KVPool  # noqa: E402
from kvc_refworker.request import scripted_tokens  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args):
    """fn(*args) and its wall time in ms, the device synchronized before and after."""
    sync()
    t = time.monotonic()
    r = fn(*args)
    sync()
    return r, (time.monotonic() - t) * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b-shape")
    ap.add_argument("--past", type=int, default=16384)
    ap.add_argument("--tails", default="257,600,333,600")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    spec = M.spec_for(a.model)
    dev = a.device
    m, ms = timed(lambda: M.build(spec, dev, 1234, attention="sdpa"))
    print(
        "build %.0f ms, torch %s, %s" % (ms, torch.__version__, torch.cuda.get_device_name() if dev != "cpu" else "cpu")
    )
    M._register_attention()
    n = a.past
    tails = [int(x) for x in a.tails.split(",")]
    ids = scripted_tokens("probe", 0, n + max(tails) + 8, spec.vocab_size)
    M.forward(m, ids[:512], M.new_cache(m))  # warm-up
    pool = KVPool(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        n + 8192,
        16,
        dev,
        name="kvc-profile",
        use_sglang=False,
    )
    pages = pool.alloc((n + max(tails) + 15) // 16)
    results = {}
    for attn in ("sdpa", M.ATTENTION):
        m.config._attn_implementation = attn
        for i in range(2):
            (_, c), ms = timed(lambda: M.forward(m, ids[:n], M.new_cache(m)))
            print("[%s] prefill %d from scratch (%s): %.1f ms" % (attn, n, "first" if i == 0 else "again", ms))
        if attn == "sdpa":
            ks = [M.cache_kv(c, l, 0, n)[0] for l in range(spec.num_layers)]
            vs = [M.cache_kv(c, l, 0, n)[1] for l in range(spec.num_layers)]
            pool.scatter(pages, 0, ks, vs)
            del ks, vs
        del c
        for tail in tails:
            (k, v), g_ms = timed(pool.gather, pages, 0, n)
            cache, c_ms = timed(M.new_cache, m, k, v)
            del k, v
            (lg, cache), f_ms = timed(M.forward, m, ids[n : n + tail], cache)
            tk = [M.cache_kv(cache, l, n, n + tail)[0] for l in range(spec.num_layers)]
            tv = [M.cache_kv(cache, l, n, n + tail)[1] for l in range(spec.num_layers)]
            _, w_ms = timed(pool.scatter, pages, n, tk, tv)
            del tk, tv
            print(
                "[%s] append %d on %d: gather %.1f ms, to cache %.1f ms, forward %.1f ms, write back %.1f ms"
                % (attn, tail, n, g_ms, c_ms, f_ms, w_ms)
            )
            results[(attn, tail)] = lg
            steps = []
            for j in range(5):
                (_, cache), d_ms = timed(M.forward, m, [ids[n + tail + j]], cache)
                steps.append(d_ms)
            print(
                "[%s] decode step at %d: median %.1f ms (%s)"
                % (attn, n + tail, statistics.median(steps), ", ".join("%.1f" % x for x in steps))
            )
            del cache
        if dev != "cpu":
            from torch.profiler import ProfilerActivity, profile

            k, v = pool.gather(pages, 0, n)
            cache = M.new_cache(m, k, v)
            del k, v
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                M.forward(m, ids[n : n + 411], cache)
                sync()
            print("[%s] profile of an append of 411 on %d (a new shape):" % (attn, n))
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            del cache
    for tail in sorted(set(tails)):
        d = float((results[("sdpa", tail)] - results[(M.ATTENTION, tail)]).abs().max())
        print(
            "append %d: stock sdpa vs kvc attention logits |d| %.3g, argmax %d/%d"
            % (tail, d, int(results[("sdpa", tail)].argmax()), int(results[(M.ATTENTION, tail)].argmax()))
        )
    lf, _ = M.forward(m, ids[: n + tails[0]], M.new_cache(m))
    print(
        "append %d (kvc) vs full prefill: logits |d| %.3g"
        % (tails[0], float((lf - results[(M.ATTENTION, tails[0])]).abs().max()))
    )
    nbytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * (n + 1024)
    if dev == "cpu":
        return
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d1 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d2 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for _ in range(2):  # the second run is the one printed (the first pays for set-up)
        _, h_ms = timed(lambda: d1.copy_(host, non_blocking=True))
        _, d_ms = timed(lambda: d2.copy_(d1))
    print(
        "copy %.2f GB: pinned host->device %.1f ms (%.0f GB/s), device->device %.1f ms (%.0f GB/s)"
        % (nbytes / 1e9, h_ms, nbytes / h_ms / 1e6, d_ms, nbytes / d_ms / 1e6)
    )
    print(
        "memory: allocated %.1f GiB, reserved %.1f GiB"
        % (torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30)
    )
    pool.close()


if __name__ == "__main__":
    main()
