"""Every routing decision mode driven through the plugin code, without a model (the refworker
runs the model part). Worker shapes (docs/routing.md, "Worker shapes"): DIRECT_TO_D and
RESEED_SNAPSHOT need a colocated decode worker (streaming sessions, KvcLinker); SEED,
RESEED_PREFILL, PD_FALLBACK and large appends move P->D through the kvcentric transfer backend.
RESEED_SNAPSHOT is in test_linker.py."""

import pytest

import kvctest
from test_backend import pd, seed  # noqa: F401  (fixture and driver)


def test_direct_to_d_is_a_streaming_append(dside):
    """DIRECT_TO_D: the gateway sends D the full context on the open session; the continuity
    hook strips the history, SGLang's match hits the session slot (only the tail is prefilled),
    and the finished turn commits the longer length."""
    from array import array

    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    d, w = dside
    prompt, out = list(range(1, 41)), [7] * 8
    s = w.committed_session("s-dd", prompt, out)
    assert kvctest.sessions_of(d)["s-dd"]["committed_len"] == 48
    full = prompt + out + [900, 901, 902]
    r, m = w.next_turn(s, full, "t1")  # the continuity hook strips the history, SGLang prepends it
    assert m.device_prefix_len == 48  # the session's resident KV: only 3 tokens are prefilled
    # the scheduler allocates the tail and runs the turn; 5 tokens are generated
    slot = w.streaming.slots["s-dd"]
    w.rtp.write((slot.kv.req_pool_idx, slice(48, 64)), w.alloc.alloc(16))
    r.kv.kv_allocated_len = 64
    r.output_ids = array("q", [5] * 5)
    r.kv.kv_committed_len = 56
    r.finished_reason = FINISH_LENGTH(length=5)
    assert w.streaming.try_cache_finished_req(r)
    assert kvctest.sessions_of(d)["s-dd"]["committed_len"] == 56
    assert w.slot_pages("s-dd", 56)[:3] == w.slot_pages("s-dd", 48)  # the resident pages stay


@pytest.mark.parametrize("mode,session", [("SEED", "s-seed"), ("RESEED_PREFILL", "s-rp"), ("PD_FALLBACK", "")])
def test_prefill_modes_move_p_to_d(pd, mode, session):  # noqa: F811
    """SEED / RESEED_PREFILL (session id carried, a SEED-kind transfer) and PD_FALLBACK (no
    session: the room names the transfer) move the prefilled KV and the aux row P->D."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvcentric_sglang.bridge import TRANSFER_SEED

    room = {"SEED": 911, "RESEED_PREFILL": 912, "PD_FALLBACK": 913}[mode]
    n, pp, dp = 77, [3, 7, 8, 12, 20], [30, 5, 9, 17, 2]
    tx, rx, (st, _, sr, seen) = seed(pd, room=room, mode=mode, session=session, n=n, ppages=pp, dpages=dp)
    assert st == KVPoll.Success and sr == KVPoll.Success, (seen, rx._error, tx._error)
    assert rx.kind == TRANSFER_SEED
    assert rx.session_id == tx.session_id == (session or "room-%d" % room)
    assert kvctest.token_bytes(pd.dpool, dp, n) == kvctest.token_bytes(pd.ppool, pp, n)
    assert int(pd.dmeta.bootstrap_room[5, 0]) == room


def test_large_append_moves_the_whole_context(pd):  # noqa: F811
    """A real large append (PD_FALLBACK, reason REAL_LARGE_APPEND): P prefills the full context
    (history + the large append) and the whole context moves, tagged with the session."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    n = 150  # 10 pages, the last partial
    pp, dp = list(range(1, 11)), list(range(12, 32, 2))
    tx, rx, (st, _, sr, seen) = seed(pd, room=914, mode="PD_FALLBACK", session="s-big", n=n, ppages=pp, dpages=dp)
    assert st == KVPoll.Success and sr == KVPoll.Success, (seen, rx._error, tx._error)
    assert rx.tokens == n and rx.result.tokens == n
    assert kvctest.token_bytes(pd.dpool, dp, n) == kvctest.token_bytes(pd.ppool, pp, n)


def test_reseed_snapshot_refused_on_a_pd_decode_worker(pd):  # noqa: F811
    """A P/D decode worker gets no first token from a snapshot: RESEED_SNAPSHOT routed to one
    fails at once, naming the worker shape it needs."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvcentric_sglang.backend import KvcTransferError

    hints = kvctest.kvc_hints(
        mode="RESEED_SNAPSHOT", session_id="s-x", room=915, snapshot_seqlen=48, prefill_peer_addr=pd.p.peer_addr
    )
    r = kvctest.req("r-915", list(range(60)), room=915, host=pd.host, port=pd.port, hints=hints)
    rx = pd.dq._create_receiver_and_enqueue(r).kv_receiver
    assert rx.poll() == KVPoll.Failed
    with pytest.raises(KvcTransferError, match="colocated decode worker"):
        rx.failure_exception()


def test_malformed_hint_refuses_the_request_not_the_scheduler(sglang_installed):
    bad = kvctest.kvc_hints(mode="SEED", session_id="s-bad", room="not-a-number")
    r = kvctest.generation_req("r-bad", [1, 2, 3], bad, max_new_tokens=1)
    assert r.to_finish is not None and "malformed kv_hints kvc payload" in r.to_finish.message
