"""Prefill from the snapshot on a real SGLang prefill server (kv_hints load_prefix_tokens /
load_generation): a colocated decode worker's session is committed and pushed by the real decode
sidecar into the real prefill sidecar's store; then P's request, created through the hooked
_create_generation_req, goes through SGLang's real match / load-back path with the KvcLinker on
P. The linker loads [0, load_prefix_tokens) from P's own store into the request's private slots
(LoadFromStore), SGLang counts them as the request's prefix (prefix_len, prefix_device_indices)
and prefills only the rest; a load the store cannot serve falls back to the whole prompt."""

from array import array
from types import SimpleNamespace

import pytest

import kvctest
from kvctest import PAGE


@pytest.fixture
def pside(sglang_installed, bins, tmp):
    from kvcentric_sglang import runtime

    runtime.state.reset()
    cp = kvctest.ScriptedControlPlane(delta_tokens=16)
    d = kvctest.Sidecar(bins["decode"], "d0", tmp, cp.addr, extra=["--snapshot-delta-tokens", "16"])
    p = kvctest.Sidecar(bins["prefill"], "p0", tmp, cp.addr, extra=["--store-capacity-bytes", str(16 << 20)])
    wp = kvctest.Colocated(tmp, "p")  # P's radix cache, allocator and pool (SGLang's classes)
    # P's KV manager registers P's pool with its sidecar, as PrefillBootstrapQueue does
    pmgr = kvctest.kv_manager("prefill", wp.kv, kvctest.metadata_buffers(), p)
    ns = SimpleNamespace(cp=cp, d=d, p=p, wp=wp, pmgr=pmgr)
    yield ns
    d.stop()
    p.stop()
    cp.close()
    runtime.state.reset()


def snapshot_from_d(ns, tmp, sid, prompt, out):
    """D's first turn of sid committed through the hook; D's sidecar pushes it to P's store.
    Returns (D's worker, the pages of [0, n), the snapshot's generation)."""
    from kvcentric_sglang import runtime

    w = kvctest.Colocated(tmp, "d")
    pstate = (runtime.state.bridge, runtime.state.registration)
    w.attach(ns.d.sock)  # D's process commits through D's sidecar
    try:
        pages, st = kvctest.push_snapshot(ns.cp, ns.d, ns.p, w, ns.pmgr.bridge, sid, prompt, out)
    finally:
        runtime.state.bridge, runtime.state.registration = pstate
    return w, pages, st.generation


def p_linker(ns):
    """The KvcLinker of P's scheduler process (--disaggregation-mode prefill)."""
    from kvcentric_sglang.linker import KvcLinker

    lk = KvcLinker(
        SimpleNamespace(tp_size=1, disaggregation_mode="prefill"), ns.wp.params, components={"full"}, extra_config={}
    )
    ns.wp.cache.init_cache_linker(lk)
    assert lk.prefill and lk.bridge is ns.pmgr.bridge  # no second registration: P's manager's bridge
    return lk


def p_req(sid, full, rid, **hint):
    """P's request as the scheduler creates it (non-session path), through the hooked
    _create_generation_req."""
    hints = kvctest.kvc_hints(mode="PD_FALLBACK", session_id=sid, room=hint.pop("room", 700), role="prefill", **hint)
    r = kvctest.generation_req(rid, full, hints, max_new_tokens=1)
    assert r.kv_hints is hints
    return r


