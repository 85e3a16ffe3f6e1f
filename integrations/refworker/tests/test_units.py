"""Unit tests of the refworker's parts (no sidecar): request parsing, the scripted context, the
pool's SGLang geometry and page round trip, the model's determinism and the exactness facts the
recompute check relies on."""

import os
import sys
import time
import unittest
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "..", "sglang")]

import torch  # noqa: E402

from kvc_refworker import model as M  # noqa: E402
from kvc_refworker import request as R  # noqa: E402
from kvc_refworker.pool import KVPool, pages_for  # noqa: E402


def hints(**payload):
    """A kv_hints envelope with another orchestrator's action and the kvc payload (JSON form)."""
    return {
        "protocol_version": 1,
        "actions": [
            {"action_type": "other", "payload": {"mode": "SEED"}},
            {"action_type": "kvc", "action_version": 2, "payload": payload},
        ],
    }


SEED = {"kind": "TRANSFER_KIND_SEED", "room": "3"}


class TestParse(unittest.TestCase):
    def test_table(self):
        ok = [
            (
                "seed",
                {
                    "session_params": {"id": "s"},
                    "kv_hints": hints(
                        mode="ROUTE_MODE_SEED",
                        session_id="s",
                        input_tokens="10",
                        keep_session=True,
                        open_session=True,
                        receive=SEED,
                    ),
                },
                "decode",
                dict(
                    mode="SEED",
                    input=10,
                    room=3,
                    keep=True,
                    open=True,
                    seed_key="s",
                    ids=None,
                    recv_kind=1,
                    recv_tokens=10,
                ),
            ),
            (
                "direct turn (camelCase names)",
                {
                    "input_ids": [1, 2, 3, 4, 5],
                    "session_params": {"id": "s"},
                    "kv_hints": hints(sessionId="s", cachedTokens=4, keepSession=True),
                },
                "decode",
                dict(mode="", input=5, cached=4, ids=[1, 2, 3, 4, 5], recv_kind=0, transfers=False),
            ),
            (
                "snapshot",
                {
                    "session_params": {"id": "s"},
                    "kv_hints": hints(
                        session_id="s",
                        input_tokens=9,
                        keep_session=True,
                        open_session=True,
                        receive={"kind": "TRANSFER_KIND_SNAPSHOT", "room": 1, "tokens": 8},
                    ),
                },
                "decode",
                dict(recv_kind=2, recv_tokens=8, room=1),
            ),
            (
                "prefill single shot",
                {"rid": "r1", "input_ids": [7, 7], "bootstrap_room": 5, "kv_hints": hints(send={"room": "5"})},
                "prefill",
                dict(keep=False, seed_key="r1", room=5, sends=True),
            ),
            (
                "text only",
                {
                    "text": "x" * 40,
                    "rid": "r",
                    "bootstrap_room": 1,
                    "kv_hints": hints(receive={"kind": "TRANSFER_KIND_SEED", "room": "1"}),
                },
                "decode",
                dict(input=10, local=False, transfers=True),
            ),
            (
                "P's low prefill priority as SGLang's",
                {
                    "rid": "r1",
                    "input_ids": [7, 7],
                    "bootstrap_room": 5,
                    "priority": -100,
                    "kv_hints": hints(send={"room": "5"}),
                },
                "prefill",
                dict(priority=-100),
            ),
            (
                "no priority",
                {
                    "rid": "r1",
                    "input_ids": [7, 7],
                    "bootstrap_room": 5,
                    "priority": None,
                    "kv_hints": hints(send={"room": "5"}),
                },
                "prefill",
                dict(priority=0),
            ),
            (
                "prefill from the snapshot, suffix-only send",
                {
                    "kv_hints": hints(
                        session_id="s",
                        input_tokens=40,
                        load_prefix_tokens="32",
                        load_generation="7",
                        send={"room": "2", "from_token": "32"},
                    )
                },
                "prefill",
                dict(load_prefix=32, load_gen=7, receive_from=32),
            ),
            (
                "local prefill, nothing kept",
                {"rid": "r", "input_ids": [1, 2, 3], "kv_hints": hints(local_prefill=True)},
                "decode",
                dict(local=True, transfers=False, keep=False),
            ),
            (
                "a new session's first turn prefilled here",
                {
                    "rid": "r",
                    "input_ids": [1, 2, 3],
                    "session_params": {"id": "s"},
                    "kv_hints": hints(session_id="s", local_prefill=True, keep_session=True, open_session=True),
                },
                "decode",
                dict(local=True, keep=True, open=True),
            ),
        ]
        for name, body, role, want in ok:
            with self.subTest(name):
                p = R.parse(body, role, 1000, 64)
                for k, v in want.items():
                    self.assertEqual(getattr(p, k), v, k)
        bad = [
            ("batch", [1], "decode", "object"),
            ("no decision", {"input_ids": [1], "rid": "r", "bootstrap_room": 1}, "decode", "no kvcentric decision"),
            (
                "the old kvc block",
                {"kvc": {"mode": "SEED", "input_tokens": 3, "session_id": "s", "room": 1}},
                "decode",
                "no kvcentric decision",
            ),
            (
                "the mode-name payload",
                {
                    "kv_hints": {
                        "protocol_version": 1,
                        "actions": [{"action_type": "kvc", "action_version": 1, "payload": {"mode": "SEED"}}],
                    }
                },
                "decode",
                "action_version",
            ),
            (
                "ids out of vocab",
                {"input_ids": [99], "rid": "r", "kv_hints": hints(local_prefill=True)},
                "decode",
                "vocabulary",
            ),
            (
                "count differs",
                {
                    "input_ids": [1, 2],
                    "session_params": {"id": "s"},
                    "kv_hints": hints(input_tokens=3, session_id="s", keep_session=True, receive=SEED),
                },
                "decode",
                "differs",
            ),
            (
                "wrong role",
                {"kv_hints": hints(role="WORKER_ROLE_PREFILL", input_tokens=3, send={"room": "1"})},
                "decode",
                "PREFILL",
            ),
            (
                "no session",
                {"session_params": {"id": ""}, "kv_hints": hints(input_tokens=3, keep_session=True, receive=SEED)},
                "decode",
                "session_params missing|missing session id",
            ),
            (
                "nothing to serve from",
                {"kv_hints": hints(input_tokens=3, session_id="s")},
                "decode",
                "nothing to serve from",
            ),
            (
                "receive on P",
                {"kv_hints": hints(input_tokens=3, session_id="s", receive=SEED, send={"room": "3"})},
                "prefill",
                "for a decode worker",
            ),
            ("P without a send", {"rid": "r", "input_ids": [1, 2], "kv_hints": hints()}, "prefill", "needs kvc.send"),
            (
                "store seed",
                {"kv_hints": hints(input_tokens=3, session_id="s", send={"room": "1", "store_generation": "2"})},
                "prefill",
                "prefill store",
            ),
            (
                "snapshot longer than the prompt",
                {
                    "session_params": {"id": "s"},
                    "kv_hints": hints(
                        input_tokens=3,
                        session_id="s",
                        keep_session=True,
                        open_session=True,
                        receive={"kind": "TRANSFER_KIND_SNAPSHOT", "room": "1", "tokens": "4"},
                    ),
                },
                "decode",
                "snapshot's length",
            ),
            (
                "capacity",
                {
                    "session_params": {"id": "s"},
                    "kv_hints": hints(input_tokens=990, session_id="s", keep_session=True, receive=SEED),
                },
                "decode",
                "capacity",
            ),
            ("mode", {"kv_hints": hints(mode="WARP")}, "decode", "unknown value"),
            ("unknown field", {"kv_hints": hints(transfer="SEED")}, "decode", "unknown field"),
            (
                "payload",
                {
                    "kv_hints": {
                        "protocol_version": 1,
                        "actions": [{"action_type": "kvc", "action_version": 2, "payload": 3}],
                    }
                },
                "decode",
                "payload",
            ),
            (
                "space in id",
                {
                    "session_params": {"id": "a b"},
                    "kv_hints": hints(input_tokens=3, session_id="a b", keep_session=True, receive=SEED),
                },
                "decode",
                "printable",
            ),
            ("no input", {"kv_hints": hints(local_prefill=True)}, "decode", "no input"),
            (
                "priority not an integer",
                {
                    "rid": "r",
                    "input_ids": [1],
                    "bootstrap_room": 1,
                    "priority": "low",
                    "kv_hints": hints(send={"room": "1"}),
                },
                "prefill",
                "priority",
            ),
            (
                "priority a bool",
                {
                    "rid": "r",
                    "input_ids": [1],
                    "bootstrap_room": 1,
                    "priority": True,
                    "kv_hints": hints(send={"room": "1"}),
                },
                "prefill",
                "priority",
            ),
            (
                "priority beyond int64",
                {
                    "rid": "r",
                    "input_ids": [1],
                    "bootstrap_room": 1,
                    "priority": 1 << 63,
                    "kv_hints": hints(send={"room": "1"}),
                },
                "prefill",
                "priority",
            ),
            (
                "load of the whole prompt",
                {"kv_hints": hints(input_tokens=3, session_id="s", load_prefix_tokens=3, send={"room": "1"})},
                "prefill",
                "load_prefix_tokens",
            ),
            (
                "load without a session",
                {"rid": "r", "input_ids": [1, 2], "kv_hints": hints(load_prefix_tokens=1, send={"room": "1"})},
                "prefill",
                "missing session id",
            ),
            (
                "suffix into a new session",
                {
                    "session_params": {"id": "s"},
                    "kv_hints": hints(
                        input_tokens=9,
                        session_id="s",
                        keep_session=True,
                        open_session=True,
                        receive={"kind": "TRANSFER_KIND_SEED", "room": "1", "from_token": "4"},
                    ),
                },
                "decode",
                "from_token",
            ),
        ]
        for name, body, role, msg in bad:
            with self.subTest(name), self.assertRaisesRegex(R.BadRequest, msg):
                R.parse(body, role, 1000, 64)

    def test_scripted_tokens(self):
        a = R.scripted_tokens("s1", 0, 100, 1024)
        self.assertEqual(a, R.scripted_tokens("s1", 0, 100, 1024))
        self.assertEqual(a[40:60], R.scripted_tokens("s1", 40, 60, 1024))  # any worker, any range
        self.assertNotEqual(a, R.scripted_tokens("s2", 0, 100, 1024))
        self.assertTrue(all(0 <= x < 1024 for x in a))
        self.assertGreater(len(set(a)), 80)


