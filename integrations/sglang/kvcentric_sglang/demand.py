"""The decode worker's prealloc demand -> its sidecar (WorkerBridge ReportDemand).

SGLang never evicts a streaming session for capacity, so a decode worker's requests that wait
for pages wait until its sidecar releases idle sessions; the sidecar releases above its high
watermark, and below it only when it knows requests are waiting for more than the pool has free.
SGLang allocates a request's pages before any PrepareReceive, so the sidecar sees no other sign
of them: the plugin reports them, as kvc-sim's decode worker does.

* ``after_prefill_schedule`` is an AFTER hook of ``Scheduler.get_new_batch_prefill`` (a colocated
  decode worker): the requests still in ``waiting_queue`` once SGLang built its next prefill
  batch wait for room;
* ``after_pop_preallocated`` is an AFTER hook of ``DecodePreallocQueue.pop_preallocated`` (a P/D
  decode worker): the requests whose transfer is ready (``waiting_for_input``) but that got no
  pages wait for room.

Both read the scheduler's requests through ``scheduler_view`` / ``prealloc_view`` (``View``: the
requests waiting for pages, those queued before it, those in use), which the capacity release
reads too (sessions.release_for_capacity: a session whose turn waits is not released while
another session holding KV is idle). Each computes the waiting requests, the tokens they need
(whole pages of the uncached context plus the output SGLang reserves), the tokens the pool can
give without releasing a session (free pages plus the radix cache's evictable ones) and the
worker's unevictable KV (the committed KV of the streaming sessions its running, pre-allocated
or receiving requests are using: a turn that only waits does not pin its session) and its
running requests (the in-use requests: running, pre-allocated or receiving), and hands
them to the process's ``DemandReporter``, which sends a report only when they changed (0 waiting
once, when the queue drained), off the scheduler thread.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable, List, NamedTuple, Optional, Set, Tuple

from . import runtime
from .bridge import BridgeError

logger = logging.getLogger(__name__)

# SGLang's CLIP_MAX_NEW_TOKENS default: the output it reserves per request at most.
MAX_NEW_RESERVED = 4096
REPORT_TIMEOUT_S = 2.0

# waiting requests, tokens they need, tokens free, unevictable tokens, running requests
Demand = Tuple[int, int, int, int, int]


class DemandReporter:
    """Sends the latest demand to the sidecar from a thread of its own: ``observe`` never blocks
    the scheduler; a report that failed is sent again with the next change (or the next
    observation)."""

    def __init__(self, bridge, timeout_s: float = REPORT_TIMEOUT_S):
        self.bridge = bridge
        self.timeout_s = timeout_s
        self.reports = 0  # sent
        self.errors = 0
        self.last: Optional[Demand] = None  # last report the sidecar took
        self._want: Optional[Demand] = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvc-demand", daemon=True)
        self._thread.start()

    def observe(self, requests: int, tokens: int, free: int, unevictable: int = 0, running: int = 0) -> None:
        if requests <= 0:
            requests, tokens, free = 0, 0, 0  # nothing waits: the free room is no demand's business
        d = (int(requests), int(tokens), int(free), max(0, int(unevictable)), max(0, int(running)))
        with self._cv:
            if d == self._want:
                return
            if self.last is None and self._want is None and d == (0, 0, 0, 0, 0):
                return  # nothing ever waited, ran or was in use
            self._want = d
            self._cv.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until the sidecar took the latest observation (tests, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._want is None or self._want == self.last, timeout_s)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stop or (self._want is not None and self._want != self.last))
                if self._stop:
                    return
                d = self._want
            try:
                self.bridge.report_demand(*d, timeout_s=self.timeout_s)
            except BridgeError as e:
                self.errors += 1
                logger.warning("kvcentric: ReportDemand %s: %s", d, e)
                with self._cv:
                    self.last = None  # unknown to the sidecar: the next observation reports again
                    self._cv.wait(1.0)
                continue
            with self._cv:
                self.last = d
                self.reports += 1
                self._cv.notify_all()


def start_for_process(bridge) -> Optional[DemandReporter]:
    """The process's reporter (a decode worker's, once its pool is registered)."""
    if runtime.state.demand is None:
        runtime.state.demand = DemandReporter(bridge)
    return runtime.state.demand


def _round(tokens: int, page: int) -> int:
    return (max(0, tokens) + page - 1) // page * page


def need_of(req, page: int) -> int:
    """The tokens (whole pages) a request still needs: its uncached context plus the output
    SGLang reserves for it."""
    n = len(req.origin_input_ids) + len(getattr(req, "output_ids", None) or ())
    prefix = int(getattr(req, "prefix_len", 0) or 0)
    sp = getattr(req, "sampling_params", None)
    new = min(int(getattr(sp, "max_new_tokens", 0) or 0), MAX_NEW_RESERVED)
    return _round(n - prefix + new, page)


def free_of(allocator, tree_cache) -> int:
    """Tokens the pool gives without releasing a session: free pages and the radix cache's
    evictable ones (streaming sessions' KV is not evictable)."""
    free = int(allocator.available_size()) if allocator is not None else 0
    ev = getattr(tree_cache, "evictable_size", None)
    if callable(ev):
        try:
            free += int(ev())
        except Exception:  # a disabled cache
            pass
    return free


def pinned_of(req) -> int:
    """The committed KV of the streaming session a request in use holds (its prefix: the
    session's KV before this turn), 0 for a request without a session."""
    if getattr(req, "session", None) is None:
        return 0
    kv = getattr(req, "kv", None)
    return max(0, int(getattr(req, "prefix_len", 0) or 0), int(getattr(kv, "cache_protected_len", 0) or 0))


def report(reqs: Iterable, page: int, allocator, tree_cache, in_use: Iterable = ()) -> Optional[Demand]:
    """Observes the demand of these waiting requests, the sessions the requests in_use pin and
    how many those are (running_requests; None when this process reports none)."""
    r = runtime.state.demand
    if r is None or runtime.state.role != "decode":
        return None
    reqs, in_use = list(reqs), list(in_use)
    d = (
        len(reqs),
        sum(need_of(x, page) for x in reqs),
        free_of(allocator, tree_cache),
        sum(pinned_of(x) for x in in_use),
        len(in_use),
    )
    r.observe(*d)
    return d


def _batch_reqs(batch) -> list:
    return list(getattr(batch, "reqs", None) or ()) if batch is not None else []


class View(NamedTuple):
    """The scheduler's requests by what they do with the pool: ``waiting`` for pages (the
    demand's), ``queued`` before that (a P/D prealloc entry still handshaking, a retracted
    request), ``in_use`` (running: the running batch, the last batch still in flight, a chunked
    prefill; pre-allocated or receiving: the transfer queue, transferred requests not yet in a
    batch). Finished requests are in none."""

    waiting: List
    queued: List
    in_use: List

    def sessions(self, which: str) -> Set[str]:
        """The session ids of the requests of one part (the streaming session's and the kvc hint's)."""
        out: Set[str] = set()
        for r in getattr(self, which):
            out.update(session_ids_of(r))
        return out


def session_ids_of(req) -> Set[str]:
    ids = set()
    sid = getattr(getattr(req, "session", None), "session_id", None)
    if sid:
        ids.add(sid)
    try:
        h = runtime.hint_of_req(req)
    except ValueError:
        h = None
    if h is not None and h.session_id:
        ids.add(h.session_id)
    return ids


def _live(reqs) -> List:
    """reqs without finished ones and duplicates (a prefill batch merged into the running batch
    is the last batch too)."""
    out, seen = [], set()
    for r in reqs:
        if r is None or id(r) in seen:
            continue
        seen.add(id(r))
        fin = getattr(r, "finished", None)
        if callable(fin) and fin():
            continue
        out.append(r)
    return out


def _running(scheduler) -> List:
    """Running requests: the running batch, the last batch (in flight until its result is
    processed: a prefill batch is merged into the running batch only at the next schedule) and a
    chunked prefill."""
    if scheduler is None:
        return []
    return (
        _batch_reqs(getattr(scheduler, "running_batch", None))
        + _batch_reqs(getattr(scheduler, "last_batch", None))
        + [getattr(scheduler, "chunked_req", None)]
    )


def prealloc_view(queue, popped: Iterable = ()) -> View:
    """A P/D decode worker's view from its DecodePreallocQueue (``popped``: the entries the last
    pop_preallocated pre-allocated, not yet on the transfer queue)."""
    entries = list(getattr(queue, "queue", ()) or ())
    sched = getattr(queue, "scheduler", None)
    waiting = [d.req for d in entries if getattr(d, "waiting_for_input", False)]
    queued = [d.req for d in entries if not getattr(d, "waiting_for_input", False)]
    queued += list(getattr(queue, "retracted_queue", ()) or ())
    in_use = _running(sched) + [d.req for d in popped or ()]
    in_use += [d.req for d in getattr(getattr(queue, "transfer_queue", None), "queue", ()) or ()]
    in_use += list(getattr(sched, "waiting_queue", ()) or ())  # transferred, not yet in a batch
    return View(_live(waiting), _live(queued), _live(in_use))


def scheduler_view(scheduler, scheduled=None) -> View:
    """The view of a decode scheduler: its prealloc queue's on a P/D decode worker, else (a
    colocated worker) ``waiting_queue`` waits and ``scheduled`` (a prefill batch just built) is
    in use beside the running requests."""
    pq = getattr(scheduler, "disagg_decode_prealloc_queue", None)
    if pq is not None:
        return prealloc_view(pq)
    waiting = list(getattr(scheduler, "waiting_queue", ()) or ())
    return View(_live(waiting), [], _live(_running(scheduler) + _batch_reqs(scheduled)))


def after_prefill_schedule(result, scheduler, *args, **kwargs):
    """AFTER Scheduler.get_new_batch_prefill: what is left in the waiting queue waits for room."""
    try:
        v = scheduler_view(scheduler, result)
        report(
            v.waiting,
            int(getattr(scheduler, "page_size", 1) or 1),
            getattr(scheduler, "token_to_kv_pool_allocator", None),
            getattr(scheduler, "tree_cache", None),
            v.in_use,
        )
    except Exception:  # never the scheduler's failure
        logger.exception("kvcentric: demand report")
    return result


def after_pop_preallocated(result, queue, *args, **kwargs):
    """AFTER DecodePreallocQueue.pop_preallocated: ready transfers that got no pages wait."""
    try:
        alloc = getattr(queue, "token_to_kv_pool_allocator", None)
        v = prealloc_view(queue, result[0] if isinstance(result, tuple) and result else ())
        report(v.waiting, int(getattr(alloc, "page_size", 1) or 1), alloc, getattr(queue, "tree_cache", None), v.in_use)
    except Exception:
        logger.exception("kvcentric: demand report")
    return result
