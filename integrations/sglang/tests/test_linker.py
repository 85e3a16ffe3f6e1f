"""RESEED_SNAPSHOT through SGLang's real match / load-back path with the KvcLinker: a session's
snapshot is pushed by the real decode sidecar (D) into the real prefill sidecar's store, then a
second colocated worker (D') loads it into its own request slots; SGLang would prefill only the
tail."""

import pytest

import kvctest
from kvctest import PAGE


@pytest.fixture
def cluster(sglang_installed, bins, tmp):
    cp = kvctest.ScriptedControlPlane(delta_tokens=16)
    d = kvctest.Sidecar(bins["decode"], "d0", tmp, cp.addr, extra=["--snapshot-delta-tokens", "16"])
    p = kvctest.Sidecar(bins["prefill"], "p0", tmp, cp.addr, extra=["--store-capacity-bytes", str(16 << 20)])
    d2 = kvctest.Sidecar(bins["decode"], "d1", tmp, cp.addr, extra=["--snapshot-delta-tokens", "16"])
    yield cp, d, p, d2
    for s in (d, p, d2):
        s.stop()
    cp.close()
    from kvcentric_sglang import runtime

    runtime.state.reset()


def make_snapshot(cp, d, p, tmp, sid, prompt, out):
    """D's first turn of session sid, committed through the hook; D's sidecar pushes it to P's
    store. Returns (D's worker, the pages of [0, n), P's bridge)."""
    pb, _ = kvctest.Colocated(tmp, "p").attach(p.sock, process=False)  # P's pool: the store takes its geometry
    w = kvctest.Colocated(tmp, "d")
    w.attach(d.sock)
    pages, _ = kvctest.push_snapshot(cp, d, p, w, pb, sid, prompt, out)
    return w, pages, pb


def dprime(d2, tmp):
    """D': a colocated worker whose linker registers its pool with its own sidecar."""
    from kvcentric_sglang import runtime

    runtime.state.reset()
    w2 = kvctest.Colocated(tmp, "d2")
    return w2, w2.linker(d2.sock)


def reseed_req(w2, sid, full, room, seqlen, peer, rid="rs-1"):
    """The request as the scheduler creates it, through the hooked _create_generation_req."""
    hints = kvctest.kvc_hints(
        mode="RESEED_SNAPSHOT", session_id=sid, room=room, snapshot_seqlen=seqlen, prefill_peer_addr=peer
    )
    r = kvctest.generation_req(rid, full, hints)
    assert r.kv_hints is hints  # the hook carried kv_hints onto the request
    return r


def test_reseed_snapshot_through_real_match_and_load(cluster, tmp):
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cp, d, p, d2 = cluster
    prompt, out = list(range(1, 41)), [7] * 8
    w, pages, _ = make_snapshot(cp, d, p, tmp, "s-r", prompt, out)
    w2, lk = dprime(d2, tmp)
    full = prompt + out + [900, 901, 902, 903, 904]  # the new turn: history + 5 tokens
    r = reseed_req(w2, "s-r", full, room=777, seqlen=48, peer=p.peer_addr)
    # SGLang's match path: no device hit on D', the linker answers the snapshot's pages
    m = w2.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", full[:-1])), req=r))
    assert m.device_prefix_len == 0 and m.host_hit_length == 48, m
    r.last_node = m.last_device_node
    loaded, _ = w2.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=r)
    )
    assert loaded == 48
    slots = w2.cache.linker.private_load_indices[r.rid]
    idx = w2.cache.ready_to_load_host_cache()  # PrepareReceive(SNAPSHOT) + WaitReceive
    lk.layer_done_counter.set_consumer(idx)
    for layer in range(kvctest.LAYERS):  # what the forward does before reading each layer
        lk.layer_done_counter.wait_until(layer)
    assert w2.cache.finish_external_linker_loads([r]) == []  # landed
    # D' slots hold exactly D's session KV of [0, 48): SGLang prefills only tokens 48..52
    got_pages = [int(x) // PAGE for x in slots[::PAGE].tolist()]
    assert kvctest.token_bytes(w2.kv, got_pages, 48) == kvctest.token_bytes(w.kv, pages, 48)
    assert lk.loads_done == 1


def test_linker_declines_what_it_cannot_load(cluster, tmp):
    """No kvc hint, another mode, or a tail not starting at token 0: no hit (SGLang prefills);
    a snapshot the store does not hold: the load fails and the request is marked failed."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cp, d, p, d2 = cluster
    w2, lk = dprime(d2, tmp)
    full = list(range(1, 54))
    plain = kvctest.req("plain", full)
    plain.extra_key = None
    m = w2.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", full[:-1])), req=plain))
    assert m.host_hit_length == 0
    # the store holds no snapshot of s-none: the transfer fails -> finish reports the request failed
    r = reseed_req(w2, "s-none", full, room=778, seqlen=48, peer=p.peer_addr, rid="rs-2")
    m = w2.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", full[:-1])), req=r))
    assert m.host_hit_length == 48
    r.last_node = m.last_device_node
    w2.cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=48, req=r))
    idx = w2.cache.ready_to_load_host_cache()
    lk.layer_done_counter.set_consumer(idx)
    lk.layer_done_counter.wait_until(0)
    failed = w2.cache.finish_external_linker_loads([r])
    assert failed == [r] and r.discard_output_reason is not None