class TestActsOnFields(unittest.TestCase):
    """The decode worker does what the payload's fields say, whatever the mode label: a SEED
    receive into an opened, kept session is a seed under the label DIRECT_TO_D (a mode switch
    served it from a resident session: 409) and PD_FALLBACK (a mode switch kept nothing);
    local_prefill under the label RESEED_SNAPSHOT computes here; no receive serves the held
    session under the label SEED."""

    def test_begin_by_fields(self):
        from kvc_refworker.worker import ApiError, Config, Session, Worker
        from kvcentric_sglang.bridge import TRANSFER_SEED

        spec = M.spec_for("tiny")
        pool = KVPool(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            torch.float32,
            40 * 16,
            16,
            "cpu",
            name="kvc-refworker-unit-fields",
            use_sglang=False,
        )
        try:
            w = Worker(
                Config(role="decode", worker_id="d0", model_name="tiny", prealloc_wait_s=0, snapshot_wait_s=0),
                None,
                spec,
                pool,
                SimpleNamespace(bridge=None),
            )
            calls = []
            w._receive = lambda t, kind, tokens: calls.append(("receive", kind, tokens))
            w._first_from_received = lambda t: calls.append(("first",))
            w._append_prefill = lambda t, start, resident: calls.append(("prefill", start, resident))

            def begin(sid, **payload):
                body = {
                    "input_ids": list(range(1, 41)),
                    "sampling_params": {"max_new_tokens": 8},
                    "kv_hints": hints(session_id=sid, **payload),
                }
                if payload.get("keep_session"):
                    body["session_params"] = {"id": sid}
                calls.clear()
                t = w.begin(R.parse(body, "decode", pool.size, spec.vocab_size))
                if t.unlock:
                    t.unlock()
                w.gpu.leave()
                return t

            seed = dict(keep_session=True, open_session=True, receive={"kind": "TRANSFER_KIND_SEED", "room": "1"})
            for label in ("ROUTE_MODE_DIRECT_TO_D", "ROUTE_MODE_PD_FALLBACK"):
                with self.subTest(label):
                    t = begin("s-" + label, mode=label, **seed)
                    self.assertEqual(calls, [("receive", TRANSFER_SEED, 40), ("first",)])
                    self.assertIs(w.sessions.get("s-" + label), t.s)  # kept: the session is resident here
            t = begin("s-local", mode="ROUTE_MODE_RESEED_SNAPSHOT", local_prefill=True)
            self.assertEqual(calls, [("prefill", 0, False)])
            self.assertIsNone(t.s)  # nothing kept
            w.sessions["s-held"] = Session(
                id="s-held", pages=pool.alloc(3), kv_len=40, committed=True, tokens=list(range(1, 41))
            )
            t = begin("s-held", mode="ROUTE_MODE_SEED", keep_session=True, cached_tokens=40)
            self.assertEqual(calls, [("prefill", 39, True)])  # the held session, its last token recomputed
            self.assertIs(t.s, w.sessions["s-held"])
            with self.assertRaises(ApiError):  # no receive and not held: 409 whatever the label
                begin("s-none", mode="ROUTE_MODE_SEED", keep_session=True)
        finally:
            pool.close()


