"""The capacity release of a session whose turn waits for pages (issue 20), worker side, from
SGLang 0.5.23's own scheduler state (demand.scheduler_view: the colocated waiting queue, the P/D
DecodePreallocQueue and transfer queue, the running batch): refused while another committed
session holding KV is idle, leaving the slot and SGLang's state as they were; released when none
is; a session a running request uses is refused whatever the reason. End to end through the
real decode sidecar's release pass: the refusal is passed over and the idle session goes."""

import time
from types import SimpleNamespace

import pytest

import kvctest


def _session(w, sid, prompt):
    """A streaming session of `prompt` + 8 committed tokens (CommitSession through the hook)."""
    return w.committed_session(sid, list(range(1, prompt + 1)), [7] * 8)


def _next_turn(w, s, sid, prompt):
    """The session's next turn as SGLang builds it (Session.create_req, the continuity hook
    strips the history) and as the scheduler last tried to admit it: SGLang's match lent it the
    slot's record. Returns the Req."""
    full = list(range(1, prompt + 1)) + [7] * 8 + [900, 901, 902]
    r, m = w.next_turn(s, full, "t1-" + sid)
    assert m.device_prefix_len == prompt + 8
    assert r.kv is w.streaming.slots[sid].kv
    return r


def _batch(reqs):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    return ScheduleBatch(reqs=list(reqs), batch_is_full=False)


def _state(d, w, sid):
    """What a refusal must leave as it was: the slot object, its record, the pool, the sidecar."""
    slot = w.streaming.slots.get(sid)
    kv = slot.kv if slot is not None else None
    return (
        slot,
        kv,
        None if kv is None else (kv.req_pool_idx, kv.kv_committed_len, kv.kv_allocated_len, kv.cache_protected_len),
        w.alloc.available_size(),
        kvctest.sessions_of(d).get(sid),
    )


def test_colocated_waiting_turn_refused_while_another_slot_is_idle(dside):
    from kvcentric_sglang import demand, sessions
    from kvcentric_sglang.bridge import REASON_CAPACITY, REASON_CONTROL_PLANE

    d, w = dside
    sa = _session(w, "s-A", 40)
    _session(w, "s-B", 24)
    turn = _next_turn(w, sa, "s-A", 40)
    sched = SimpleNamespace(waiting_queue=[turn], running_batch=_batch([]), last_batch=None, chunked_req=None)
    view = demand.scheduler_view(sched)
    assert view.sessions("waiting") == {"s-A"} and not view.in_use
    assert sessions.idle_sessions(w.streaming, view, exclude="s-A") == ["s-B"]

    before = _state(d, w, "s-A")
    with pytest.raises(sessions.ReleaseRefused, match=r"s-A has a turn waiting for pages.*1 idle session.*s-B"):
        sessions.release_for_capacity(w.streaming, "s-A", REASON_CAPACITY, view)
    assert _state(d, w, "s-A") == before  # the slot, its record, the pool and the sidecar as they were
    assert turn.kv is w.streaming.slots["s-A"].kv and turn in sched.waiting_queue

    # s-B's turn runs: no other session is idle, so the waiting turn's own session goes
    tb = kvctest.req("t1-s-B", list(range(30)), session=SimpleNamespace(session_id="s-B"))
    sched.running_batch = _batch([tb])
    view = demand.scheduler_view(sched)
    with pytest.raises(sessions.ReleaseRefused, match="s-B is in use"):  # any reason: a request runs on it
        sessions.release_for_capacity(w.streaming, "s-B", REASON_CONTROL_PLANE, view)
    free = w.alloc.available_size()
    freed = sessions.release_for_capacity(w.streaming, "s-A", REASON_CAPACITY, view)
    assert freed == 48 - before[2][3] and freed > 0
    assert "s-A" not in w.streaming.slots and "s-A" not in kvctest.sessions_of(d)
    assert w.alloc.available_size() == free + freed


def test_non_capacity_release_of_a_waiting_turns_session_goes(dside):
    """The rule is the capacity release's: the control plane's release (the session moved away)
    is not refused for a waiting turn."""
    from kvcentric_sglang import demand, sessions
    from kvcentric_sglang.bridge import REASON_CONTROL_PLANE

    d, w = dside
    sa = _session(w, "s-A", 40)
    _session(w, "s-B", 24)
    sched = SimpleNamespace(waiting_queue=[_next_turn(w, sa, "s-A", 40)], running_batch=_batch([]))
    assert sessions.release_for_capacity(w.streaming, "s-A", REASON_CONTROL_PLANE, demand.scheduler_view(sched)) > 0
    assert "s-A" not in w.streaming.slots


