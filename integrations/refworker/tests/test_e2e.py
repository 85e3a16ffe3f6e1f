"""End to end on CPU: kvc-local with kvc-refworkers (tiny model, tcp transport, 1 prefill + 2
decode, the control-plane HA pair on etcd, the gateway), a few sessions driven through the
gateway that cover every decision mode - SEED, DIRECT_TO_D, PD_FALLBACK (a real large append
kept on the session's own decode worker), RESEED_SNAPSHOT and
RESEED_PREFILL after evictions - with real attention KV moved by the real sidecars, and every
request recomputed from scratch in its worker: 0 mismatches.

Run: KVC_BIN_DIR=$PWD/bin <venv>/bin/python -m pytest -q integrations/refworker/tests (after
make build; the venv of integrations/sglang/scripts/make-venv.sh has torch, transformers and
sglang). Keep the cluster's logs with KVC_REFWORKER_IT_WORKDIR=DIR. KVC_REFWORKER_IT_API=bridge runs the
workers on the plain WorkerBridge path (the GPU machine's, without sglang) instead of the
plugin's backend classes.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
BIN = os.environ.get("KVC_BIN_DIR") or os.path.join(ROOT, "bin")
VOCAB = 1024  # the tiny model's


def post(url, body, headers=None, timeout=120):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers=dict({"Content-Type": "application/json"}, **(headers or {})),
    )
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode(), [], None
    chunks, out_ids, err = [], [], None
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        c = json.loads(data)
        if c.get("error"):
            err = c["error"]
        chunks.append(c)
        out_ids += c.get("output_ids") or []
    return resp.status, dict(resp.headers), chunks, out_ids, err


class Cluster:
    def __init__(self, work, policy, capacity):
        self.work = work
        self.ready = os.path.join(work, "local.ready.json")
        if os.path.exists(self.ready):
            os.remove(self.ready)  # a kept work dir's old one
        args = [
            os.path.join(BIN, "kvc-local"),
            "--bin-dir",
            BIN,
            "--work-dir",
            work,
            "--worker-kind",
            "refworker",
            "--refworker-python",
            sys.executable,
            "--prefill",
            "1",
            "--decode",
            "2",
            "--decode-capacity-tokens",
            str(capacity),
            "--prefill-capacity-tokens",
            "8192",
            "--policy-json",
            json.dumps(policy),
            "--ready-file",
            self.ready,
            "--refworker-args",
            "--verify-recompute --page-size 16 --transfer-api " + os.environ.get("KVC_REFWORKER_IT_API", "auto"),
        ]
        self.log = open(os.path.join(work, "kvc-local.log"), "w")
        env = dict(os.environ, KVC_REFWORKER_THREADS="1")
        self.p = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 240
        while not os.path.exists(self.ready):
            if self.p.poll() is not None or time.time() > deadline:
                self.stop()
                logged = open(os.path.join(work, "kvc-local.log")).read()
                raise RuntimeError("kvc-local did not come up:\n" + logged[-4000:])
            time.sleep(0.5)
        self.info = json.load(open(self.ready))
        self.gateway = self.info["gateway_url"]

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


@unittest.skipUnless(os.path.exists(os.path.join(BIN, "kvc-local")), "no %s/kvc-local: run make build" % BIN)
class TestEveryModeExact(unittest.TestCase):
    def test_every_mode_zero_mismatches(self):
        keep = os.environ.get("KVC_REFWORKER_IT_WORKDIR")
        work = keep or tempfile.mkdtemp(prefix="kvc-refworker-it-")
        os.makedirs(work, exist_ok=True)
        # Small decode pools (evictions), snapshots pushed every 16 tokens, appends over 300
        # tokens are real large appends, and a snapshot serves a reseed only when the tail is at
        # most 200 tokens (so a larger append of an evicted session re-prefills).
        # Appends of 301-320 new tokens are prefilled by the session's own decode worker
        # (LOCAL_LARGE_APPEND), larger ones by P (REAL_LARGE_APPEND, from the snapshot).
        policy = {
            "snapshotDeltaTokens": "16",
            "directMaxUncachedTokens": "300",
            "tailToleranceTokens": "200",
            "localAppendMaxTokens": "320",
        }
        c = Cluster(work, policy, capacity=1536)
        rng = random.Random(7)
        hist = {}  # session -> token ids the client holds (prompt + answers), as an agent would
        results = []

        tag = "%x-" % (int(time.time()) & 0xFFFFFF)  # a kept work dir's etcd remembers older runs' sessions

        def turn(sess, append, max_new=6, ids=True):
            sess = tag + sess
            if ids:
                hist[sess] = hist.get(sess, []) + [rng.randrange(VOCAB) for _ in range(append)]
                body = {"input_ids": hist[sess]}
            else:  # counts only: the workers derive the same scripted context
                n = hist.get(sess, 0) + append
                hist[sess] = n
                body = {"kvc": {"input_tokens": n}}
            body.update(stream=True, sampling_params={"max_new_tokens": max_new})
            hdr = {"X-Session-ID": sess} if sess else {}
            if sess:
                body["session_params"] = {"id": sess}
            st, h, chunks, out_ids, err = post(c.gateway + "/generate", body, hdr)
            self.assertEqual(st, 200, "%s: %s %s" % (sess, st, chunks))
            self.assertIsNone(err, "%s: %s" % (sess, err))
            meta = chunks[-1]["meta_info"]["kvc"]
            mode, reason = h.get("X-Kvc-Mode"), h.get("X-Kvc-Reason")
            results.append((sess, mode, reason, meta))
            self.assertEqual(len(out_ids), max_new)
            if ids and sess:
                hist[sess] += out_ids
            elif sess:
                hist[sess] += max_new
            print(
                "%-8s %-16s %-22s on %-9s kv %5d recv %7d B  mism %d  max|dlogit| %.2g  max|dKV| %.2g  "
                "bitwise %d/%d"
                % (
                    sess or "-",
                    mode,
                    reason,
                    meta.get("worker_id"),
                    meta.get("kv_len_after", 0),
                    meta.get("received_bytes", 0),
                    meta.get("recompute_mismatches", -1),
                    meta.get("max_abs_logit_diff", -1),
                    meta.get("max_abs_kv_diff", -1),
                    meta.get("bitwise_steps", 0),
                    meta.get("recompute_steps", 0),
                ),
                flush=True,
            )
            return mode, reason, meta

        try:
            m, _, meta = turn("a", 300)
            self.assertEqual(m, "SEED")
            self.assertGreater(meta["received_bytes"], 0)
            self.assertTrue(meta["bitwise_expected"])
            self.assertEqual(meta["max_abs_kv_diff"], 0.0)  # P's KV, received: bitwise a local prefill's
            self.assertEqual(meta["first_token_source"], "aux")  # P's first token, on either transfer path
            m, _, _ = turn("a", 40)
            self.assertEqual(m, "DIRECT_TO_D")
            m, r, meta = turn("a", 350)  # over the direct limit: plain P/D kept on a's own D
            self.assertEqual((m, r), ("PD_FALLBACK", "REAL_LARGE_APPEND"))
            # D keeps the 352 tokens it holds and receives only the suffix (receive_from); P
            # loads a's snapshot from its store when the control plane has heard of it
            self.assertEqual(meta.get("received_from"), 352, meta)
            self.assertEqual(meta["received_bytes"] % (702 - 352), 0, meta)
            m, _, _ = turn("a", 20)
            self.assertEqual(m, "DIRECT_TO_D")
            m, _, _ = turn("s", 200, ids=False)  # counts only
            self.assertEqual(m, "SEED")
            m, _, _ = turn("s", 30, ids=False)
            self.assertEqual(m, "DIRECT_TO_D")
            # a large append within localAppendMaxTokens: the session's own decode worker prefills
            # it on its resident KV (a colocated server's streaming-session append), no transfer
            m, _, _ = turn("l", 250)
            self.assertEqual(m, "SEED")
            m, r, meta = turn("l", 310)
            self.assertEqual((m, r), ("DIRECT_TO_D", "LOCAL_LARGE_APPEND"))
            self.assertEqual(meta.get("received_bytes", 0), 0, meta)
            # Five sessions of ~500-600 tokens over two 1,536-token decode pools: decode workers evict
            # (ReleaseSession EVICTED, then free) and evicted sessions come back by reseed. An
            # evicted session's next turn appends 40 tokens (within the tail tolerance: its
            # snapshot serves) or 260 (beyond it: re-prefill), whichever reseed mode is still
            # missing.
            decode_urls = [w["worker_url"] for w in c.info["workers"] if w["role"] == "decode"]

            def resident():
                out = set()
                for u in decode_urls:
                    with urllib.request.urlopen(u + "/kvc/sessions", timeout=10) as r:
                        out |= {x["session_id"] for x in json.load(r)["sessions"]}
                return out

            for i in range(5):
                turn("ev-%d" % i, 480 + 20 * i)
            for rnd in range(4):
                seen = {m for _, m, _, _ in results}
                if {"RESEED_SNAPSHOT", "RESEED_PREFILL"} <= seen and rnd >= 2:
                    break
                for i in range(5):
                    sess = "ev-%d" % i
                    gone = tag + sess not in resident()
                    seen = {m for _, m, _, _ in results}
                    big = gone and "RESEED_SNAPSHOT" in seen and "RESEED_PREFILL" not in seen
                    turn(sess, 260 if big else 40)
            # The gateway's fail-open (no usable decision, or no prefill worker) sends a decode
            # worker alone a payload with local_prefill and no receive: it prefills the whole
            # prompt itself, as a colocated SGLang worker does, and the recompute check holds.
            st, _, chunks, out_ids, err = post(
                decode_urls[0] + "/generate",
                {
                    "rid": tag + "fail-open",
                    "input_ids": [rng.randrange(VOCAB) for _ in range(200)],
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 4},
                    "kv_hints": {
                        "protocol_version": 1,
                        "actions": [
                            {
                                "action_type": "kvc",
                                "action_version": 2,
                                "payload": {
                                    "mode": "ROUTE_MODE_PD_FALLBACK",
                                    "role": "WORKER_ROLE_DECODE",
                                    "local_prefill": True,
                                },
                            }
                        ],
                    },
                },
            )
            self.assertEqual((st, err), (200, None), chunks)
            fo = chunks[-1]["meta_info"]["kvc"]
            self.assertTrue(fo.get("local_prefill"), fo)
            self.assertEqual((fo["prefill_tokens"], fo["received_bytes"], len(out_ids)), (200, 0, 4))
            self.assertTrue(fo["recompute_checked"])
            self.assertEqual(fo["recompute_mismatches"], 0, fo)
        finally:
            c.stop()
        modes = {m for _, m, _, _ in results}
        evictions = sum(meta.get("evicted_sessions", 0) for *_, meta in results)
        mism = sum(meta.get("recompute_mismatches", 0) for *_, meta in results)
        unchecked = [(s, m) for s, m, _, meta in results if not meta.get("recompute_checked")]
        print(
            "modes %s, %d evictions, %d requests, %d recompute mismatches"
            % (sorted(modes), evictions, len(results), mism)
        )
        self.assertEqual(unchecked, [])
        self.assertEqual(mism, 0)
        self.assertGreater(evictions, 0)
        for want in ("SEED", "DIRECT_TO_D", "PD_FALLBACK", "RESEED_SNAPSHOT", "RESEED_PREFILL"):
            self.assertIn(want, modes)
        # Prefill from the snapshot ran on real KV: the prefill sidecar loaded snapshot prefixes
        # (real attention KV pushed D->P) into the prefill worker's pages, and the turns served
        # from them recomputed exactly (the mismatch count above covers them).
        loads = []
        with open(os.path.join(work, "prefill-0.events.jsonl")) as f:
            for line in f:
                e = json.loads(line)
                if e.get("event") == "snapshot_store_load":
                    loads.append(e)
        print("prefill from the snapshot: %s" % [(e["session"], e["tokens"], e["seqlen"]) for e in loads])
        self.assertGreater(len(loads), 0)
        for e in loads:
            self.assertEqual(e["tokens"] % 16, 0, e)  # whole pages
            self.assertLessEqual(e["tokens"], e["seqlen"], e)
        for s, m, _, meta in results:
            if m == "RESEED_SNAPSHOT":
                self.assertGreater(meta["received_bytes"], 0, s)  # the snapshot: real KV pushed D->P earlier
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def get_json(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def events(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


@unittest.skipUnless(os.path.exists(os.path.join(BIN, "kvc-local")), "no %s/kvc-local: run make build" % BIN)
class TestRehomeWithRealKV(unittest.TestCase):
    def test_rehomed_session_serves_next_turn_from_loaded_kv(self):
        """A decode worker holding sessions dies (SIGKILL): the control plane re-homes each of
        them onto the other decode worker without a client request (LoadSessionCommand: the
        sidecar's open_session + zero-output RESEED_SNAPSHOT into kvc-refworker, which receives
        the real attention KV its dead peer computed and pushed D->P, and commits it). Each
        session's next turn, with the client's real token ids, is DIRECT_TO_D there: it reuses the
        loaded KV (only the appended tokens are prefilled) and recomputes exactly (0 mismatches
        against a full prefill in the same worker). The loads carry the snapshots' token ids (the
        commits' ids, pushed with the KV into the prefill store, sent back by the loading sidecar
        as input_ids), so each load itself is recompute-checked too; before that a load held the
        KV without ids, unverified until its next turn."""
        keep = os.environ.get("KVC_REFWORKER_IT_WORKDIR")
        work = os.path.join(keep, "rehome") if keep else tempfile.mkdtemp(prefix="kvc-refworker-rh-")
        os.makedirs(work, exist_ok=True)
        c = Cluster(work, {"snapshotDeltaTokens": "16"}, capacity=4096)
        rng = random.Random(11)
        tag = "%x-" % (int(time.time()) & 0xFFFFFF)
        hist = {}

        def turn(sess, append, max_new=6):
            hist[sess] = hist.get(sess, []) + [rng.randrange(VOCAB) for _ in range(append)]
            body = {
                "input_ids": hist[sess],
                "stream": True,
                "sampling_params": {"max_new_tokens": max_new},
                "session_params": {"id": sess},
            }
            st, h, chunks, out_ids, err = post(c.gateway + "/generate", body, {"X-Session-ID": sess})
            self.assertEqual((st, err), (200, None), "%s: %s" % (sess, chunks))
            hist[sess] += out_ids
            meta = chunks[-1]["meta_info"]["kvc"]
            print(
                "%-12s %-12s %-20s on %-9s kv %5d prefill %4d mism %s"
                % (
                    sess,
                    h.get("X-Kvc-Mode"),
                    h.get("X-Kvc-Reason"),
                    meta.get("worker_id"),
                    meta.get("kv_len_after", 0),
                    meta.get("prefill_tokens", -1),
                    meta.get("recompute_mismatches"),
                ),
                flush=True,
            )
            return h.get("X-Kvc-Mode"), h.get("X-Kvc-Decode-Worker"), meta

        try:
            decoders = {w["id"]: w for w in c.info["workers"] if w["role"] == "decode"}
            prefill = next(w for w in c.info["workers"] if w["role"] == "prefill")
            on, kv = {}, {}
            for i in range(4):
                sess = tag + "rh-%d" % i
                m, d, meta = turn(sess, 120 + 16 * i)
                self.assertEqual(m, "SEED")
                on[sess], kv[sess] = d, meta["kv_len_after"]
            by_d = {}
            for sess, d in on.items():
                by_d.setdefault(d, []).append(sess)
            victim = max(sorted(by_d), key=lambda d: len(by_d[d]))
            moved = by_d[victim]
            # every moved session's whole KV is in the prefill store (pushed D->P)
            deadline = time.time() + 60
            while True:
                stored = {}
                for e in events(prefill["event_log"]):
                    if e.get("event") == "snapshot_recv_ingested":
                        stored[e.get("session")] = max(stored.get(e.get("session"), 0), e.get("seqlen", 0))
                if all(stored.get(s, 0) >= kv[s] for s in moved):
                    break
                self.assertLess(time.time(), deadline, "snapshots not pushed: %s of %s" % (stored, kv))
                time.sleep(0.2)
            survivor = next(d for d in decoders if d != victim)
            before = get_json(decoders[survivor]["worker_url"] + "/kvc/sessions")["stats"]
            pid = get_json(decoders[victim]["worker_url"] + "/get_model_info")["pid"]
            print("killing %s (pid %d), which holds %s" % (victim, pid, moved), flush=True)
            os.kill(pid, signal.SIGKILL)
            # without any request, each of its sessions becomes resident on the survivor, whole
            deadline = time.time() + 90
            while True:
                held = {
                    x["session_id"]: x for x in get_json(decoders[survivor]["worker_url"] + "/kvc/sessions")["sessions"]
                }
                if all(s in held and held[s]["kv_len"] >= kv[s] and held[s]["committed"] for s in moved):
                    break
                self.assertLess(time.time(), deadline, "not re-homed: %s" % held)
                time.sleep(0.2)
            # the loads came with the snapshots' token ids (pushed with them D->P): the survivor
            # holds every loaded position's id, and recompute-checked each load against a full
            # prefill of them, without a mismatch
            after = get_json(decoders[survivor]["worker_url"] + "/kvc/sessions")["stats"]
            for sess in moved:
                self.assertEqual(held[sess]["tokens_known"], held[sess]["kv_len"], held[sess])
            checked = after["recompute_checked"] - before["recompute_checked"]
            self.assertGreaterEqual(checked, len(moved), (before, after))
            self.assertEqual(after["recompute_mismatches"], before["recompute_mismatches"], (before, after))
            for sess in moved:
                m, d, meta = turn(sess, 24)
                self.assertEqual((m, d), ("DIRECT_TO_D", survivor), sess)
                self.assertTrue(meta["recompute_checked"], meta)
                self.assertEqual(meta["recompute_mismatches"], 0, meta)
                # the loaded KV was reused: the new tokens prefilled, at most a page of the history
                self.assertGreaterEqual(meta["prefill_tokens"], 24, meta)
                self.assertLessEqual(meta["prefill_tokens"], 24 + 16, meta)
                self.assertEqual(meta.get("prefix_mismatch_tokens", 0), 0, meta)
            # and a turn after that, on what the first one committed
            for sess in moved:
                m, d, meta = turn(sess, 10)
                self.assertEqual((m, d, meta["recompute_mismatches"]), ("DIRECT_TO_D", survivor, 0), meta)
        finally:
            c.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