class TestPool(unittest.TestCase):
    def roundtrip(self, use_sglang):
        pool = KVPool(
            layers=3,
            heads=2,
            head_dim=8,
            dtype=torch.float32,
            capacity_tokens=160,
            page_size=16,
            device="cpu",
            name="kvc-refworker-unit",
            use_sglang=use_sglang,
        )
        try:
            self.assertEqual((pool.num_pages, pool.size, pool.rows), (10, 160, 176))
            self.assertEqual(pool.item_len, 16 * 2 * 8 * 4)
            ptrs, lens, items = pool.buf_infos()  # SGLang's order: K_0..K_2, V_0..V_2
            self.assertEqual(len(ptrs), 6)
            self.assertEqual(ptrs[3] - ptrs[0], pool.buffer_bytes)  # V_0 follows K_0: one allocation per layer
            self.assertEqual(set(lens), {pool.rows * 2 * 8 * 4})
            bufs = pool.bridge_buffers()  # the bridge's order: K_0, V_0, K_1, ...
            self.assertEqual([(b.layer, b.kind) for b in bufs], [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)])
            self.assertEqual(bufs[1].shm_offset - bufs[0].shm_offset, pool.buffer_bytes)
            self.assertTrue(all(b.shm_path == pool.shm_path for b in bufs))
            pages = pool.alloc(3)
            self.assertNotIn(0, pages)  # page 0 is SGLang's padded page
            self.assertIsNone(pool.alloc(8))  # 7 left
            ks = [torch.randn(40, 2, 8) for _ in range(3)]
            vs = [torch.randn(40, 2, 8) for _ in range(3)]
            pool.scatter(pages, 0, ks, vs)
            gk, gv = pool.gather(pages, 0, 40)
            for l in range(3):
                self.assertTrue(torch.equal(gk[l], ks[l]) and torch.equal(gv[l], vs[l]))
            # The bytes are where the sidecar reads them: the page's slot in the shm file.
            raw = open(pool.shm_path, "rb").read()
            off = bufs[2].shm_offset + pages[1] * pool.item_len  # layer 1 K, token 16 = page 1 slot 0
            self.assertEqual(raw[off : off + 64], ks[1][16].numpy().tobytes())
            with self.assertRaises(ValueError):
                pool.locs(pages, 0, 49)
            pool.free(pages)
            self.assertEqual(pool.free_pages, 10)
            return pool.source
        finally:
            pool.close()
            self.assertFalse(os.path.exists(pool.shm_path))

    def test_builtin(self):
        self.assertEqual(self.roundtrip(False), "builtin")

    def test_sglang_pool(self):
        try:
            import sglang.srt.mem_cache.memory_pool  # noqa: F401
        except Exception as e:  # noqa: BLE001
            self.skipTest("sglang not importable here: %s" % e)
        self.assertEqual(self.roundtrip(True), "sglang.MHATokenToKVPool")

    def test_pages_for(self):
        self.assertEqual([pages_for(n, 16) for n in (0, 1, 16, 17)], [0, 1, 1, 2])


class TestModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.spec = M.spec_for("tiny")
        cls.m = M.build(cls.spec, "cpu", 5)

    def test_same_seed_same_weights(self):
        m2 = M.build(self.spec, "cpu", 5)
        m3 = M.build(self.spec, "cpu", 6)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(self.m.parameters(), m2.parameters())))
        self.assertFalse(all(torch.equal(a, b) for a, b in zip(self.m.parameters(), m3.parameters())))

    def test_qwen3_8b_shape_config(self):
        s = M.spec_for("qwen3-8b-shape")
        self.assertEqual(
            (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.dtype),
            (36, 4096, 32, 8, 128, torch.bfloat16),
        )
        with self.assertRaises(ValueError):
            M.spec_for("gpt-5")

    def test_exactness_facts(self):
        """What the recompute check's tolerance rests on: decoding from KV gathered out of pages
        is bitwise decoding from the prefill's own cache; an append-prefill is allclose to a full
        prefill."""
        ids = R.scripted_tokens("x", 0, 45, self.spec.vocab_size)
        full, cache = M.forward(self.m, ids[:37], M.new_cache(self.m))
        pool = KVPool(
            self.spec.num_layers,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            torch.float32,
            256,
            16,
            "cpu",
            name="kvc-refworker-unit2",
            use_sglang=False,
        )
        try:
            pages = pool.alloc(3)
            pool.scatter(pages, 0, *zip(*[M.cache_kv(cache, l, 0, 37) for l in range(self.spec.num_layers)]))
            k, v = pool.gather(pages, 0, 37)
            a, _ = M.forward(self.m, [5], M.new_cache(self.m, k, v))
            b, _ = M.forward(self.m, [5], cache)
            self.assertTrue(torch.equal(a, b))
            app, _ = M.forward(self.m, ids[37:45], M.new_cache(self.m, k, v))
            ref, _ = M.forward(self.m, ids[:45], M.new_cache(self.m))
            self.assertLess(float((app - ref).abs().max()), 1e-4)
            self.assertEqual(int(app.argmax()), int(ref.argmax()))
        finally:
            pool.close()

    def test_kvc_attention_matches_stock(self):
        """The refworker's own attention (fused kernels for every shape; the CUDA default) gives
        what transformers' stock SDPA gives: prefill, append-prefill on a past, decode step."""
        kvc = M.build(self.spec, "cpu", 5, attention="kvc")
        self.assertEqual(kvc.config._attn_implementation, M.ATTENTION)
        self.assertEqual(self.m.config._attn_implementation, "sdpa")
        ids = R.scripted_tokens("att", 0, 90, self.spec.vocab_size)
        ca, cb = M.new_cache(self.m), M.new_cache(kvc)
        for lo, hi in ((0, 60), (60, 77), (77, 78), (78, 90)):  # prefill, append, decode, append
            a, ca = M.forward(self.m, ids[lo:hi], ca, all_logits=True)
            b, cb = M.forward(kvc, ids[lo:hi], cb, all_logits=True)
            self.assertLess(float((a - b).abs().max()), 1e-4, "tokens [%d, %d)" % (lo, hi))
            self.assertTrue(torch.equal(a.argmax(-1), b.argmax(-1)))
        with self.assertRaises(ValueError):
            M.attention_for("cpu", "flash")
        self.assertEqual(M.attention_for("cuda:1"), "kvc")
        self.assertEqual(M.attention_for("cpu"), "sdpa")


