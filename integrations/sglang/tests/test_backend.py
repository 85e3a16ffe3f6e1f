"""The kvcentric P/D transfer backend on SGLang's real classes and hooks, against the real
sidecar binaries: a two-chunk SEED with aux rows, and failures as KVPoll.Failed."""

import numpy as np
import pytest

import kvctest
from kvctest import PAGE


@pytest.fixture
def pd(sglang_installed, bins, tmp):
    from sglang.srt.disaggregation import decode as sdecode
    from sglang.srt.disaggregation.utils import TransferBackend

    # a prepared room whose sender never finishes fails after 3 s (default 120 s)
    d = kvctest.Sidecar(bins["decode"], "d0", tmp, extra=["--room-timeout", "3s"])
    p = kvctest.Sidecar(bins["prefill"], "p0", tmp)
    ppool, dpool = kvctest.mha_pool(tmp, "p"), kvctest.mha_pool(tmp, "d")
    pmeta, dmeta = kvctest.metadata_buffers(), kvctest.metadata_buffers()
    # the classes as SGLang's prefill and decode modules see them (hook propagation)
    pmgr = kvctest.kv_manager("prefill", ppool, pmeta, p)
    dmgr = kvctest.kv_manager("decode", dpool, dmeta, d)
    pq, host, port = kvctest.bootstrap_queue(pmgr, p)
    dq = sdecode.DecodePreallocQueue.__new__(sdecode.DecodePreallocQueue)
    dq.transfer_backend, dq.kv_manager, dq.queue = TransferBackend("kvcentric"), dmgr, []
    ns = type("PD", (), {})()
    ns.d, ns.p, ns.ppool, ns.dpool, ns.pmeta, ns.dmeta, ns.pmgr, ns.dmgr, ns.pq, ns.dq = (
        d,
        p,
        ppool,
        dpool,
        pmeta,
        dmeta,
        pmgr,
        dmgr,
        pq,
        dq,
    )
    ns.host, ns.port = host, port
    yield ns
    d.stop()
    p.stop()


