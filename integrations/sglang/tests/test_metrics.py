"""The plugin's kvc_plugin_* metrics, read the way SGLang's /metrics reads them: prometheus_client
in multiprocess mode (conftest.py sets PROMETHEUS_MULTIPROC_DIR, as SGLang's --enable-metrics
does for its scheduler processes) and a MultiProcessCollector over that directory. Each test
drives a real path against the real sidecars and checks that exactly the counters it should move
moved, by exactly how much."""

import os

import kvctest
from kvctest import HEAD_DIM, HEADS, LAYERS
from test_backend import pd, seed  # noqa: F401  (fixture and driver)
from test_prefill_load import admit, p_linker, p_req, pside, snapshot_from_d  # noqa: F401  (pside: fixture)

PER_TOKEN = LAYERS * 2 * HEADS * HEAD_DIM * 2  # K and V of every layer, bf16


def samples():
    """Every kvc_plugin_* sample of every process's files, as SGLang's add_prometheus_middleware
    collects them: {(name, ((label, value), ...)): value}."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in reg.collect()
        if fam.name.startswith("kvc_plugin_")
        for s in fam.samples
    }


def moved(before, after, errors=False):
    """The samples that changed from before to after (bridge errors only with errors=True: a
    test asserts the ones it caused by name)."""
    out = {}
    for k, v in after.items():
        if k[0] == "kvc_plugin_bridge_errors_total" and not errors:
            continue
        d = v - before.get(k, 0.0)
        if d:
            out[k] = d
    return out


def key(name, **labels):
    return (name, tuple(sorted(dict(labels, tp_rank="0").items())))


def test_multiprocess_mode_and_sglangs_endpoint(dside):
    """The counters are multiprocess files (not process memory) and SGLang's own /metrics route
    (sglang.srt.utils.add_prometheus_middleware on its FastAPI app) serves them."""
    from fastapi import FastAPI
    from prometheus_client import values
    from prometheus_client.parser import text_string_to_metric_families
    from sglang.srt.utils import add_prometheus_middleware
    from starlette.testclient import TestClient

    _, w = dside
    w.committed_session("s-ep", list(range(1, 41)), [7] * 8)  # CommitSession through the hook
    assert values.ValueClass is not values.MutexValue, "prometheus_client was imported before multiprocess mode"
    pid = "counter_%d.db" % os.getpid()
    assert pid in os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"])

    app = FastAPI()
    add_prometheus_middleware(app)
    with TestClient(app) as c:
        resp = c.get("/metrics")
    assert resp.status_code == 200
    served = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(resp.text)
        for s in fam.samples
        if s.name.startswith("kvc_plugin_")
    }
    got = samples()
    assert served == got  # the same counters, through SGLang's route
    assert got[key("kvc_plugin_sessions_total", op="committed")] >= 1


def test_direct_to_d_turn_and_session_lifecycle(dside):
    """A DIRECT_TO_D turn opening a session (open_session, local_prefill) created through the
    hooked _create_generation_req; commits, a release and a capacity release (evicted) through the
    session hooks; a release the sidecar does not know (NOT_FOUND) counts as a bridge error only."""
    from kvcentric_sglang import sessions

    _, w = dside
    before = samples()
    hints = kvctest.kvc_hints(mode="DIRECT_TO_D", session_id="s-m1", open_session=True, local_prefill=True)
    kvctest.generation_req("m-1", list(range(1, 41)), hints)
    kvctest.generation_req("m-2", list(range(1, 41)), kvctest.kvc_hints(mode="DIRECT_TO_D", session_id="s-m1"))
    w.committed_session("s-m1", list(range(1, 41)), [7] * 8)
    w.streaming.release_session("s-m1")  # ReleaseSession (released), then SGLang frees
    w.committed_session("s-m2", list(range(1, 33)), [5] * 4)
    assert sessions.release_for_capacity(w.streaming, "s-m2") > 0  # ReleaseSession (evicted)
    assert not sessions.release("s-never")  # NOT_FOUND: not a release
    after = samples()
    assert moved(before, after) == {
        key("kvc_plugin_turns_total", kind="open"): 1,
        key("kvc_plugin_turns_total", kind="local_prefill"): 1,
        key("kvc_plugin_sessions_total", op="committed"): 2,
        key("kvc_plugin_sessions_total", op="released"): 1,
        key("kvc_plugin_sessions_total", op="evicted"): 1,
    }
    errs = moved(before, after, errors=True)
    assert errs.get(key("kvc_plugin_bridge_errors_total", call="ReleaseSession", code="NOT_FOUND")) == 1, errs


def test_pd_seed_counts_the_send_the_receive_and_their_bytes(pd):  # noqa: F811
    """A P/D SEED of 77 tokens in two chunks through the hooked queues and the real sidecars: one
    send on P, one receive on D, and the bytes each side moved: every token's K and V."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    n = 77
    before = samples()
    tx, rx, (st, _, sr, _) = seed(pd, room=931, session="s-mseed", n=n)
    assert (st, sr) == (KVPoll.Success, KVPoll.Success), (tx._error, rx._error)
    after = samples()
    assert rx.result.bytes == n * PER_TOKEN == tx.get_transfer_metric().transfer_total_bytes
    assert moved(before, after) == {
        key("kvc_plugin_turns_total", kind="send"): 1,
        key("kvc_plugin_turns_total", kind="receive"): 1,
        key("kvc_plugin_kv_bytes_total", direction="sent"): n * PER_TOKEN,
        key("kvc_plugin_kv_bytes_total", direction="received"): n * PER_TOKEN,
    }