class TestEviction(unittest.TestCase):
    def test_passes_over_sessions_whose_snapshot_push_is_pending(self):
        """Eviction takes the least recently used idle session whose snapshot holds all its KV;
        one whose D->P push is not done is taken only after snapshot_wait_s (evicting it would
        abort the push and make its next turn a re-prefill)."""
        from types import SimpleNamespace

        from kvc_refworker.worker import Config, Session, Worker

        spec = M.spec_for("tiny")
        pushed = {"old": 0, "new": 160}  # "old" (least recently used) has its push pending

        class Bridge:
            calls = 0

            def snapshot_status(self, sid):
                Bridge.calls += 1
                return SimpleNamespace(prefill_worker="p0", last_pushed_len=pushed[sid])

        class Xfer:
            bridge = Bridge()
            released = []

            def release(self, sid, evicted):
                self.released.append((sid, evicted))

        def evict(wait):
            pool = KVPool(
                spec.num_layers,
                spec.num_kv_heads,
                spec.head_dim,
                torch.float32,
                30 * 16,
                16,
                "cpu",
                name="kvc-refworker-unit-evict",
                use_sglang=False,
            )
            try:
                xfer = Xfer()
                xfer.released = []
                w = Worker(
                    Config(role="decode", worker_id="d0", model_name="tiny", prealloc_wait_s=10, snapshot_wait_s=wait),
                    None,
                    spec,
                    pool,
                    xfer,
                )
                for i, sid in enumerate(("old", "new")):
                    w.sessions[sid] = Session(
                        id=sid, pages=pool.alloc(10), kv_len=160, committed=True, last_used=float(i)
                    )
                pages, evicted = w.allocate(15, "x")
                self.assertEqual((len(pages), evicted), (15, 1))
                return xfer.released
            finally:
                pool.close()

        self.assertEqual(evict(5.0), [("new", True)])
        self.assertEqual(evict(0.0), [("old", True)])  # no wait: least recently used
        pushed["old"] = 160  # once its push is done, it is the first victim again
        self.assertEqual(evict(5.0), [("old", True)])

    def test_evicts_without_its_sidecar(self):
        """With the sidecar gone (ReleaseSession UNAVAILABLE) an eviction frees the victim's
        pages and the allocation succeeds; a sidecar that fails otherwise gets them quarantined
        (issue 23 item 1)."""
        from kvc_refworker.worker import Config, Session, Worker
        from kvcentric_sglang.bridge import BridgeError

        spec = M.spec_for("tiny")

        def evict(code):
            class Xfer:
                bridge = None

                def release(self, sid, evicted):
                    raise BridgeError("ReleaseSession", code, "connection refused")

            pool = KVPool(
                spec.num_layers,
                spec.num_kv_heads,
                spec.head_dim,
                torch.float32,
                20 * 16,
                16,
                "cpu",
                name="kvc-refworker-unit-nosidecar",
                use_sglang=False,
            )
            try:
                w = Worker(
                    Config(role="decode", worker_id="d0", model_name="tiny", prealloc_wait_s=0, snapshot_wait_s=0),
                    None,
                    spec,
                    pool,
                    Xfer(),
                )
                w.sessions["a"] = Session(id="a", pages=pool.alloc(10), kv_len=160, committed=True, last_used=0.0)
                try:
                    pages, _ = w.allocate(15, "x")
                    got = len(pages)
                except Exception as e:  # noqa: BLE001 - the 503 of a full pool
                    got = getattr(e, "code", str(e))
                return got, pool.free_pages, w.stats["releases_without_sidecar"]
            finally:
                pool.close()

        self.assertEqual(evict("StatusCode.UNAVAILABLE"), (15, 5, 1))
        self.assertEqual(evict("StatusCode.INTERNAL"), ("no_capacity", 10, 0))

    def test_reports_running_requests(self):
        """A decode worker's served requests that hold their pages reach its sidecar as
        running_requests (ReportDemand; before, the refworker sent none and the sidecar's load
        report said 0): one waiting in allocate for pages does not run until it has them."""
        import threading

        from kvc_refworker.worker import Config, Session, Worker
        from kvcentric_sglang.demand import DemandReporter

        spec = M.spec_for("tiny")

        class Bridge:
            def __init__(self):
                self.reports = []

            def report_demand(self, *d, timeout_s=None):
                self.reports.append(d)

        pool = KVPool(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            torch.float32,
            20 * 16,
            16,
            "cpu",
            name="kvc-refworker-unit-running",
            use_sglang=False,
        )
        try:
            b = Bridge()
            w = Worker(
                Config(role="decode", worker_id="d0", model_name="tiny", prealloc_wait_s=30, snapshot_wait_s=0),
                None,
                spec,
                pool,
                SimpleNamespace(bridge=None),
            )
            w.demand = DemandReporter(b)
            held = Session(id="a", pages=pool.alloc(20), kv_len=320, committed=True, last_used=0.0)
            held.pinned = 1  # in use: no eviction makes room
            w.sessions["a"] = held
            w.gpu.enter()  # a served request (begin .. last token)
            w._report_running()
            self.assertTrue(w.demand.flush())
            self.assertEqual(b.reports[-1][4], 1)
            w.gpu.enter()  # a second one, that waits for pages
            got = {}
            t = threading.Thread(target=lambda: got.update(r=w.allocate(4, "x")))
            t.start()
            deadline = time.monotonic() + 10
            while w.running_requests() != 1 or w._allocating != 1:
                self.assertLess(time.monotonic(), deadline, "the allocation never waited")
                time.sleep(0.001)
            self.assertTrue(w.demand.flush())
            self.assertEqual(b.reports[-1][4], 1)  # the waiting one does not run
            with w.mu:
                pool.free(held.pages[:4])
                held.pages = held.pages[4:]
                w.mu.notify_all()
            t.join(10)
            self.assertEqual(len(got["r"][0]), 4)
            self.assertTrue(w.demand.flush())
            self.assertEqual(b.reports[-1][4], 2)  # it has its pages: both run
            w.gpu.leave()
            w.gpu.leave()
            w._report_running()
            self.assertTrue(w.demand.flush())
            self.assertEqual(b.reports[-1][4], 0)
            self.assertTrue(all(r[4] <= 2 for r in b.reports), b.reports)
            w.demand.close()
        finally:
            pool.close()