def seed(
    pd,
    *,
    room,
    mode="SEED",
    session="s-seed",
    n=77,
    ppages=(3, 7, 8, 12, 20),
    dpages=(30, 5, 9, 17, 2),
    p_aux=2,
    d_aux=5,
    extra_hints=None,
    skip_pages=0,
):
    """Drives one P->D transfer through the real queue methods and the backend, chunk 1 sent
    before D prepares, chunk 2 (the last, partial page) after. Returns (sender, receiver, seen)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    hints = (
        kvctest.kvc_hints(
            mode=mode, session_id=session, room=room, prefill_peer_addr=pd.p.peer_addr, **(extra_hints or {})
        )
        if mode
        else None
    )
    ids = list(range(1000, 1000 + n))
    rp = kvctest.req("r-%d" % room, ids, room=room, host=pd.host, port=pd.port, hints=hints)
    rd = kvctest.req("r-%d" % room, ids, room=room, host=pd.host, port=pd.port, hints=hints)
    kvctest.fill_random(pd.ppool, ppages, seed=room)
    # the aux row SGLang's set_buf(req) writes on P before the last send
    pd.pmeta.output_ids[p_aux, 0] = 4242
    pd.pmeta.cached_tokens[p_aux, :3] = 7
    pd.pmeta.output_token_logprobs_val[p_aux, 0] = -0.125
    pd.pmeta.output_top_logprobs_idx[p_aux, :4] = 11
    pd.pmeta.bootstrap_room[p_aux, 0] = room

    assert pd.pq.create_sender(rp, num_kv_heads=kvctest.HEADS)  # hooked: session onto the sender
    tx = rp.disagg_kv_sender
    assert tx.skip_pages == (extra_hints or {}).get("receive_from", 0) // PAGE  # the hook: kv_hints receive_from
    tx.skip_pages = skip_pages or tx.skip_pages
    assert tx.session_id == (session or "room-%d" % room)
    assert tx.poll() == KVPoll.WaitingForInput
    tx.init(len(ppages), p_aux)
    tx.send(np.array(ppages[:2], dtype=np.int32), None, num_kv_tokens=2 * PAGE)  # before D prepares
    assert tx.poll() == KVPoll.Transferring

    dr = pd.dq._create_receiver_and_enqueue(rd)  # hooked: session, kind and tokens onto the receiver
    rx = dr.kv_receiver
    assert (rx.session_id, rx.tokens) == (session or "room-%d" % room, n)
    assert rx.poll() == KVPoll.Bootstrapping
    rx.init(0)
    assert rx.poll() == KVPoll.WaitingForInput
    rx.send_metadata(np.array(dpages, dtype=np.int32), d_aux)
    after_meta = rx.poll()  # the last chunk is not sent yet: the room cannot be done
    tx.send(np.array(ppages[2:], dtype=np.int32), None, num_kv_tokens=n - 2 * PAGE)
    st, seen_tx = kvctest.wait_poll(tx, KVPoll.Success)
    sr, seen_rx = kvctest.wait_poll(rx, KVPoll.Success)
    return tx, rx, (st, seen_tx, sr, [after_meta] + seen_rx)


def test_seed_two_chunks_with_aux(pd):
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvcentric_sglang import pool as kvpool

    n, ppages, dpages = 77, [3, 7, 8, 12, 20], [30, 5, 9, 17, 2]
    tx, rx, (st, seen_tx, sr, seen_rx) = seed(pd, room=901, n=n, ppages=ppages, dpages=dpages)
    assert st == KVPoll.Success, (seen_tx, tx._error, pd.p.tail())
    assert sr == KVPoll.Success, (seen_rx, rx._error, pd.d.tail())
    assert KVPoll.Transferring in seen_rx
    # identical K/V bytes, every layer, K and V
    assert kvctest.token_bytes(pd.dpool, dpages, n) == kvctest.token_bytes(pd.ppool, ppages, n)
    assert rx.result.bytes == n * kvctest.LAYERS * 2 * kvctest.HEADS * kvctest.HEAD_DIM * 2
    assert tx.get_transfer_metric().transfer_total_bytes == rx.result.bytes
    # the aux row landed in D's metadata row before Success was reported
    m = pd.dmeta
    assert int(m.output_ids[5, 0]) == 4242 and int(m.bootstrap_room[5, 0]) == 901
    assert m.cached_tokens[5, :3].tolist() == [7, 7, 7] and float(m.output_token_logprobs_val[5, 0]) == -0.125
    assert kvpool.read_aux_rows(pd.dmgr.aux_ptrs, pd.dmgr.aux_item_lens, 5) == kvpool.read_aux_rows(
        pd.pmgr.aux_ptrs, pd.pmgr.aux_item_lens, 2
    )


def test_suffix_only_send(pd):
    """A suffix-only send (skip_pages, as kvc-refworker sets it, its decode side preparing every
    page of the session; a real SGLang decode worker's is in test_suffix_receive.py): the sender
    skips the pages the decode worker holds and sends only the rest; D's held page is left as it
    was, the others hold P's bytes, and only the suffix's bytes cross."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    n, ppages, dpages = 77, [3, 7, 8, 12, 20], [30, 5, 9, 17, 2]
    kvctest.fill_random(pd.dpool, dpages[:1], seed=99)  # the page D holds of the session
    held = kvctest.token_bytes(pd.dpool, dpages[:1], kvctest.PAGE)
    tx, rx, (st, seen_tx, sr, seen_rx) = seed(
        pd,
        room=903,
        mode="PD_FALLBACK",
        n=n,
        ppages=ppages,
        dpages=dpages,
        extra_hints={"keep_session": True},
        skip_pages=1,
    )
    assert st == KVPoll.Success, (seen_tx, tx._error, pd.p.tail())
    assert sr == KVPoll.Success, (seen_rx, rx._error, pd.d.tail())
    assert kvctest.token_bytes(pd.dpool, dpages[:1], kvctest.PAGE) == held
    whole_d, whole_p = kvctest.token_bytes(pd.dpool, dpages, n), kvctest.token_bytes(pd.ppool, ppages, n)
    assert whole_d != whole_p  # the held page was not overwritten
    per_token = kvctest.LAYERS * 2 * kvctest.HEADS * kvctest.HEAD_DIM * 2
    assert rx.result.bytes == (n - kvctest.PAGE) * per_token
    # every buffer's tokens [PAGE, n) are P's
    for pd_pg, pp_pg in zip(dpages[1:-1], ppages[1:-1]):
        page = kvctest.PAGE
        assert kvctest.token_bytes(pd.dpool, [pd_pg], page) == kvctest.token_bytes(pd.ppool, [pp_pg], page)
    last = n - 4 * kvctest.PAGE
    assert kvctest.token_bytes(pd.dpool, dpages[-1:], last) == kvctest.token_bytes(pd.ppool, ppages[-1:], last)


def test_failures_surface_as_kvpoll_failed(pd):
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvcentric_sglang.backend import KvcTransferError

    # D: a page outside its pool -> PrepareReceive OUT_OF_RANGE -> Failed
    _, rx, (_, _, sr, _) = seed(pd, room=902, dpages=(30, 5, 9, 17, 999))
    assert sr == KVPoll.Failed
    with pytest.raises(KvcTransferError, match="OUT_OF_RANGE"):
        rx.failure_exception()
    # P: a page outside its pool -> SendKV fails -> Failed on P; D's room never gets its last
    # chunk and fails at the decode sidecar's room timeout
    tx, rx, (st, _, sr, seen_rx) = seed(pd, room=903, ppages=(3, 7, 8, 12, 999))
    assert st == KVPoll.Failed
    with pytest.raises(KvcTransferError, match="SendKV room 903.*OUT_OF_RANGE"):
        tx.failure_exception()
    assert sr == KVPoll.Failed and seen_rx[0] == KVPoll.Transferring, seen_rx
    with pytest.raises(KvcTransferError, match="room 903"):
        rx.failure_exception()


def test_tp_rank_registers_and_pairs(sglang_installed, bins, tmp):
    """A TP rank registers as rank r of n (one sidecar per rank): the manager sends tp_rank /
    tp_size from SGLang's engine_rank and --tp-size."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from kvcentric_sglang.backend import KvcKVManager

    d = kvctest.Sidecar(bins["decode"], "d-tp1", tmp)
    try:
        pool, meta = kvctest.mha_pool(tmp, "tp"), kvctest.metadata_buffers()
        args = kvctest.kv_args(pool, meta)
        args.engine_rank = 1
        mgr = KvcKVManager(args, DisaggregationMode.DECODE, kvctest.server_args(d.sock, tp_size=2))
        assert (mgr.registration.tp_rank, mgr.registration.tp_size) == (1, 2)
        assert mgr.kv_bytes_per_token == kvctest.LAYERS * 2 * kvctest.HEADS * kvctest.HEAD_DIM * 2
        assert mgr.registration.aux_item_lens == list(meta.get_buf_infos()[2])
    finally:
        d.stop()
