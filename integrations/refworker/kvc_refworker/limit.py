"""The physical limit of prefill from the snapshot, measured on this device in-process.

For each prefix length: the tail's prefill with the prefix KV already in the paged pool on the
device (the worker's own path: gather the prefix pages into the cache, run the tail, scatter the
tail's KV back, as Worker.serve_prefill does after a load) plus one host-to-device copy of the
prefix KV from page-locked host memory into the pool's pages (per layer buffer, as a snapshot
store in host memory holds it). Their sum is the limit Z a served prefill from the snapshot is
compared with; the whole context's prefill from scratch (the re-prefill) is measured beside it.

    python -m kvc_refworker.limit --model qwen3-8b-shape --device cuda:0 --prefix 16384,32768 --tail 9216

prints one JSON object per prefix length (and with --out writes them as a JSON list):
    {"prefix": P, "tail": T, "tail_prefill_ms": ..., "tail_gather_ms": ..., "tail_forward_ms": ...,
     "tail_scatter_ms": ..., "h2d_ms": ..., "h2d_gbps": ..., "limit_ms": ..., "reprefill_ms": ...,
     "kv_bytes_per_token": ..., "reps": R}
each figure the median of --reps timed repetitions after one warm-up.
"""

import argparse
import json
import statistics
import sys
import time

import torch

from . import model as M
from .pool import KVPool, pages_for


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _ids(n: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _prefill(mdl, pool: KVPool, pages, ids, start: int, end: int, phases=None) -> float:
    """The worker's prefill of ids[start:end] over the KV of [0, start) in pages; seconds. With
    phases (a dict of lists), each phase's seconds are appended there (gather, forward, scatter:
    the worker's served line's phases, each ended with the device idle as there)."""
    dev = pool.device
    _sync(dev)
    t0 = time.monotonic()
    if start:
        k, v = pool.gather(pages, 0, start)
        cache = M.new_cache(mdl, k, v)
    else:
        cache = M.new_cache(mdl)
    _sync(dev)
    tf = time.monotonic()
    _, cache = M.forward(mdl, ids[start:end], cache)
    _sync(dev)
    ts = time.monotonic()
    ks, vs = [], []
    for layer in range(len(pool.k_buffer)):
        kk, vv = M.cache_kv(cache, layer, start, end)
        ks.append(kk)
        vs.append(vv)
    pool.scatter(pages, start, ks, vs)
    _sync(dev)
    del cache
    t1 = time.monotonic()
    if phases is not None:
        for name, dt in (("gather", tf - t0), ("forward", ts - tf), ("scatter", t1 - ts)):
            phases.setdefault(name, []).append(dt)
    return t1 - t0


def _h2d(pool: KVPool, pages, tokens: int, host) -> float:
    """One host-to-device copy of tokens' KV (every layer's K and V) into the pool's pages;
    seconds. The pages are contiguous (a fresh pool), so each buffer's rows are one slice."""
    dev = pool.device
    first = pages[0] * pool.page_size
    _sync(dev)
    t0 = time.monotonic()
    for i, buf in enumerate(pool.k_buffer + pool.v_buffer):
        buf[first : first + tokens].copy_(host[i], non_blocking=True)
    _sync(dev)
    return time.monotonic() - t0


def measure(
    model_name: str, device: str, prefix: int, tail: int, reps: int, page_size: int = 16, mdl=None, seed: int = 1234
) -> dict:
    spec = M.spec_for(model_name)
    mdl = mdl or M.build(spec, device, seed)
    total = prefix + tail
    pool = KVPool(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        total + page_size,
        page_size,
        device,
        use_sglang=False,
    )
    try:
        pages = list(range(1, pages_for(total, page_size) + 1))
        if pages != sorted(pages) or pages[-1] > pool.num_pages:
            raise RuntimeError("pool too small")
        ids = _ids(total, spec.vocab_size, prefix)
        dev = pool.device
        pin = dev.type == "cuda"
        host = [
            torch.empty((prefix, spec.num_kv_heads, spec.head_dim), dtype=spec.dtype, pin_memory=pin)
            for _ in range(2 * spec.num_layers)
        ]
        # The prefix's real KV, computed once (the re-prefill's figure and the warm-up), copied to host.
        reprefill = [_prefill(mdl, pool, pages, ids, 0, total) for _ in range(1 + reps)][1:]
        first = pages[0] * page_size
        for i, buf in enumerate(pool.k_buffer + pool.v_buffer):
            host[i].copy_(buf[first : first + prefix])
        ph = {}
        tail_s = [_prefill(mdl, pool, pages, ids, prefix, total, ph if i else None) for i in range(1 + reps)][1:]
        h2d_s = [_h2d(pool, pages, prefix, host) for _ in range(1 + reps)][1:]
        elsize = torch.empty((), dtype=spec.dtype).element_size()
        per_tok = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elsize
        tp, hd, rp = (statistics.median(x) * 1000.0 for x in (tail_s, h2d_s, reprefill))
        return {
            "model": spec.name,
            "device": str(dev),
            "prefix": prefix,
            "tail": tail,
            "reps": reps,
            "tail_prefill_ms": round(tp, 2),
            "h2d_ms": round(hd, 2),
            **{"tail_%s_ms" % k: round(statistics.median(v) * 1000.0, 2) for k, v in sorted(ph.items())},
            "h2d_gbps": round(prefix * per_tok / (hd / 1000.0) / 1e9, 1) if hd > 0 else None,
            "limit_ms": round(tp + hd, 2),
            "reprefill_ms": round(rp, 2),
            "kv_bytes_per_token": per_tok,
        }
    finally:
        pool.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvc_refworker.limit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b-shape")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--prefix", default="16384,32768", help="comma list of prefix lengths (tokens)")
    ap.add_argument("--tail", type=int, default=9216)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234, help="weight seed (the run's workers')")
    ap.add_argument("--out", default="", help="also write the results here as a JSON list")
    a = ap.parse_args(argv)
    try:
        prefixes = [int(x) for x in a.prefix.split(",") if x.strip()]
    except ValueError:
        ap.error("--prefix: want a comma list of integers, got %r" % a.prefix)
    if not prefixes or min(prefixes) <= 0 or a.tail <= 0 or a.reps <= 0:
        ap.error("--prefix, --tail and --reps must be positive")
    spec = M.spec_for(a.model)
    mdl = M.build(spec, a.device, a.seed)
    res = []
    for p in prefixes:
        r = measure(a.model, a.device, p, a.tail, a.reps, mdl=mdl, seed=a.seed)
        print(json.dumps(r), flush=True)
        res.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