class TestCapacityRelease(unittest.TestCase):
    def test_waiting_turns_session_goes_only_when_no_other_is_idle(self):
        """The sidecar's capacity release of a session whose direct turn waits for pages
        (issue 20): refused while another committed session no turn uses could go (here one
        the worker's own eviction passes over, its snapshot push pending), leaving the session,
        its pages and the waiting turn as they were; once no other session is idle it goes, and
        the waiting turn answers 409 (re-decided) instead of waiting out the prealloc wait. A
        running turn's session is refused whatever the reason."""
        import threading

        from kvc_refworker.worker import ApiError, Config, Session, Worker
        from kvcentric_sglang.bridge import REASON_CONTROL_PLANE

        spec = M.spec_for("tiny")

        class Xfer:
            released = []

            class bridge:  # the idle session's D->P push is pending: allocate passes over it
                @staticmethod
                def snapshot_status(sid):
                    return SimpleNamespace(prefill_worker="p0", last_pushed_len=0 if sid == "idle" else 160)

            def release(self, sid, evicted):
                self.released.append((sid, evicted))

        pool = KVPool(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            torch.float32,
            30 * 16,
            16,
            "cpu",
            name="kvc-refworker-unit-release",
            use_sglang=False,
        )
        xfer = Xfer()
        try:
            w = Worker(
                Config(role="decode", worker_id="d0", model_name="tiny", prealloc_wait_s=60, snapshot_wait_s=60),
                None,
                spec,
                pool,
                xfer,
            )
            w._append_prefill = lambda t, start, resident: None
            held = list(range(1, 161))
            for sid in ("w", "idle"):
                w.sessions[sid] = Session(id=sid, pages=pool.alloc(10), kv_len=160, committed=True, tokens=list(held))
            ws = w.sessions["w"]
            w_pages = list(ws.pages)
            waiting = threading.Event()
            alloc = w.allocate

            def allocate(n, for_session, contiguous=False):
                waiting.set()  # Session.waiting is counted before allocate is entered
                return alloc(n, for_session, contiguous)

            w.allocate = allocate
            # a direct turn of w: 360 tokens + 8 out = 23 pages, 13 more than it holds, 10 free
            body = {
                "input_ids": held + list(range(200, 400)),
                "sampling_params": {"max_new_tokens": 8},
                "session_params": {"id": "w"},
                "kv_hints": hints(session_id="w", mode="ROUTE_MODE_DIRECT_TO_D", keep_session=True, cached_tokens=160),
            }
            got = {}

            def turn():
                try:
                    got["turn"] = w.begin(R.parse(body, "decode", pool.size, spec.vocab_size))
                except ApiError as e:
                    got["error"] = e

            th = threading.Thread(target=turn)
            th.start()
            self.assertTrue(waiting.wait(30))
            self.assertEqual((ws.pinned, ws.waiting), (1, 1))
            with self.assertRaisesRegex(RuntimeError, "waiting for pages.*1 idle session.*idle"):
                w.release_for_capacity("w")
            self.assertIs(w.sessions.get("w"), ws)
            self.assertEqual((ws.pages, ws.gone, pool.free_pages, xfer.released), (w_pages, False, 10, []))
            self.assertTrue(th.is_alive())  # still waiting for its pages
            # the idle one gets a turn of its own: no other session is idle now
            with w.mu:
                w.sessions["idle"].pinned = 1
            with self.assertRaisesRegex(RuntimeError, "in use by 1 running turn"):
                w.release_for_capacity("idle", REASON_CONTROL_PLANE)
            self.assertEqual(w.release_for_capacity("w"), 160)
            th.join(30)
            self.assertFalse(th.is_alive())
            self.assertEqual(xfer.released, [("w", True)])
            self.assertNotIn("w", w.sessions)
            e = got.get("error")
            self.assertIsNotNone(e, got)
            self.assertEqual((e.status, e.code), (409, "session_not_resident"))
            self.assertEqual(pool.free_pages, 20)  # w's pages and the turn's came back; idle's are held
            self.assertEqual(ws.pinned, 0)
        finally:
            pool.close()


