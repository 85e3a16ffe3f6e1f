"""GPU check of the plugin's CUDA path (pool.py GPU branch + bridge), no SGLang server needed.

Builds two KV pools on a CUDA device with SGLang's MHATokenToKVPool layout (per layer ONE
allocation holding K_l and V_l as its two halves, page 0 reserved, get_contiguous_buf_infos
order K0..K{L-1},V0..V{L-1}), turns them into RegisterKVPool requests with
kvcentric_sglang.pool.buf_infos_to_register(device=N) (CUDA IPC handle of the whole allocation +
offset), registers them with a real kvc-sidecar-prefill and kvc-sidecar-decode running
--transport cuda, moves a two-chunk seed with aux rows P->D and compares the bytes on the GPU.

    KVC_BIN_DIR=bin python3 integrations/sglang/scripts/gpu_pool_check.py [--tokens 4000]

Prints one JSON line of results; exits 1 on a mismatch.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from kvcentric_sglang import pool as kvpool  # noqa: E402
from kvcentric_sglang.bridge import TRANSFER_SEED, WorkerBridge  # noqa: E402


class Pool:
    """SGLang's MHATokenToKVPool buffers (_create_buffers_normal with equal K/V shapes), or with
    mla=True MLATokenToKVPool's (one (rows, 1, kv_lora_rank + rope) buffer per layer)."""

    def __init__(self, size, page, heads, dim, layers, dev, mla=False):
        self.page, self.mla = page, mla
        rows = size + page
        if mla:
            self.fused = [torch.zeros((rows, 1, 576), dtype=torch.bfloat16, device=dev) for _ in range(layers)]
            self.k, self.v = list(self.fused), []
            self.item = page * 576 * 2
        else:
            self.fused = [torch.zeros((2, rows, heads, dim), dtype=torch.bfloat16, device=dev) for _ in range(layers)]
            self.k = [f[0] for f in self.fused]
            self.v = [f[1] for f in self.fused]
            self.item = page * heads * dim * 2

    def buf_infos(self):
        ts = self.k + self.v
        return [t.data_ptr() for t in ts], [t.numel() * 2 for t in ts], [self.item] * len(ts)

    def tokens(self, pages, n):
        idx = torch.tensor(
            [pages[t // self.page] * self.page + t % self.page for t in range(n)], device=self.k[0].device
        )
        return torch.cat([b[idx].reshape(-1) for b in self.k + self.v])


def start(binary, wid, tmp, dev):
    d = os.path.join(tmp, wid)
    os.makedirs(d)
    ready = os.path.join(d, "ready.json")
    sock = os.path.join(d, "bridge.sock")
    log = open(os.path.join(d, "log"), "wb")
    p = subprocess.Popen(
        [
            binary,
            "--worker-id",
            wid,
            "--bridge-socket",
            sock,
            "--transport",
            "cuda",
            "--gpu-index",
            str(dev),
            "--ready-file",
            ready,
            "--insecure",
            "--worker-health-interval",
            "0",
        ],
        stdout=log,
        stderr=log,
    )
    t = time.monotonic()
    while not os.path.exists(ready):
        if p.poll() is not None or time.monotonic() - t > 60:
            raise RuntimeError("%s did not start: %s" % (wid, open(os.path.join(d, "log")).read()[-3000:]))
        time.sleep(0.05)
    return p, sock, json.load(open(ready)), os.path.join(d, "log")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--mla", action="store_true", help="MLA pools (one KV_KIND_COMBINED buffer per layer, 576 dims)")
    a = ap.parse_args()
    bindir = os.environ.get("KVC_BIN_DIR", "bin")
    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    size = (a.tokens // a.page + 64) * a.page
    P = Pool(size, a.page, a.heads, a.dim, a.layers, dev, a.mla)
    D = Pool(size, a.page, a.heads, a.dim, a.layers, dev, a.mla)
    bpt = a.layers * 576 * 2 if a.mla else a.layers * 2 * a.heads * a.dim * 2
    out = {"tokens": a.tokens, "layers": a.layers, "mla": a.mla, "bytes_per_token": bpt}
    regs = []
    for pool in (P, D):
        ptrs, lens, items = pool.buf_infos()
        reg = kvpool.buf_infos_to_register(
            ptrs,
            lens,
            items,
            a.page,
            device="cuda:%d" % a.device,
            aux_item_lens=[64, 64],
            layout="mla" if a.mla else "mha",
        )
        # K_l and V_l are halves of one allocation: same handle, offsets one span apart
        for l in range(0 if a.mla else a.layers):
            k, v = reg.buffers[2 * l], reg.buffers[2 * l + 1]
            assert k.cuda_ipc_handle == v.cuda_ipc_handle, "K/V of layer %d in different allocations" % l
            assert v.cuda_offset - k.cuda_offset == lens[0], (v.cuda_offset, k.cuda_offset, lens[0])
        regs.append(reg)
    out["distinct_handles"] = len({b.cuda_ipc_handle for b in regs[0].buffers})
    tmp = tempfile.mkdtemp(prefix="kvcgpu-")
    pp, psock, pready, plog = start(os.path.join(bindir, "kvc-sidecar-prefill"), "p0", tmp, a.device)
    dp, dsock, dready, dlog = start(os.path.join(bindir, "kvc-sidecar-decode"), "d0", tmp, a.device)
    try:
        pb, db = WorkerBridge(psock), WorkerBridge(dsock)
        out["register_p"] = regs[0].register(pb)[0]
        out["register_d"] = regs[1].register(db)[0]
        npages = (a.tokens + a.page - 1) // a.page
        g = torch.Generator(device=dev).manual_seed(7)
        ppages = list(range(1, npages + 1))
        dpages = list(range(size // a.page, size // a.page - npages, -1))  # reversed, scattered order
        for f in P.fused:
            f.copy_(torch.randn(f.shape, generator=g, device=dev).to(f.dtype))
        torch.cuda.synchronize()
        aux = [os.urandom(64), os.urandom(64)]
        room = 4242
        half = npages // 2
        import threading

        res = {}

        def send():
            t0 = time.monotonic()
            res["sent1"] = pb.send_kv(room, "s-gpu", ppages[:half], first_page=0)
            res["sent2"] = pb.send_kv(
                room, "s-gpu", ppages[half:], first_page=half, last=True, tokens=a.tokens, aux=aux
            )
            res["send_s"] = time.monotonic() - t0

        th = threading.Thread(target=send)
        th.start()
        db.prepare_receive(room, "s-gpu", TRANSFER_SEED, dpages, a.tokens, pready["peer_addr"])
        t0 = time.monotonic()
        r = db.wait_receive(room, timeout_s=60)
        out["wait_receive_ms"] = round((time.monotonic() - t0) * 1000, 2)
        th.join()
        out.update(ok=r.ok, error=r.error, bytes=r.bytes, duration_us=r.duration_us, aux_ok=r.aux == aux)
        out["bytes_equal"] = bool(torch.equal(P.tokens(ppages, a.tokens), D.tokens(dpages, a.tokens)))
        out["GBps"] = round(r.bytes / max(r.duration_us, 1) / 1e3, 2)
        pb.close()
        db.close()
    finally:
        for p in (pp, dp):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=20)
    print(json.dumps(out))
    if not (out.get("ok") and out.get("bytes_equal") and out.get("aux_ok")):
        print(open(plog).read()[-3000:], file=sys.stderr)
        print(open(dlog).read()[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
