"""Exactness probe of the refworker's model on one device: which comparisons are bitwise, and
how far apart the others are. Prints one line per fact; used to state the tolerance in
README.md. Usage: python tools/probe_exactness.py [--model qwen3-8b-shape] [--device cuda] [--n 16384]"""

import argparse
import os
import sys
import time

here = os.path.dirname(__file__)
sys.path[:0] = [os.path.join(here, ".."), os.path.join(here, "..", "..", "sglang")]

import torch  # noqa: E402

from kvc_refworker import model as M  # noqa: E402
from kvc_refworker.pool import KVPool  # noqa: E402
from kvc_refworker.request import scripted_tokens  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b-shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--tail", type=int, default=256)
    a = ap.parse_args()
    spec = M.spec_for(a.model)
    t0 = time.monotonic()
    m = M.build(spec, a.device, 1234)
    print("build %.1fs" % (time.monotonic() - t0))
    ids = scripted_tokens("probe", 0, a.n + a.tail + 8, spec.vocab_size)
    n = a.n

    def sync():
        if "cuda" in a.device:
            torch.cuda.synchronize()

    def kv(c, end):
        return (
            [M.cache_kv(c, l, 0, end)[0].clone() for l in range(spec.num_layers)],
            [M.cache_kv(c, l, 0, end)[1].clone() for l in range(spec.num_layers)],
        )

    def kvdiff(a_, b_):
        return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a_[0] + a_[1], b_[0] + b_[1]))

    sync()
    t = time.monotonic()
    l1, c1 = M.forward(m, ids[:n], M.new_cache(m))
    sync()
    print("prefill %d tokens: %.1f ms" % (n, (time.monotonic() - t) * 1000))
    kv1 = kv(c1, n)
    junk = torch.empty(12345, device=a.device)  # shift the allocator's state
    l2, c2 = M.forward(m, ids[:n], M.new_cache(m))
    print(
        "prefill twice: logits |d| %.3g, KV |d| %.3g (bitwise: %s)"
        % (float((l1 - l2).abs().max()), kvdiff(kv1, kv(c2, n)), torch.equal(l1, l2))
    )
    del c2, junk
    pool = KVPool(
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        n + 4096,
        16,
        a.device,
        name="kvc-probe",
        use_sglang=False,
    )
    pages = pool.alloc((n + 15) // 16)
    pool.scatter(pages, 0, *kv1)
    k, v = pool.gather(pages, 0, n)
    cp = M.new_cache(m, k, v)
    sync()
    t = time.monotonic()
    dp, _ = M.forward(m, [ids[n]], cp)
    sync()
    print("decode step at %d: %.1f ms" % (n, (time.monotonic() - t) * 1000))
    dr, _ = M.forward(m, [ids[n]], c1)
    print(
        "decode from paged KV vs from the prefill's cache: |d| %.3g (bitwise: %s)"
        % (float((dp - dr).abs().max()), torch.equal(dp, dr))
    )
    # first token computed from [0, n-1) + the last token vs the prefill's
    k1, v1 = pool.gather(pages, 0, n - 1)
    f, _ = M.forward(m, [ids[n - 1]], M.new_cache(m, k1, v1))
    print(
        "first token over [0,n-1) vs prefill: |d| %.3g, argmax %d/%d"
        % (float((f - l1).abs().max()), int(f.argmax()), int(l1.argmax()))
    )
    # append-prefill of a tail vs a full prefill
    for tail in (a.tail // 2 + 3, a.tail // 4 + 1):  # other shapes first: is the time a cold start?
        cw = M.new_cache(m, k, v)
        sync()
        t = time.monotonic()
        M.forward(m, ids[n : n + tail], cw)
        sync()
        print("append-prefill of %d on %d (shape seen first): %.1f ms" % (tail, n, (time.monotonic() - t) * 1000))
        del cw
    ca = M.new_cache(m, k, v)
    sync()
    t = time.monotonic()
    la, ca = M.forward(m, ids[n : n + a.tail], ca)
    sync()
    print("append-prefill of %d on %d: %.1f ms" % (a.tail, n, (time.monotonic() - t) * 1000))
    cw = M.new_cache(m, k, v)
    sync()
    t = time.monotonic()
    M.forward(m, ids[n : n + a.tail], cw)
    sync()
    print("append-prefill of %d on %d again: %.1f ms" % (a.tail, n, (time.monotonic() - t) * 1000))
    del cw
    sync()
    t = time.monotonic()
    M.forward(m, ids[:n], M.new_cache(m))
    sync()
    print("prefill %d tokens again (warm): %.1f ms" % (n, (time.monotonic() - t) * 1000))
    lf, cf = M.forward(m, ids[: n + a.tail], M.new_cache(m))
    print(
        "append-prefill vs full prefill: logits |d| %.3g, argmax %d/%d, tail KV |d| %.3g, logit std %.3g"
        % (
            float((la - lf).abs().max()),
            int(la.argmax()),
            int(lf.argmax()),
            max(
                float(
                    (M.cache_kv(ca, l, n, n + a.tail)[0].float() - M.cache_kv(cf, l, n, n + a.tail)[0].float())
                    .abs()
                    .max()
                )
                for l in range(spec.num_layers)
            ),
            float(lf.float().std()),
        )
    )
    top = torch.topk(lf, 2).values
    print(
        "reference top-2 gap %.3g; KV magnitude max %.3g"
        % (float(top[0] - top[1]), float(kv1[0][-1].float().abs().max()))
    )
    # a wrong KV for scale: the first half of the pages hold another context's KV (a stale or
    # misdirected transfer), and V rolled by one position (K/V pairs torn apart)
    other = scripted_tokens("other", 0, n, spec.vocab_size)
    _, co = M.forward(m, other, M.new_cache(m))
    h = n // 2
    kw = [torch.cat([M.cache_kv(co, l, 0, h)[0], k[l][h:]]) for l in range(spec.num_layers)]
    vw = [torch.cat([M.cache_kv(co, l, 0, h)[1], v[l][h:]]) for l in range(spec.num_layers)]
    lw, _ = M.forward(m, ids[n : n + a.tail], M.new_cache(m, kw, vw))
    print("with half the KV from another context: logits |d| %.3g" % float((lw - lf).abs().max()))
    lw, _ = M.forward(m, ids[n : n + a.tail], M.new_cache(m, k, [x.roll(1, 0) for x in v]))
    print("with V shifted by one position: logits |d| %.3g" % float((lw - lf).abs().max()))
    del co
    pool.close()


if __name__ == "__main__":
    main()