def _start_check(lk):
    """A recompute check's forward on another thread: (set once it got the device, the thread)."""
    import threading

    got = threading.Event()

    def low():
        lk.acquire(low=True)
        got.set()
        lk.release()

    th = threading.Thread(target=low)
    th.start()
    return got, th


class TestGpuLock(unittest.TestCase):
    def test_waits_for_other_processes_on_the_device(self):
        """A recompute check waits while another worker process sharing the GPU serves a
        request (its count file says so), and runs once that process is idle."""
        import tempfile

        from kvc_refworker.worker import DeviceActivity, GpuLock

        with tempfile.TemporaryDirectory() as d:
            other = os.path.join(d, str(os.getppid()))  # a live process other than this one
            with open(other, "w") as f:
                f.write("1")
            with open(os.path.join(d, "999999999"), "w") as f:  # a process that is gone: idle
                f.write("3")
            act = DeviceActivity(d)
            lk = GpuLock(max_defer_s=5, shared=act)
            got, th = _start_check(lk)
            self.assertFalse(got.wait(0.3))
            lk.enter()  # this process's own count is published too
            with open(act.path) as f:
                self.assertEqual(f.read(), "1")
            lk.leave()
            self.assertFalse(got.is_set())  # the other process still serves
            with open(other, "w") as f:
                f.write("0")
            self.assertTrue(got.wait(5))
            th.join()
            act.close()
            self.assertFalse(os.path.exists(act.path))

    def test_served_requests_first(self):
        from kvc_refworker.worker import GpuLock

        lk = GpuLock(max_defer_s=5)
        lk.enter()  # a served request in flight
        got, th = _start_check(lk)
        self.assertFalse(got.wait(0.3))  # the check waits while the request is in flight
        lk.acquire()  # the request's own forwards go first
        lk.release()
        self.assertFalse(got.is_set())
        lk.leave()  # request done: the check runs
        self.assertTrue(got.wait(5))
        th.join()

    def test_defer_is_bounded(self):
        from kvc_refworker.worker import GpuLock

        lk = GpuLock(max_defer_s=0.2)
        lk.enter()
        t0 = time.monotonic()
        lk.acquire(low=True)  # a busy worker does not starve its checks forever
        lk.release()
        self.assertLess(time.monotonic() - t0, 3)
        # a check's forwards share one deadline: the later ones do not each defer anew
        lk = GpuLock(max_defer_s=600)
        lk.enter()
        t0 = time.monotonic()
        until = t0 + 0.2
        for _ in range(3):
            lk.acquire(low=True, defer_until=until)
            lk.release()
        self.assertLess(time.monotonic() - t0, 3)


class TestIpcHandle(unittest.TestCase):
    def test_formats(self):
        from kvc_refworker.pool import ipc_handle_bytes

        h = bytes(range(64))
        self.assertEqual(ipc_handle_bytes(h), h)
        self.assertEqual(ipc_handle_bytes(b"\x02c" + h), h)  # torch 2.11's serialized form (measured on the H200)
        with self.assertRaisesRegex(RuntimeError, "expandable"):
            ipc_handle_bytes(b"\x02e" + h + b"more")
        with self.assertRaisesRegex(RuntimeError, "unknown"):
            ipc_handle_bytes(b"\x00" * 10)


if __name__ == "__main__":
    unittest.main()