@pytest.mark.parametrize("ready", [True, False], ids=["waiting for pages", "handshaking"])
def test_pd_prealloc_queue_turn_refused_while_another_slot_is_idle(dside, ready):
    """A P/D decode worker: the turn's entry in SGLang's DecodePreallocQueue (ready and without
    pages, or still handshaking with P) is a waiting turn; a turn on the transfer queue is in use."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest, DecodeTransferQueue

    from kvcentric_sglang import demand, sessions
    from kvcentric_sglang.bridge import REASON_CAPACITY

    d, w = dside
    sa = _session(w, "s-A", 40)
    _session(w, "s-B", 24)
    _session(w, "s-C", 24)
    turn = _next_turn(w, sa, "s-A", 40)
    sched = SimpleNamespace(running_batch=_batch([]), last_batch=None, chunked_req=None, waiting_queue=[])
    tq = DecodeTransferQueue.__new__(DecodeTransferQueue)
    tq.queue = []
    pq = DecodePreallocQueue.__new__(DecodePreallocQueue)
    pq.queue = [DecodeRequest(req=turn, kv_receiver=None, waiting_for_input=ready)]
    pq.retracted_queue, pq.pending_reqs = [], []
    pq.scheduler, pq.transfer_queue = sched, tq
    sched.disagg_decode_prealloc_queue, sched.disagg_decode_transfer_queue = pq, tq
    view = demand.scheduler_view(sched)
    assert view.sessions("waiting" if ready else "queued") == {"s-A"}
    # s-B's turn is receiving (the transfer queue): s-C is still idle
    tq.queue = [
        DecodeRequest(
            req=kvctest.req("t1-s-B", list(range(30)), session=SimpleNamespace(session_id="s-B")), kv_receiver=None
        )
    ]
    view = demand.scheduler_view(sched)
    assert view.sessions("in_use") == {"s-B"}
    before = _state(d, w, "s-A")
    with pytest.raises(sessions.ReleaseRefused, match=r"waiting for pages.*1 idle session.*\(s-C\)"):
        sessions.release_for_capacity(w.streaming, "s-A", REASON_CAPACITY, view)
    assert _state(d, w, "s-A") == before
    # s-C's turn runs: nothing else is idle
    sched.running_batch = _batch([kvctest.req("t1-s-C", list(range(30)), session=SimpleNamespace(session_id="s-C"))])
    assert sessions.release_for_capacity(w.streaming, "s-A", REASON_CAPACITY, demand.scheduler_view(sched)) > 0
    assert "s-A" not in w.streaming.slots and "s-A" not in kvctest.sessions_of(d)


def test_sidecar_release_pass_passes_over_the_refusal(sglang_installed, bins, tmp, monkeypatch):
    """The real decode sidecar's capacity release above its watermark ranks the waiting turn's
    session first (the oldest, the largest); the plugin refuses it (ack ok=false, counted in
    kvc_sidecar_release_refused_total) and the next pass takes the idle session instead."""
    from sglang.srt.managers.scheduler import Scheduler

    from test_watch import _ReleaseCluster, _scheduler

    monkeypatch.setenv("KVC_SGLANG_WATCH", "1")
    rc = _ReleaseCluster(bins, tmp, 0.5)
    cp, d, w, wc = rc.cp, rc.d, rc.w, rc.wc
    try:
        # s-A (its next turn waits) 160, s-B 160, s-C 64 tokens: 384 of the pool's 528, above
        # 0.7 (369.6); the low watermark 0.5 (264) needs one 160-token session to go; rank: s-A
        # first (the oldest; as large as s-B, its id first)
        held = {}
        for sid, prompt in (("s-A", 152), ("s-B", 152), ("s-C", 56)):
            cp.set_snapshot_target("d0", sid, "p0")
            held[sid] = _session(w, sid, prompt)
        turn = _next_turn(w, held["s-A"], "s-A", 152)
        # the scheduler loop: SGLang's (hooked) process_input_requests runs the queued commands
        # on the scheduler thread, with the scheduler's requests (s-A's turn waits)
        sched = _scheduler(w, waiting_queue=[turn], running_batch=_batch([]), last_batch=None, chunked_req=None)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and "s-B" in w.streaming.slots:
            wc.wait_for(lambda c: not c.pending.empty(), 1)
            Scheduler.process_input_requests(sched, [])
        assert [s for s in held if s not in w.streaming.slots] == ["s-B"], (cp.events, d.tail())
        refused = kvctest.metrics(d, "kvc_sidecar_release_refused_total")["kvc_sidecar_release_refused_total"]
        assert refused >= 1, d.tail()
        assert [e["session"] for e in cp.events if e["kind"] == "evicted"] == ["s-B"], cp.events
        assert set(kvctest.sessions_of(d)) == {"s-A", "s-C"}
        assert turn.kv is w.streaming.slots["s-A"].kv  # the waiting turn still has its session's KV
    finally:
        rc.close()
        cp.close()
