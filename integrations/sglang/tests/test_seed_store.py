"""SEED into a colocated decode worker through the prefill store (docs/sglang.md): P's
KvcKVSender, created through SGLang's real (hooked) create_sender with a to_store hint, writes the
prompt's KV into the real prefill sidecar's own store as the session's snapshot of the hint's
generation, without any decode side; the colocated D's KvcLinker then loads it through SGLang's
real match / load-back path like a RESEED_SNAPSHOT. The K/V bytes in D's slots are P's."""

from array import array
from types import SimpleNamespace

import numpy as np
import pytest

import kvctest
from kvctest import PAGE


@pytest.fixture
def seedstore(sglang_installed, bins, tmp):
    cp = kvctest.ScriptedControlPlane(delta_tokens=16)
    p = kvctest.Sidecar(bins["prefill"], "p0", tmp, cp.addr, extra=["--store-capacity-bytes", str(16 << 20)])
    d = kvctest.Sidecar(bins["decode"], "d1", tmp, cp.addr)
    ppool, pmeta = kvctest.mha_pool(tmp, "p"), kvctest.metadata_buffers()
    pq, host, port = kvctest.bootstrap_queue(kvctest.kv_manager("prefill", ppool, pmeta, p), p)
    ns = SimpleNamespace(cp=cp, p=p, d=d, ppool=ppool, pq=pq, host=host, port=port)
    yield ns
    d.stop()
    p.stop()
    cp.close()
    from kvcentric_sglang import runtime

    runtime.state.reset()


def p_seed(ss, *, room, session, prompt, ppages, generation=1, seed=3):
    """P's half: the request with the to_store hint, the hooked create_sender, two chunks (the
    second the last, a partial page). Returns (sender, final poll, polls seen)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    hints = kvctest.kvc_hints(
        mode="SEED",
        session_id=session,
        room=room,
        prefill_peer_addr=ss.p.peer_addr,
        to_store=True,
        generation=generation,
    )
    rp = kvctest.req("r-%d" % room, prompt, room=room, host=ss.host, port=ss.port, hints=hints)
    kvctest.fill_random(ss.ppool, ppages, seed=seed)
    assert ss.pq.create_sender(rp, num_kv_heads=kvctest.HEADS)  # hooked: session, to_store, tokens
    tx = rp.disagg_kv_sender
    tx.init(len(ppages), 1)
    tx.send(np.array(ppages[:2], dtype=np.int32), None, num_kv_tokens=2 * PAGE)
    tx.send(np.array(ppages[2:], dtype=np.int32), None, num_kv_tokens=len(prompt) - 2 * PAGE)
    st, seen = kvctest.wait_poll(tx, KVPoll.Success)
    return tx, st, seen


def colocated_d(ss, tmp):
    """The colocated decode worker: SGLang's real cache with the KvcLinker on D's sidecar."""
    from kvcentric_sglang import runtime

    runtime.state.reset()
    w = kvctest.Colocated(tmp, "d1")
    return w, w.linker(ss.d.sock)


def test_seed_through_prefill_store(seedstore, tmp):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from kvcentric_sglang.bridge import WorkerBridge

    ss = seedstore
    prompt, ppages = list(range(1, 54)), [9, 4, 13, 2]  # 53 tokens: 3 full pages + 5
    tx, st, seen = p_seed(ss, room=990, session="s-st", prompt=prompt, ppages=ppages)
    # P finished with no decode side at all: nothing waited for D
    assert (tx.to_store, tx.generation, tx.tokens) == (True, 1, 53)
    assert st == KVPoll.Success, (seen, tx._error, ss.p.tail())
    per_token = kvctest.LAYERS * 2 * kvctest.HEADS * kvctest.HEAD_DIM * 2
    assert tx.get_transfer_metric().transfer_total_bytes == 53 * per_token
    # the store holds the session's generation-1 snapshot, and the control plane was told
    snap = WorkerBridge(ss.p.sock).snapshot_status("s-st")
    assert snap.exists and snap.seqlen == 53 and snap.generation == 1 and snap.prefill_worker == "p0", snap
    assert ss.cp.wait(
        lambda c: any(
            e["kind"] == "snapshot_ingested"
            and e["session"] == "s-st"
            and e["worker"] == "p0"
            and e["kv_len"] == 53
            and e["generation"] == 1
            and e["detail"] == "seed"
            for e in c.events
        )
    ), ss.cp.events

    # D's half: the gateway calls D after P answered, with snapshot_seqlen and a room of its own
    w, lk = colocated_d(ss, tmp)
    hints = kvctest.kvc_hints(
        mode="SEED", session_id="s-st", room=991, snapshot_seqlen=53, prefill_peer_addr=ss.p.peer_addr
    )
    r = kvctest.generation_req("d-1", prompt, hints)
    # SGLang matches input-1 tokens: 52 -> 3 whole pages restorable from the store's 53
    m = w.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt[:-1])), req=r))
    assert m.device_prefix_len == 0 and m.host_hit_length == 48, m
    r.last_node = m.last_device_node
    loaded, _ = w.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=r)
    )
    assert loaded == 48
    slots = w.cache.linker.private_load_indices[r.rid]
    idx = w.cache.ready_to_load_host_cache()  # PrepareReceive(SNAPSHOT) + WaitReceive on D's sidecar
    lk.layer_done_counter.set_consumer(idx)
    for layer in range(kvctest.LAYERS):
        lk.layer_done_counter.wait_until(layer)
    assert w.cache.finish_external_linker_loads([r]) == [], ss.d.tail()
    got = [int(x) // PAGE for x in slots[::PAGE].tolist()]
    assert kvctest.token_bytes(w.kv, got, 48) == kvctest.token_bytes(ss.ppool, ppages, 48)
    assert lk.loads_done == 1


def test_store_seed_failures(seedstore, tmp):
    """A seed older than the stored generation: the sidecar refuses it, KVPoll.Failed, and the
    stored snapshot stays. (A store seed is a send with store_generation > 0: there is no
    to_store without a generation to refuse any more.)"""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvcentric_sglang.bridge import WorkerBridge

    ss = seedstore
    prompt, ppages = list(range(1, 40)), [5, 6, 7]
    _, st, _ = p_seed(ss, room=981, session="s-f", prompt=prompt, ppages=ppages, generation=3)
    assert st == KVPoll.Success
    tx, st, _ = p_seed(ss, room=982, session="s-f", prompt=prompt, ppages=ppages, generation=2)
    assert st == KVPoll.Failed and "generation 2 is older" in tx._error, tx._error
    snap = WorkerBridge(ss.p.sock).snapshot_status("s-f")
    assert snap.exists and snap.generation == 3 and snap.seqlen == len(prompt)