class TestFirstTokenFromP(unittest.TestCase):
    """P's first token travels with the KV (SendKV's aux rows on the plain bridge path, as on the
    plugin's) and the decode worker emits it before it gathers the session into a dense cache."""

    def test_bridge_transport_carries_the_first_token(self):
        from kvc_refworker.transport import AUX_ITEM, BridgeTransport
        from kvcentric_sglang.bridge import TRANSFER_SEED, TRANSFER_SNAPSHOT, TransferResult

        sent = {}

        class FakeBridge:
            def register_kv_pool(self, *a, **kw):
                sent["aux_item_lens"] = list(kw.get("aux_item_lens", ()))
                return 1, "ep"

            def send_kv(self, room, sid, pages, **kw):
                sent["aux"] = list(kw.get("aux", ()))
                return 123

            def prepare_receive(self, *a):
                pass

            def wait_receive(self, room, timeout_s=0):
                return TransferResult(ok=True, bytes=10, tokens=40, error="", duration_us=5, aux=sent.get("aux", []))

        pool = SimpleNamespace(page_size=16, item_len=64, rows=48, layers=1, bridge_buffers=lambda: [])
        x = BridgeTransport(FakeBridge(), pool, "tiny", 5.0)
        self.assertEqual(sent["aux_item_lens"], [AUX_ITEM, AUX_ITEM])
        self.assertEqual(x.send(1, "s", [1, 2, 3], 40, 517, -2.5), 123)
        self.assertEqual([len(r) for r in sent["aux"]], [AUX_ITEM, AUX_ITEM])
        r = x.receive(1, "s", TRANSFER_SEED, [1, 2, 3], 40, "peer")
        self.assertEqual((r.first_token, r.first_logit), (517, -2.5))
        r = x.receive(1, "s", TRANSFER_SNAPSHOT, [1, 2, 3], 40, "peer")  # a snapshot carries no first token
        self.assertIsNone(r.first_token)
        sent["aux"] = []  # a sender without aux rows: the decode worker computes the token itself
        self.assertIsNone(x.receive(1, "s", TRANSFER_SEED, [1, 2, 3], 40, "peer").first_token)

    def test_decode_emits_p_token_before_gathering(self):
        from kvc_refworker.transport import Received
        from kvc_refworker.worker import Config, Worker

        spec = M.spec_for("tiny")
        mdl = M.build(spec, "cpu", 1)
        pool = KVPool(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            torch.float32,
            40 * 16,
            16,
            "cpu",
            name="kvc-refworker-unit-aux",
            use_sglang=False,
        )
        try:
            xfer = SimpleNamespace(
                bridge=None,
                commit=lambda *a: None,
                release=lambda *a, **k: None,
                receive=lambda *a: Received(bytes=1, wall_s=0.0, first_token=77, first_logit=1.5),
            )
            w = Worker(
                Config(role="decode", worker_id="d0", model_name="tiny", prealloc_wait_s=0, snapshot_wait_s=0),
                mdl,
                spec,
                pool,
                xfer,
            )
            events = []
            gather = w._cache_from_pool
            w._cache_from_pool = lambda pages, end: (events.append(("gather", end)), gather(pages, end))[1]
            body = {
                "input_ids": list(range(1, 41)),
                "sampling_params": {"max_new_tokens": 3},
                "session_params": {"id": "s1"},
                "kv_hints": hints(session_id="s1", keep_session=True, open_session=True, receive=SEED),
            }
            t = w.begin(R.parse(body, "decode", pool.size, spec.vocab_size))
            self.assertEqual(t.meta["first_token_source"], "aux")
            self.assertEqual(events, [])  # nothing computed nor gathered before the first token
            w.decode_steps(t, lambda i, tok: events.append(("emit", i, tok)))
            self.assertEqual(events[:2], [("emit", 0, 77), ("gather", 40)])
            self.assertEqual([e[1] for e in events if e[0] == "emit"], [0, 1, 2])
            self.assertIsNone(t.cache)  # the dense cache is dropped after the last step
            self.assertIn("first_step_ms", t.meta)
            w.finish(t, ok=True)
        finally:
            pool.close()


class TestContiguousPages(unittest.TestCase):
    def test_alloc_gather_scatter(self):
        pool = KVPool(
            layers=2,
            heads=2,
            head_dim=8,
            dtype=torch.float32,
            capacity_tokens=40 * 16,
            page_size=16,
            device="cpu",
            name="kvc-refworker-unit-contig",
            use_sglang=False,
            seed=3,
        )
        try:
            frag = pool.alloc(6)  # the shuffled free list: not one run
            self.assertIsNone(pool.contiguous_slots(frag, 0, 96))
            pages = pool.alloc_contiguous(10)
            self.assertEqual(pages, list(range(pages[0], pages[0] + 10)))
            self.assertEqual(pool.free_pages, 40 - 16)
            self.assertFalse(set(pages) & set(frag))
            self.assertEqual(pool.contiguous_slots(pages, 5, 150), pages[0] * 16 + 5)
            self.assertIsNone(pool.alloc_contiguous(100))
            for pg in (pages, frag):
                n = len(pg) * 16 - 3
                ks = [torch.randn(n - 7, 2, 8) for _ in range(2)]
                vs = [torch.randn(n - 7, 2, 8) for _ in range(2)]
                pool.scatter(pg, 7, ks, vs)
                gk, gv = pool.gather(pg, 7, n)
                lk, lv = pool.gather(pg, 7, n, layer=1)
                for l in range(2):
                    self.assertTrue(torch.equal(gk[l], ks[l]) and torch.equal(gv[l], vs[l]))
                self.assertTrue(torch.equal(lk[0], ks[1]) and torch.equal(lv[0], vs[1]))
            pool.free(pages)
            pool.free(frag)
            self.assertEqual(sorted(pool.alloc_contiguous(40)), list(range(1, 41)))
        finally:
            pool.close()


class TestLimit(unittest.TestCase):
    def test_measure_reports_the_worker_phases(self):
        from kvc_refworker import limit

        r = limit.measure("tiny", "cpu", 64, 32, 1)
        self.assertEqual((r["prefix"], r["tail"]), (64, 32))
        for k in ("tail_gather_ms", "tail_forward_ms", "tail_scatter_ms"):
            self.assertGreaterEqual(r[k], 0.0)
        # one repetition: the phases add up to the tail's prefill (rounding aside)
        self.assertAlmostEqual(
            r["tail_gather_ms"] + r["tail_forward_ms"] + r["tail_scatter_ms"], r["tail_prefill_ms"], delta=0.05
        )
        self.assertAlmostEqual(r["limit_ms"], r["tail_prefill_ms"] + r["h2d_ms"], delta=0.02)
