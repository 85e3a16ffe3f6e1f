"""Every routing decision mode driven through the plugin code, without a model (the refworker
runs the model part). Worker shapes (docs/routing.md, "Worker shapes"): DIRECT_TO_D and
RESEED_SNAPSHOT need a colocated decode worker (streaming sessions, KvcLinker); SEED,
RESEED_PREFILL, PD_FALLBACK and large appends move P->D through the kvcentric transfer backend.
RESEED_SNAPSHOT is in test_linker.py."""

import pytest

import kvctest
from kvctest import PAGE
from test_backend import pd, seed  # noqa: F401  (fixture and driver)
from test_sessions import dside  # noqa: F401


def test_direct_to_d_is_a_streaming_append(dside):  # noqa: F811
    """DIRECT_TO_D: the gateway sends D the full context on the open session; the continuity
    hook strips the history, SGLang's match hits the session slot (only the tail is prefilled),
    and the finished turn commits the longer length."""
    from array import array
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import SessionParams
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.session.session_controller import Session

    d, w = dside
    s = Session(capacity_of_str_len=1 << 20, session_id="s-dd", streaming=True)
    prompt, out = list(range(1, 41)), [7] * 8
    assert w.streaming.try_cache_finished_req(w.first_turn(s, prompt, out))
    assert kvctest.sessions_of(d)["s-dd"]["committed_len"] == 48
    full = prompt + out + [900, 901, 902]
    recv = SimpleNamespace(
        rid="t1",
        input_text=None,
        input_ids=list(full),
        mm_inputs=None,
        sampling_params=SamplingParams(max_new_tokens=5),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        lora_id=None,
        session_params=SessionParams(id="s-dd"),
        custom_logit_processor=None,
        return_hidden_states=False,
        return_routed_experts=False,
        routed_experts_start_len=0,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        routed_dp_rank=None,
        disagg_prefill_dp_rank=None,
        priority=None,
        routing_key=None,
        extra_key=None,
        cache_salt=None,
        http_worker_ipc=None,
        time_stats=None,
        require_reasoning=False,
        return_sampling_mask=False,
        sampling_logprobs_mode="selected",
        kv_hints=kvctest.kvc_hints(mode="DIRECT_TO_D", session_id="s-dd"),
    )
    r = s.create_req(recv, None, vocab_size=1000)
    assert list(r.origin_input_ids) == full and r.to_finish is None
    r.extra_key = None
    m = w.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", full[:-1])), req=r))
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
    from array import array
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams

    bad = kvctest.kvc_hints(mode="SEED", session_id="s-bad", room="not-a-number")
    r = Scheduler._create_generation_req(
        SimpleNamespace(page_size=PAGE),
        SimpleNamespace(kv_hints=bad),
        "r-bad",
        None,
        array("q", [1, 2, 3]),
        SamplingParams(max_new_tokens=1),
        vocab_size=1000,
    )
    assert r.to_finish is not None and "malformed kv_hints kvc payload" in r.to_finish.message
