"""ReportDemand: a decode worker's requests that wait for pages reach its real decode sidecar
(its prealloc gauges), from SGLang's waiting queue on a colocated worker (the
get_new_batch_prefill hook) and from the prealloc queue of a P/D decode worker (the
pop_preallocated hook); a report goes out only on a change, and once with 0 waiting when the
queue drained."""

from types import SimpleNamespace

import pytest

import kvctest
from kvctest import PAGE


@pytest.fixture
def reporting(dside):
    """dside as a decode process: its role decode and its DemandReporter on the worker's bridge.
    Yields (sidecar, worker, reporter)."""
    from kvcentric_sglang import demand, runtime

    d, w = dside
    runtime.state.role = "decode"
    yield d, w, demand.start_for_process(w.bridge)


def gauges(d):
    names = (
        "kvc_sidecar_prealloc_waiting_requests",
        "kvc_sidecar_prealloc_waiting_tokens",
        "kvc_sidecar_prealloc_free_tokens",
        "kvc_sidecar_demand_reports_total",
        "kvc_sidecar_worker_unevictable_tokens",
        "kvc_sidecar_worker_running_requests",
    )
    return {name.split("kvc_sidecar_")[1]: v for name, v in kvctest.metrics(d, *names).items()}


def test_hooks_are_the_demand_reporters(sglang_installed):
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.managers.scheduler import Scheduler

    assert getattr(Scheduler.get_new_batch_prefill, "__wrapped__", None) is not None
    assert getattr(DecodePreallocQueue.pop_preallocated, "__wrapped__", None) is not None


def test_colocated_waiting_queue_is_reported(reporting):
    from kvcentric_sglang import demand

    d, w, rep = reporting
    free = w.alloc.available_size()
    # two requests SGLang could not admit: 100 + 8 tokens -> 112, and 40 + 8 (20 already cached) -> 32
    r1 = kvctest.req("w1", list(range(100)))
    r2 = kvctest.req("w2", list(range(40)))
    r2.prefix_len = 20
    sched = SimpleNamespace(
        waiting_queue=[r1, r2], page_size=PAGE, token_to_kv_pool_allocator=w.alloc, tree_cache=w.cache
    )
    assert demand.after_prefill_schedule("batch", sched) == "batch"  # the hook returns SGLang's result
    assert rep.flush()
    g = gauges(d)
    assert (g["prealloc_waiting_requests"], g["prealloc_waiting_tokens"], g["prealloc_free_tokens"]) == (
        2,
        112 + 32,
        free,
    ), g
    assert g["demand_reports_total"] == 1
    demand.after_prefill_schedule(None, sched)  # nothing changed: no report
    assert rep.flush() and gauges(d)["demand_reports_total"] == 1
    sched.waiting_queue = []  # admitted: the queue drained, reported once
    demand.after_prefill_schedule(None, sched)
    demand.after_prefill_schedule(None, sched)
    assert rep.flush()
    g = gauges(d)
    assert (g["prealloc_waiting_requests"], g["prealloc_waiting_tokens"], g["demand_reports_total"]) == (0, 0, 2), g
    assert rep.reports == 2 and rep.errors == 0
    # running: a streaming session's turn on its 48 committed tokens pins them; a plain request
    # pins nothing; the unevictable KV alone changing is reported too
    turn = kvctest.req("run-1", list(range(60)), session=SimpleNamespace(session_id="s-run"))
    turn.prefix_len = 48
    sched.running_batch = SimpleNamespace(reqs=[turn, kvctest.req("run-2", list(range(30)))])
    demand.after_prefill_schedule(None, sched)
    assert rep.flush()
    g = gauges(d)
    assert (g["prealloc_waiting_requests"], g["worker_unevictable_tokens"], g["demand_reports_total"]) == (0, 48, 3), g
    assert g["worker_running_requests"] == 2, g  # both run (running_requests)
    # the prefill batch SGLang just built runs too (a turn on 32 committed tokens), and the last
    # batch, already merged into the running batch, counts once
    fresh = kvctest.req("run-3", list(range(40)), session=SimpleNamespace(session_id="s-new"))
    fresh.prefix_len = 32
    sched.last_batch = sched.running_batch
    demand.after_prefill_schedule(SimpleNamespace(reqs=[fresh]), sched)
    assert rep.flush()
    g = gauges(d)
    assert (g["worker_unevictable_tokens"], g["demand_reports_total"], g["worker_running_requests"]) == (
        48 + 32,
        4,
        3,
    ), g


def test_pd_decode_prealloc_queue_is_reported(reporting):
    """The prealloc queue's ready transfers that got no pages wait; those still handshaking do
    not count yet."""
    from kvcentric_sglang import demand

    d, w, rep = reporting
    ready = SimpleNamespace(req=kvctest.req("p1", list(range(70)), max_new_tokens=10), waiting_for_input=True)
    shaking = SimpleNamespace(req=kvctest.req("p2", list(range(500))), waiting_for_input=False)
    q = SimpleNamespace(queue=[ready, shaking], token_to_kv_pool_allocator=w.alloc, tree_cache=w.cache)
    out = ([], [])
    assert demand.after_pop_preallocated(out, q) is out
    assert rep.flush()
    g = gauges(d)
    assert (g["prealloc_waiting_requests"], g["prealloc_waiting_tokens"]) == (1, 80), g
    # a transferred turn in the scheduler's waiting queue (not yet in a batch) holds its
    # session's 64 committed tokens
    moved = kvctest.req("p3", list(range(80)), session=SimpleNamespace(session_id="s-moved"))
    moved.prefix_len = 64
    q.scheduler = SimpleNamespace(running_batch=None, waiting_queue=[moved])
    demand.after_pop_preallocated(out, q)
    assert rep.flush()
    g = gauges(d)
    assert (g["prealloc_waiting_requests"], g["worker_unevictable_tokens"], g["worker_running_requests"]) == (
        1,
        64,
        1,
    ), g


def test_prefill_worker_reports_nothing(reporting):
    from kvcentric_sglang import demand, runtime

    d, w, rep = reporting
    runtime.state.role = "prefill"
    sched = SimpleNamespace(
        waiting_queue=[kvctest.req("x", list(range(30)))],
        page_size=PAGE,
        token_to_kv_pool_allocator=w.alloc,
        tree_cache=w.cache,
    )
    demand.after_prefill_schedule(None, sched)
    assert rep.flush() and rep.reports == 0
