"""Tests of the WorkerBridge client: the wire codec, and real calls against real sidecar
binaries ($KVC_BIN_DIR, or built with `go build` when Go is available)."""

import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvcentric_sglang import (  # noqa: E402
    KV_KIND_K,
    KV_KIND_V,
    TRANSFER_SEED,
    BridgeError,
    KVBuffer,
    WorkerBridge,
    wire,  # noqa: E402
)

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class WireTest(unittest.TestCase):
    def test_roundtrip(self):
        cases = [(1, 0), (2, 1), (3, 300), (4, -1), (5, -(1 << 63)), (6, (1 << 63) - 1)]
        for num, v in cases:
            got = wire.parse(wire.Writer().int(num, v).done()).get(num, 0)
            self.assertEqual(wire.as_int64(got), v, (num, v))

    def test_packed_and_nested(self):
        b = wire.Writer().packed(3, [0, 1, 1 << 40]).msg(4, wire.Writer().str(1, "x")).done()
        f = wire.parse(b)
        self.assertEqual(wire.parse(f[4]), {1: b"x"})
        vals, i = [], 0
        while i < len(f[3]):
            v, i = wire._read_varint(f[3], i)
            vals.append(v)
        self.assertEqual(vals, [0, 1, 1 << 40])

    def test_malformed(self):
        for bad in [b"\x08", b"\x0a\x05ab", b"\x0b", b"\x08" + b"\xff" * 11]:
            with self.assertRaises(ValueError):
                wire.parse(bad)


def _binary(name, module):
    d = os.environ.get("KVC_BIN_DIR")
    if d and os.path.exists(os.path.join(d, name)):
        return os.path.join(d, name)
    if not shutil.which("go"):
        return None
    out = os.path.join(tempfile.mkdtemp(prefix="kvc-py-"), name)
    subprocess.run(
        ["go", "build", "-o", out, "./cmd/" + name],
        cwd=os.path.join(REPO, module),
        check=True,
        env=dict(os.environ, CGO_ENABLED="0", GOTOOLCHAIN=os.environ.get("GOTOOLCHAIN", "go1.27.3")),
    )
    return out


PAGE, LAYERS, TOK = 16, 2, 32
ITEM = PAGE * TOK
PAGES = 64
BUF = ITEM * PAGES  # 32 KiB: a multiple of the OS page size, so every buffer offset maps


class Sidecar:
    def __init__(self, binary, role, wid, tmp):
        self.dir = os.path.join(tmp, wid)
        os.makedirs(self.dir)
        self.sock = os.path.join(self.dir, "bridge.sock")
        ready = os.path.join(self.dir, "ready.json")
        self.proc = subprocess.Popen(
            [
                binary,
                "--worker-id",
                wid,
                "--bridge-socket",
                self.sock,
                "--transport",
                "tcp",
                "--ready-file",
                ready,
                "--insecure",
            ],
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("%s did not start" % wid)
            time.sleep(0.02)
        with open(ready) as f:
            self.ready = json.load(f)
        self.bridge = WorkerBridge(self.sock)
        # the worker's KV pool: one file, 2*LAYERS buffers
        self.pool_path = os.path.join(self.dir, "pool")
        with open(self.pool_path, "wb") as f:
            f.truncate(BUF * 2 * LAYERS)
        self.fd = os.open(self.pool_path, os.O_RDWR)
        self.mem = mmap.mmap(self.fd, BUF * 2 * LAYERS)
        bufs = [
            KVBuffer(
                layer=i // 2,
                kind=KV_KIND_K if i % 2 == 0 else KV_KIND_V,
                size_bytes=BUF,
                shm_path=self.pool_path,
                shm_offset=i * BUF,
            )
            for i in range(2 * LAYERS)
        ]
        self.bpt, self.endpoint = self.bridge.register_kv_pool(PAGE, ITEM, PAGES, LAYERS, bufs, model="test")

    def tokens(self, pages, n):
        """The bytes of tokens [0, n) of every buffer, buffer by buffer."""
        out = bytearray()
        for b in range(2 * LAYERS):
            for t in range(n):
                off = b * BUF + pages[t // PAGE] * ITEM + (t % PAGE) * TOK
                out += self.mem[off : off + TOK]
        return bytes(out)

    def stop(self):
        self.bridge.close()
        self.mem.close()
        os.close(self.fd)
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)


class BridgeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        dec = _binary("kvc-sidecar-decode", "sidecar-decode")
        pre = _binary("kvc-sidecar-prefill", "sidecar-prefill")
        if not dec or not pre:
            raise unittest.SkipTest("sidecar binaries unavailable (set KVC_BIN_DIR or install Go)")
        cls.tmp = tempfile.mkdtemp(prefix="kvc-py-")
        cls.d = Sidecar(dec, "decode", "d0", cls.tmp)
        cls.p = Sidecar(pre, "prefill", "p0", cls.tmp)

    @classmethod
    def tearDownClass(cls):
        cls.d.stop()
        cls.p.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_register(self):
        self.assertEqual(self.d.bpt, 2 * LAYERS * TOK)
        self.assertEqual(self.d.endpoint, self.d.ready["transfer_endpoint"])

    def test_seed_transfer_moves_the_bytes(self):
        n = 60
        ppages, dpages = [0, 1, 2, 3], [10, 12, 14, 16]
        for b in range(2 * LAYERS):  # the prefill worker "computes" its KV
            for pg in ppages:
                off = b * BUF + pg * ITEM
                self.p.mem[off : off + ITEM] = os.urandom(ITEM)
        self.d.bridge.prepare_receive(11, "s-seed", TRANSFER_SEED, dpages, n, self.p.ready["peer_addr"])
        sent = self.p.bridge.send_kv(11, "s-seed", ppages, first_page=0, last=True, tokens=n)
        res = self.d.bridge.wait_receive(11, timeout_s=10)
        self.assertTrue(res.ok, res.error)
        self.assertEqual(res.bytes, n * 2 * LAYERS * TOK)
        self.assertEqual(sent, res.bytes)
        self.assertEqual(self.d.tokens(dpages, n), self.p.tokens(ppages, n))

    def test_sessions_and_errors(self):
        self.assertFalse(self.d.bridge.commit_session("s-1", 40, [20, 21, 22]))  # no snapshot target
        st = self.d.bridge.snapshot_status("s-1")
        self.assertFalse(st.exists)
        with self.assertRaises(BridgeError) as e:
            self.d.bridge.commit_session("s-1", 20, [20, 21])
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(BridgeError) as e:
            self.d.bridge.commit_session("s-1", 48, [20, 21, 99])
        self.assertEqual(e.exception.code, grpc.StatusCode.OUT_OF_RANGE)
        self.assertFalse(self.d.bridge.release_session("s-1"))
        with self.assertRaises(BridgeError) as e:
            self.d.bridge.release_session("s-1")
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(BridgeError) as e:
            self.p.bridge.commit_session("s-1", 16, [0])
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)


if __name__ == "__main__":
    unittest.main()