def admit(w, r):
    """What SGLang's PrefillAdder does with the request: match, load back the host hit (the
    linker's), extend the prefix by what was loaded. Returns the tokens loaded."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    full = list(r.origin_input_ids)
    m = w.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", full[:-1])), req=r))
    r.last_node = m.last_device_node
    r.prefix_len = m.device_prefix_len
    if m.host_hit_length == 0:
        return m, 0
    loaded, r.last_node = w.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=r)
    )
    r.prefix_len += loaded
    return m, loaded


def test_prefill_loads_the_snapshot_prefix_and_computes_only_the_rest(pside, tmp):
    ns = pside
    prompt, out = list(range(1, 41)), [7] * 8
    w, pages, gen = snapshot_from_d(ns, tmp, "s-pl", prompt, out)  # the store holds [0, 48)
    lk = p_linker(ns)
    full = prompt + out + list(range(900, 940))  # a large append: 88 tokens, 48 in the snapshot
    r = p_req("s-pl", full, "pl-1", load_prefix_tokens=48, load_generation=gen, receive_from=48)
    m, loaded = admit(ns.wp, r)
    assert (m.device_prefix_len, m.host_hit_length, loaded) == (0, 48, 48), m
    slots = ns.wp.cache.linker.private_load_indices[r.rid]
    # the slots already hold D's KV of [0, 48): the load ran when SGLang queued it
    got = [int(x) // PAGE for x in slots[::PAGE].tolist()]
    assert kvctest.token_bytes(ns.wp.kv, got, 48) == kvctest.token_bytes(w.kv, pages, 48)
    # SGLang's prefix of the request is the loaded slots: it prefills only tokens 48..87
    assert r.prefix_len == 48
    assert ns.wp.cache.prefix_device_indices(r).tolist() == slots.tolist()
    assert len(full) - r.prefix_len == 40
    idx = ns.wp.cache.ready_to_load_host_cache()  # the batch starts: nothing left to wait for
    lk.layer_done_counter.set_consumer(idx)
    for layer in range(kvctest.LAYERS):
        lk.layer_done_counter.wait_until(layer)
    assert ns.wp.cache.finish_external_linker_loads([r]) == []
    assert (lk.store_loads, lk.store_load_tokens, lk.store_load_misses) == (1, 48, 0)
    assert lk.store_loaded["pl-1"] == 48


def test_prefill_load_the_store_cannot_serve_prefills_everything(pside, tmp):
    """Another generation than the decision saw, more tokens than the store holds, no snapshot:
    LoadFromStore refuses, the linker declines the load and SGLang prefills the whole prompt (no
    prefix, no failed request)."""
    ns = pside
    prompt, out = list(range(1, 41)), [7] * 8
    _, _, gen = snapshot_from_d(ns, tmp, "s-pm", prompt, out)
    lk = p_linker(ns)
    full = prompt + out + list(range(900, 940))
    cases = [
        ("pm-gen", "s-pm", dict(load_prefix_tokens=48, load_generation=gen + 1)),
        ("pm-more", "s-pm", dict(load_prefix_tokens=64, load_generation=gen)),
        ("pm-none", "s-none", dict(load_prefix_tokens=48, load_generation=0)),
    ]
    for rid, sid, h in cases:
        ids = full if sid == "s-pm" else [5] * 70
        r = p_req(sid, ids, rid, **h)
        m, loaded = admit(ns.wp, r)
        assert m.host_hit_length > 0 and loaded == 0, (rid, m)  # offered, not loaded
        assert r.prefix_len == 0 and rid not in ns.wp.cache.linker.private_load_indices, rid
        assert ns.wp.cache.finish_external_linker_loads([r]) == [], rid
    assert (lk.store_loads, lk.store_load_misses) == (0, 3)


def test_prefill_linker_declines_without_a_load_hint_or_mid_sequence(pside, tmp):
    """No load_prefix_tokens (a plain P request), or P's radix tree already holds the first
    page (the snapshot cannot land mid-sequence): no external hit, nothing asked of the store."""
    ns = pside
    prompt, out = list(range(1, 41)), [7] * 8
    snapshot_from_d(ns, tmp, "s-pd", prompt, out)
    lk = p_linker(ns)
    full = prompt + out + list(range(900, 940))
    r = p_req("s-pd", full, "pd-plain")
    m, loaded = admit(ns.wp, r)
    assert (m.host_hit_length, loaded) == (0, 0)
    # the first page of the prompt is in P's tree (an earlier request's prefill)
    w = ns.wp
    r0 = kvctest.req("pd-tree", full[: 2 * PAGE + 1])  # an earlier plain request, checkpointed as SGLang does
    r0.extra_key = None
    w.rtp.alloc([r0])
    w.rtp.write((r0.kv.req_pool_idx, slice(0, 3 * PAGE)), w.alloc.alloc(3 * PAGE))
    r0.kv.kv_allocated_len = 3 * PAGE
    r0.last_node = w.cache.root_node_handle()
    r0.lock = w.cache.lock(r0.last_node)
    r0.refresh_fill_ids()
    w.cache.checkpoint(r0, up_to=2 * PAGE)
    r = p_req("s-pd", full, "pd-mid", load_prefix_tokens=48)
    m, loaded = admit(ns.wp, r)
    assert PAGE <= m.device_prefix_len < 48 and m.host_hit_length == 0 and loaded == 0, m
    assert lk.store_loads == 0 and lk.store_load_misses == 0