def test_failed_receive_counts_a_failure_and_the_bridge_error(pd):  # noqa: F811
    """A P/D receive whose pages lie outside D's pool: PrepareReceive OUT_OF_RANGE, KVPoll.Failed,
    one receive failure, no bytes."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll

    hints = kvctest.kvc_hints(mode="SEED", session_id="s-mfail", room=932, prefill_peer_addr=pd.p.peer_addr)
    before = samples()
    rx = pd.dq._create_receiver_and_enqueue(
        kvctest.req("r-932", list(range(1000, 1077)), room=932, host=pd.host, port=pd.port, hints=hints)
    ).kv_receiver
    rx.init(0)
    rx.send_metadata(np.array([30, 5, 9, 17, 999], dtype=np.int32), 5)
    st, seen = kvctest.wait_poll(rx, KVPoll.Failed)
    assert st == KVPoll.Failed, seen
    after = samples()
    assert moved(before, after) == {
        key("kvc_plugin_turns_total", kind="receive"): 1,
        key("kvc_plugin_transfer_failures_total", direction="receive"): 1,
    }
    errs = moved(before, after, errors=True)
    assert errs.get(key("kvc_plugin_bridge_errors_total", call="PrepareReceive", code="OUT_OF_RANGE")) == 1, errs


def test_store_loads_by_result(pside, tmp):  # noqa: F811
    """Prefill from the snapshot on P: a load the store serves (hit: its tokens and bytes), then
    three it cannot (another generation and more tokens than stored: mismatch; no snapshot: miss),
    each a LoadFromStore bridge error with its code."""
    ns = pside
    prompt, out = list(range(1, 41)), [7] * 8
    before = samples()
    _, _, gen = snapshot_from_d(ns, tmp, "s-mload", prompt, out)  # D commits; its sidecar pushes to P
    lk = p_linker(ns)
    full = prompt + out + list(range(900, 940))
    _, loaded = admit(ns.wp, p_req("s-mload", full, "ml-hit", load_prefix_tokens=48, load_generation=gen))
    assert loaded == 48
    for rid, sid, h in [
        ("ml-gen", "s-mload", dict(load_prefix_tokens=48, load_generation=gen + 1)),
        ("ml-more", "s-mload", dict(load_prefix_tokens=64, load_generation=gen)),
        ("ml-none", "s-mnone", dict(load_prefix_tokens=48, load_generation=0)),
    ]:
        _, loaded = admit(ns.wp, p_req(sid, full if sid == "s-mload" else [5] * 70, rid, **h))
        assert loaded == 0, rid
    assert (lk.store_loads, lk.store_load_misses) == (1, 3)
    after = samples()
    assert moved(before, after) == {
        key("kvc_plugin_sessions_total", op="committed"): 1,
        key("kvc_plugin_turns_total", kind="load"): 4,
        key("kvc_plugin_store_loads_total", result="hit"): 1,
        key("kvc_plugin_store_loads_total", result="mismatch"): 2,
        key("kvc_plugin_store_loads_total", result="miss"): 1,
        key("kvc_plugin_store_load_tokens_total"): 48,
        key("kvc_plugin_kv_bytes_total", direction="loaded"): 48 * PER_TOKEN,
    }
    errs = moved(before, after, errors=True)
    assert errs.get(key("kvc_plugin_bridge_errors_total", call="LoadFromStore", code="FAILED_PRECONDITION")) == 2
    assert errs.get(key("kvc_plugin_bridge_errors_total", call="LoadFromStore", code="NOT_FOUND")) == 1


def test_without_prometheus_client_nothing_is_counted_and_nothing_fails(tmp):
    """The package declares grpcio only: in a process without prometheus_client (kvc-refworker's
    bridge client without SGLang) a count, here a failed bridge call, is a no-op, not an
    ImportError inside the error path. A fresh interpreter, prometheus_client made unimportable."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from kvcentric_sglang import metrics\n"
        "from kvcentric_sglang.bridge import BridgeError, WorkerBridge\n"
        "b = WorkerBridge(%r, timeout_s=2)\n"
        "try:\n"
        "    b.release_session('s')\n"
        "except BridgeError as e:\n"
        "    print('code', e.code.name)\n"
        "metrics.session('committed')\n"
        "print('off', metrics._off, len(metrics._m))\n"
    ) % os.path.join(tmp, "none.sock")
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    pkg = os.path.join(os.path.dirname(__file__), "..")
    r = subprocess.run([sys.executable, "-c", code], cwd=pkg, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["code UNAVAILABLE", "off True 0"], r.stdout
