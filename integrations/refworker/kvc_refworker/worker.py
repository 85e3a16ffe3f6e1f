"""The reference worker: real attention KV in a paged pool, moved by the real sidecars.

Prefill role: prefill every input token in one forward, write the KV into the pool's pages,
SendKV them to the decode side of the room, free them (release-after-transfer).

Decode role, by the fields of the request's ExecutionPayload (docs/interfaces.md; the mode is
only a label):
- no receive, no local_prefill (a direct turn): the session's resident KV, up to the longest
  common prefix of its tokens and the prompt, is gathered from the pool; the rest of the prompt
  is append-prefilled on it.
- a SEED receive: PrepareReceive(SEED) + WaitReceive: P's KV lands in this worker's pages (a new
  session with open_session, a copy held here dropped first; the held session extended with
  keep_session and no open_session, a large append); the first token is computed here from the
  received KV unless P's first token came with the transfer (its aux row: SendKV's aux, what
  SGLang's decode worker reads from P's metadata buffer), which is emitted at once: the
  session's pages are gathered into the dense cache only for the decode step after it.
- a SNAPSHOT receive: PrepareReceive(SNAPSHOT): the prefill sidecar writes the session's snapshot
  (D->P pushes of the real KV of an earlier decode worker); the tail is append-prefilled.
- local_prefill: the whole prompt is prefilled here.
Then greedy decode steps (each new token's KV scattered into the pool), and with keep_session
the session is trimmed to input + output tokens and committed (CommitSession): the decode
sidecar pushes D->P snapshots of exactly these bytes.

With verify_recompute every request is recomputed from scratch in the same worker (one full
prefill of the prompt, then the same decode steps, teacher-forced on the tokens served) and
compared: see Verifier.
"""

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from kvcentric_sglang.bridge import REASON_CAPACITY, TRANSFER_SEED, TRANSFER_SNAPSHOT, BridgeError

from . import model as M
from .pool import KVPool, pages_for
from .request import Plan, scripted_tokens
from .transport import TransferError

log = logging.getLogger("kvc_refworker")


class DeviceActivity:
    """Served requests in flight on one GPU, across the worker processes that share it: each
    process keeps its count in a file of its own, <dir>/<pid>, that the others read. A recompute
    check (low priority) waits until every process sharing the device is idle, so that it does
    not time-slice the GPU with another worker's request (the TTFTs a run reports). A file of a
    process that no longer exists counts as idle."""

    def __init__(self, directory: str):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, str(os.getpid()))
        self.set(0)

    def set(self, n: int) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(n))
        os.replace(tmp, self.path)

    def others_busy(self) -> bool:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return False
        me = str(os.getpid())
        for name in names:
            if not name.isdigit() or name == me:
                continue
            try:
                os.kill(int(name), 0)
                with open(os.path.join(self.dir, name)) as f:
                    if int(f.read().strip() or "0") > 0:
                        return True
            except (OSError, ValueError):
                continue
        return False

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass


class GpuLock:
    """One forward at a time on this worker's device, served requests first: a recompute
    check's forward (low priority) starts only when no served request is in flight on this
    worker nor, with a DeviceActivity, on any other worker process sharing the device (or after
    max_defer_s), so the check does not sit in front of a request's TTFT. A check's forward
    already running still delays a request that arrives meanwhile."""

    def __init__(self, max_defer_s: float = 30.0, shared: Optional[DeviceActivity] = None):
        self.cv = threading.Condition()
        self.held = False
        self.active = 0  # served requests in flight (begin .. last token)
        self.max_defer_s = max_defer_s
        self.shared = shared

    def _busy(self) -> bool:
        return self.active > 0 or (self.shared is not None and self.shared.others_busy())

    def acquire(self, low: bool = False, defer_until: Optional[float] = None) -> None:
        """low: a recompute check's forward, deferred while served requests are in flight until
        defer_until (a check's whole deferral is bounded, not each of its forwards') or, without
        it, max_defer_s from now."""
        with self.cv:
            if low:
                deadline = defer_until if defer_until is not None else time.monotonic() + self.max_defer_s
                while self.held or (self._busy() and time.monotonic() < deadline):
                    # other processes do not notify this condition: poll them every 10 ms
                    self.cv.wait(timeout=max(0.005, min(0.01 if self.shared else 0.5, deadline - time.monotonic())))
            else:
                while self.held:
                    self.cv.wait()
            self.held = True

    def release(self) -> None:
        with self.cv:
            self.held = False
            self.cv.notify_all()

    def enter(self) -> None:
        with self.cv:
            self.active += 1
            if self.shared is not None:
                self.shared.set(self.active)

    def leave(self) -> None:
        with self.cv:
            self.active -= 1
            if self.shared is not None:
                self.shared.set(self.active)
            self.cv.notify_all()


class ApiError(Exception):
    def __init__(self, status: int, code: str, msg: str):
        super().__init__(msg)
        self.status, self.code, self.msg = status, code, msg


def _ms(dt: float) -> float:
    return round(dt * 1000.0, 3)


@dataclass
class Config:
    role: str
    worker_id: str
    model_name: str
    transfer_timeout_s: float = 60.0
    prealloc_wait_s: float = 0.0
    verify_recompute: bool = False
    atol: float = 1e-4  # logits and KV, allclose modes; bitwise where the arithmetic allows
    bitwise_strict: bool = True
    verify_max_steps: int = 16  # decode steps compared (0: all)
    device_activity_dir: str = ""  # DeviceActivity's directory ("" : this process only)
    snapshot_wait_s: float = 2.5  # how long eviction passes over sessions whose snapshot push is pending


@dataclass
class Session:
    id: str
    pages: List[int]
    kv_len: int = 0
    # the token id of each position of the KV held; None where this worker holds KV it has no
    # ids of (a session loaded from the prefill store by a LoadSessionCommand whose snapshot was
    # pushed without ids)
    tokens: List[Optional[int]] = field(default_factory=list)
    pinned: int = 0
    # of pinned: turns waiting in allocate for more pages (the session's KV untouched meanwhile):
    # release_for_capacity may take the session from under them (they then answer 409)
    waiting: int = 0
    committed: bool = False
    last_used: float = 0.0
    turn_lock: threading.Lock = field(default_factory=threading.Lock)
    gone: bool = False


def known_ids(tokens: List[Optional[int]], n: int) -> Optional[List[int]]:
    """The ids of [0, n) of a session's KV when every one is known (a commit's token_ids), else None."""
    ids = tokens[:n]
    return list(ids) if len(ids) == n and None not in ids else None


class Turn:
    """One decode request in flight."""

    def __init__(self, p: Plan, ids: List[int]):
        self.p, self.ids = p, ids
        self.meta: Dict = {}
        self.s: Optional[Session] = None
        self.pages: List[int] = []  # anonymous requests
        self.cache = None  # DynamicCache of the served path
        self.kv = 0  # tokens of KV held in the pool for this turn
        self.logits: List[torch.Tensor] = []  # served logits per step (verify only)
        self.fed: List[int] = []  # token placed at position n + i after step i
        self.out: List[int] = []  # greedy tokens served
        self.pending: Optional[torch.Tensor] = None  # logits of the next token to emit
        self.active = False  # counted in the worker's served requests in flight
        self.aux = None  # (first token, its logit) from P's aux row
        self.lazy_cache = 0  # tokens of the pool to gather as the cache before the first forward
        self.received_at = 0.0  # monotonic time the receive ended (first_step_ms counts from it)
        self.pending_token: Optional[int] = None  # step 0's token when it came from P
        self.first_local = False  # step 0 computed here from received KV (allclose, not bitwise)
        self.bitwise = False  # the KV came from a full prefill (P's): decode from it is bitwise
        self.start = 0  # tokens of resident/received KV the append-prefill started from
        self.dirty = False  # resident KV of the session was overwritten (a failure must drop it)
        self.extend = False
        self.unlock: Optional[Callable[[], None]] = None
        self.finished = False

    def page_list(self) -> List[int]:
        return self.s.pages if self.s is not None else self.pages


class Worker:
    def __init__(self, cfg: Config, model, spec: M.ModelSpec, pool: KVPool, xfer):
        self.cfg, self.model, self.spec, self.pool, self.xfer = cfg, model, spec, pool, xfer
        shared = DeviceActivity(cfg.device_activity_dir) if cfg.device_activity_dir else None
        self.gpu = GpuLock(shared=shared)  # one forward at a time (one GPU), served requests first
        self._tls = threading.local()  # per request thread: time waited for the device and for pages
        self.mu = threading.Condition()
        self.sessions: Dict[str, Session] = {}
        self._turn_locks: Dict[str, threading.Lock] = {}
        self._allocating = 0  # served requests in allocate, waiting for pages: not running
        # A decode worker's DemandReporter (kvcentric_sglang.demand, set by the cli): its running
        # requests go to the sidecar (ReportDemand running_requests, the load report's).
        self.demand = None
        self.stats = {
            "requests": 0,
            "errors": 0,
            "recompute_checked": 0,
            "recompute_mismatches": 0,
            "evictions": 0,
            "releases_without_sidecar": 0,
            "received_bytes": 0,
            "sent_bytes": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
        }

    @property
    def capacity_tokens(self) -> int:
        return self.pool.size

    # -- compute ------------------------------------------------------------------------------

    def _waited(self, what: str, dt: float) -> None:
        setattr(self._tls, what, getattr(self._tls, what, 0.0) + dt)

    def _sync(self) -> None:
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)

    def _forward(self, ids, cache, all_logits=False, low=False, defer_until=None):
        w0 = time.monotonic()
        self.gpu.acquire(low, defer_until)
        if not low:
            self._waited("gpu", time.monotonic() - w0)
        try:
            logits, cache = M.forward(self.model, ids, cache, all_logits)
            if logits.is_cuda:
                torch.cuda.synchronize(logits.device)
            return logits, cache
        finally:
            self.gpu.release()

    def _cache_from_pool(self, pages, end: int):
        k, v = self.pool.gather(pages, 0, end)
        return M.new_cache(self.model, k, v)

    def _write_back(self, pages, cache, start: int, end: int) -> None:
        if end <= start:
            return
        ks, vs = [], []
        for l in range(self.spec.num_layers):
            k, v = M.cache_kv(cache, l, start, end)
            ks.append(k)
            vs.append(v)
        self.pool.scatter(pages, start, ks, vs)

    def tokens_for(self, p: Plan) -> List[int]:
        if p.ids is not None:
            return list(p.ids)
        return scripted_tokens(p.seed_key, 0, p.input, self.spec.vocab_size)

    # -- pages and sessions ---------------------------------------------------------------------

    def _touch(self, s: Session) -> None:
        s.last_used = time.monotonic()

    def running_requests(self) -> int:
        """Served requests holding their pages: in flight (begin .. last token) and not in an
        allocation."""
        with self.gpu.cv:
            active = self.gpu.active
        with self.mu:
            return max(0, active - self._allocating)

    def _report_running(self) -> None:
        """Hands the running requests to the reporter (it sends only changes, off this thread)."""
        if self.demand is not None:
            self.demand.observe(0, 0, 0, 0, running=self.running_requests())

    def allocate(self, n: int, for_session: str, contiguous: bool = False) -> (List[int], int):
        """n pages (see _allocate); the request does not run meanwhile (running_requests)."""
        with self.mu:
            self._allocating += 1
        self._report_running()
        try:
            return self._allocate(n, for_session, contiguous)
        finally:
            with self.mu:
                self._allocating -= 1
            self._report_running()

    def _allocate(self, n: int, for_session: str, contiguous: bool = False) -> (List[int], int):
        """n pages, evicting least-recently-used idle sessions (ReleaseSession(EVICTED) first,
        then free); 503 no_capacity when even that cannot make room (after prealloc_wait). With
        contiguous, consecutive pages when the pool has such a run (KVPool.alloc_contiguous)."""
        evicted = 0
        t0 = time.monotonic()
        deadline = t0 + self.cfg.prealloc_wait_s
        # Until then, only sessions whose snapshot holds all their KV are evicted (see
        # _snapshot_pending); after it, least recently used first whatever their snapshot.
        snap_deadline = t0 + min(self.cfg.snapshot_wait_s, self.cfg.prealloc_wait_s)
        while True:
            pages = self.pool.alloc_contiguous(n) if contiguous else self.pool.alloc(n)
            if pages is not None:
                self._waited("alloc", time.monotonic() - t0)
                return pages, evicted
            with self.mu:
                idle = sorted(
                    (s for s in self.sessions.values() if s.pinned == 0 and s.id != for_session),
                    key=lambda s: s.last_used,
                )
            picky = time.monotonic() < snap_deadline
            pending = {s.id for s in idle if self._snapshot_pending(s)} if picky else set()
            with self.mu:
                victims, room = [], self.pool.free_pages
                held = 0  # pages of idle sessions passed over for their pending push
                for s in idle:
                    if room >= n:
                        break
                    if s.pinned or s.gone or self.sessions.get(s.id) is not s:
                        continue
                    if s.id in pending:
                        held += len(s.pages)
                        continue
                    victims.append(s)
                    room += len(s.pages)
                if room < n:
                    victims = []
                    if room + held >= n:  # room once those pushes are done: look again shortly
                        self.mu.wait(timeout=max(0.0, min(0.02, snap_deadline - time.monotonic())))
                        continue
                for s in victims:
                    del self.sessions[s.id]
                    s.gone = True
                if not victims:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ApiError(
                            503,
                            "no_capacity",
                            "%d pages needed, %d free and no idle session to evict on %s"
                            % (n, self.pool.free_pages, self.cfg.worker_id),
                        )
                    self.mu.wait(timeout=min(left, 0.5))
                    continue
            for s in victims:
                self._release_and_free(s, evicted=True)
                evicted += 1
                self.stats["evictions"] += 1

    def _snapshot_pending(self, s: Session) -> bool:
        """Whether the decode sidecar has a snapshot target for s and has not pushed all of its
        committed KV yet (SnapshotStatus). Evicting such a session aborts its push, and its next
        turn re-prefills instead of reseeding from the snapshot (SNAPSHOT_MISSING), so eviction
        passes over it for up to snapshot_wait_s."""
        bridge = getattr(self.xfer, "bridge", None)
        if not s.committed or bridge is None or self.cfg.snapshot_wait_s <= 0:
            return False
        try:
            st = bridge.snapshot_status(s.id)
        except Exception:  # noqa: BLE001 - unknown to the sidecar (never committed there): no push to wait for
            return False
        return bool(st.prefill_worker) and st.last_pushed_len < s.kv_len

    def _release_and_free(self, s: Session, evicted: bool) -> None:
        try:
            self.xfer.release(s.id, evicted)
        except BridgeError as e:
            if "UNAVAILABLE" in str(e.code):
                # The sidecar is gone (nothing listens on its socket): it reads no pages any more,
                # and a restarted one knows only what is re-committed, so the worker evicts on its
                # own; the sidecar's resync then lists the session no more (issue 23 item 1).
                log.warning("ReleaseSession %s: sidecar gone (%s); freeing its %d pages", s.id, e, len(s.pages))
                self.stats["releases_without_sidecar"] += 1
            elif "NOT_FOUND" not in str(e.code):
                # The sidecar may still read these pages: never reuse them.
                log.error("ReleaseSession %s failed (%s); quarantining %d pages", s.id, e, len(s.pages))
                s.pages = []
                return
        self.pool.free(s.pages)
        s.pages = []
        with self.mu:
            self.mu.notify_all()

    def drop_session(self, s: Session) -> None:
        with self.mu:
            if self.sessions.get(s.id) is s:
                del self.sessions[s.id]
            s.gone = True
        self._release_and_free(s, evicted=False)

    @staticmethod
    def held_prefix(s: Session, ids: List[int], trust: int) -> int:
        """Tokens of s's KV that are a prefix of ids: positions whose ids it holds must match
        (continuity on content, DESIGN §7); positions it holds without ids (a session loaded
        from the store) count only below `trust`, what the control plane says is cached (its
        decision on the prompt's page hashes when the gateway sends ids). The recompute check
        then holds the reuse to a full prefill of ids."""
        lcp = 0
        for a, b in zip(s.tokens[: s.kv_len], ids):
            if a is None:
                if lcp >= trust:
                    break
            elif a != b:
                break
            lcp += 1
        return lcp

    def _lock_turn(self, sid: str) -> Callable[[], None]:
        # Turns of one session are serialized (SGLang streaming sessions are sequential).
        with self.mu:
            lk = self._turn_locks.setdefault(sid, threading.Lock())
        lk.acquire()
        return lk.release

    # -- the sidecar's WatchCommands (kvcentric_sglang.watch.WatchClient callbacks) -------------

    def release_for_capacity(self, sid: str, reason: int = REASON_CAPACITY) -> int:
        """A release command: frees a session (ReleaseSession EVICTED first); returns the tokens
        freed. Refused (the sidecar passes over it and picks another) while a turn runs on the
        session, and for a capacity release while its only turns wait for pages (Session.waiting)
        and another committed session no turn uses could go instead: releasing the waiting turn's
        own session would turn a turn needing a few pages into a reseed of its whole context
        into the same full pool (issue 20; kvc-sim's rule). With no such session it goes: the
        waiting turn then answers 409 (_alloc_for_turn) and is re-decided."""
        with self.mu:
            s = self.sessions.get(sid)
            if s is None:
                return 0
            if s.pinned > s.waiting:
                raise RuntimeError("session %s is in use by %d running turn(s)" % (sid, s.pinned - s.waiting))
            if s.waiting and reason == REASON_CAPACITY:
                idle = sorted(
                    o.id
                    for o in self.sessions.values()
                    if o is not s and o.pinned == 0 and o.committed and o.pages and not o.gone
                )
                if idle:
                    raise RuntimeError(
                        "session %s has %d turn(s) waiting for pages, and %d idle session(s) can be "
                        "released instead (%s)" % (sid, s.waiting, len(idle), ", ".join(idle[:3]))
                    )
            del self.sessions[sid]
            s.gone = True
            freed = s.kv_len
        self._release_and_free(s, evicted=True)
        self.stats["evictions"] += 1
        return freed

    def truncate(self, sid: str, keep_tokens: int) -> int:
        """A truncate command: keeps the first keep_tokens tokens of an idle session, frees the
        rest and commits the shorter length; returns the tokens freed."""
        lock = self._lock_turn(sid)
        try:
            with self.mu:
                s = self.sessions.get(sid)
                if s is None:
                    return 0
                if s.pinned > 0:
                    raise RuntimeError("session %s is in use" % sid)
                s.pinned += 1
            try:
                keep = max(0, min(keep_tokens, s.kv_len))
                freed = s.kv_len - keep
                pages = self._trim(s, keep)
                s.tokens = s.tokens[:keep]
                self.xfer.commit(s.id, keep, pages, known_ids(s.tokens, keep))
                return freed
            finally:
                with self.mu:
                    s.pinned -= 1
                    self.mu.notify_all()
        finally:
            lock()

    def recommit_all(self) -> None:
        """After a sidecar restart re-attached: every resident session committed again."""
        with self.mu:
            held = [
                (s.id, s.kv_len, list(s.pages), known_ids(s.tokens, s.kv_len))
                for s in self.sessions.values()
                if s.committed
            ]
        for sid, n, pages, ids in held:
            try:
                self.xfer.commit(sid, n, pages, ids)
            except BridgeError as e:
                log.error("re-commit of %s: %s", sid, e)

    def close_session(self, sid: str) -> bool:
        """Releases the session once its running turn (if any) ended; False when not held."""
        unlock = self._lock_turn(sid)
        try:
            with self.mu:
                s = self.sessions.get(sid)
                if s is not None:
                    s.pinned += 1  # no eviction while the sidecar is told
            if s is None:
                return False
            self.drop_session(s)
            with self.mu:
                s.pinned -= 1
            return True
        finally:
            unlock()

    def session_list(self) -> List[Dict]:
        with self.mu:
            return [
                {
                    "session_id": s.id,
                    "kv_len": s.kv_len,
                    "pages": len(s.pages),
                    "pinned": s.pinned,
                    "waiting": s.waiting,
                    "committed": s.committed,
                    "tokens_known": sum(x is not None for x in s.tokens[: s.kv_len]),
                }
                for s in self.sessions.values()
            ]

    # -- prefill role ---------------------------------------------------------------------------

    def serve_prefill(self, p: Plan) -> Dict:
        ids = self.tokens_for(p)
        meta = {"mode": p.mode, "role": "prefill", "worker_id": self.cfg.worker_id}
        if p.priority:
            meta["priority"] = p.priority  # the request's SGLang priority, passed through
        # Consecutive pages (P's pool is mostly free): the store's load is then one copy per
        # buffer, the gather and the scatter one slice each, as limit.py measures them.
        pages, _ = self.allocate(pages_for(p.input, self.pool.page_size), "", contiguous=True)
        meta["pages_contiguous"] = self.pool.contiguous_slots(pages, 0, p.input) is not None
        self.gpu.enter()  # a served request: recompute checks of workers sharing the GPU wait
        try:
            t0 = time.monotonic()
            start = self._load_prefix(p, pages, meta)  # prefill from the snapshot: [0, start) from the store
            # Per-phase times (each phase ends with the device idle): where P's time goes.
            tg = time.monotonic()
            cache = self._cache_from_pool(pages, start) if start else M.new_cache(self.model)
            self._sync()
            tf = time.monotonic()
            logits, cache = self._forward(ids[start:], cache)  # the last position's logits only
            ts = time.monotonic()
            self._write_back(pages, cache, start, p.input)
            self._sync()
            del cache
            t1 = time.monotonic()
            meta["gather_ms"], meta["forward_ms"], meta["scatter_ms"] = _ms(tf - tg), _ms(ts - tf), _ms(t1 - ts)
            meta["prefill_tokens"] = p.input - start
            meta["prefill_ms"] = _ms(t1 - t0)
            first = int(logits.argmax())
            meta["first_token"] = first
            self.stats["prefill_tokens"] += p.input - start
            t1 = time.monotonic()
            first_page = p.receive_from // self.pool.page_size  # a suffix-only receive: D holds the pages before
            try:
                sent = self.xfer.send(
                    p.room, p.seed_key, pages, p.input, first, float(logits[first]), first_page=first_page
                )
            except TransferError as e:
                raise ApiError(502, "transfer_failed", str(e)) from e
            meta["sent_bytes"] = sent
            meta["transfer_real_ms"] = meta["transfer_ms"] = meta["send_ms"] = _ms(time.monotonic() - t1)
            self.stats["sent_bytes"] += sent
        finally:
            self.gpu.leave()
            self.pool.free(pages)
            with self.mu:
                self.mu.notify_all()
        return meta

    def _load_prefix(self, p: Plan, pages: List[int], meta: Dict) -> int:
        """Prefill from the snapshot (kv_hints load_prefix_tokens): the sidecar copies whole pages
        of the session's snapshot, [0, n), from its store into this worker's pages; the prefill
        then runs over the rest with that KV as its cache. Returns n (0 when nothing was loaded:
        no hint, or the store could not serve it, and the whole context is prefilled)."""
        ps = self.pool.page_size
        n = min(p.load_prefix, p.input - 1) // ps * ps
        if n <= 0:
            return 0
        t0 = time.monotonic()
        try:
            r = self.xfer.load(p.session_id, p.load_gen, pages[: n // ps], n)
        except TransferError as e:
            log.warning("snapshot prefix of %s not loaded (%s): prefilling the whole context", p.session_id, e)
            meta["load_miss"] = True
            self.stats["store_load_misses"] = self.stats.get("store_load_misses", 0) + 1
            return 0
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        meta["loaded_tokens"], meta["loaded_bytes"] = n, r.bytes
        meta["load_ms"] = _ms(time.monotonic() - t0)
        self.stats["store_loads"] = self.stats.get("store_loads", 0) + 1
        self.stats["store_load_tokens"] = self.stats.get("store_load_tokens", 0) + n
        return n

    # -- decode role ----------------------------------------------------------------------------

    def begin(self, p: Plan) -> Turn:
        t = Turn(p, self.tokens_for(p))
        t.meta = {
            "mode": p.mode,
            "role": "decode",
            "worker_id": self.cfg.worker_id,
            "received_bytes": 0,
            "verified_bytes": 0,
            "verify_failures": 0,
            "transfer_ms": 0.0,
            "transfer_real_ms": 0.0,
            "transfer_model_ms": 0.0,
            "prefill_tokens": 0,
            "prefill_ms": 0.0,
            "evicted_sessions": 0,
        }
        anonymous = not p.keep
        self._tls.gpu = self._tls.alloc = 0.0
        t0 = time.monotonic()
        if not anonymous:
            t.unlock = self._lock_turn(p.session_id)
        t.meta["turn_wait_ms"] = _ms(time.monotonic() - t0)
        self.gpu.enter()
        t.active = True
        self._report_running()
        try:
            self._begin(t, anonymous)
        except BaseException:
            self.finish(t, ok=False)
            raise
        # where the time before the first token went (beside prefill_ms and receive_wait_ms)
        t.meta["gpu_wait_ms"], t.meta["alloc_ms"] = _ms(self._tls.gpu), _ms(self._tls.alloc)
        return t

    def _begin(self, t: Turn, anonymous: bool) -> None:
        p, ps, n = t.p, self.pool.page_size, t.p.input
        need = pages_for(n + p.max_new, ps)
        if not p.recv_kind and not p.local:
            # Nothing received, nothing computed from scratch: the turn runs on the session held here.
            with self.mu:
                s = self.sessions.get(p.session_id)
                if s is None or s.kv_len < p.cached:
                    have = -1 if s is None else s.kv_len
                    if have < 0:
                        raise ApiError(
                            409,
                            "session_not_resident",
                            "session %r is not resident on %s" % (p.session_id, self.cfg.worker_id),
                        )
                    raise ApiError(
                        409,
                        "session_not_resident",
                        "session %r holds %d tokens on %s, fewer than cached_tokens %d"
                        % (p.session_id, have, self.cfg.worker_id, p.cached),
                    )
                s.pinned += 1
                self._touch(s)
                t.s = s
            # Reuse resident KV only up to the longest common prefix of its tokens and the prompt
            # (continuity on content, DESIGN §7); at least the last prompt token is recomputed.
            lcp = self.held_prefix(s, t.ids, p.cached)
            t.start = min(lcp, n - 1)
            t.meta["prefix_mismatch_tokens"] = max(0, p.cached - lcp)
            if need > len(s.pages):
                s.pages.extend(self._alloc_for_turn(t, need - len(s.pages)))
            self._append_prefill(t, t.start, resident=True)
            return

        if p.recv_kind and p.keep and not p.open:
            # A receive into the session kept here that does not replace it: a large append. With
            # receive_from the control plane vouches for [0, rf) only: the session may be longer
            # than the prompt (an edited or compacted history, cut back to rf below).
            with self.mu:
                s = self.sessions.get(p.session_id)
                if s is not None and 0 < s.kv_len and (s.kv_len <= n or p.receive_from > 0):
                    s.pinned += 1
                    self._touch(s)
                    t.s, t.extend = s, True
            if not t.extend and p.receive_from:
                # P sends only the suffix: without the held prefix the KV cannot be whole here.
                raise ApiError(
                    409,
                    "session_not_resident",
                    "session %r is not resident on %s, and the transfer sends only tokens from %d "
                    "(receive_from)" % (p.session_id, self.cfg.worker_id, p.receive_from),
                )
            if not t.extend:
                p.keep, anonymous = False, True
        if t.extend:
            s = t.s
            # Suffix-only receive (receive_from): this worker keeps [0, rf) of the KV it holds and
            # P sends only the pages past it; the held KV must be the prompt's up to rf.
            rf = p.receive_from // ps * ps
            if rf:
                lcp = self.held_prefix(s, t.ids, max(p.cached, rf))
                if lcp < rf:
                    raise ApiError(
                        409,
                        "session_not_resident",
                        "session %r holds %d tokens of this prompt on %s, "
                        "fewer than receive_from %d" % (p.session_id, lcp, self.cfg.worker_id, rf),
                    )
                t.meta["received_from"] = rf
                if s.kv_len > n:
                    # A compacted history shorter than the session: D keeps [0, rf) and P sends
                    # every page past it, so the session's old tail goes first.
                    self._trim(s, rf)
            k = pages_for(s.kv_len, ps)
            surplus = s.pages[k:]
            s.pages = s.pages[:k]
            self.pool.free(surplus)
            s.pages.extend(self._alloc_for_turn(t, need - k))
            t.dirty = True
            self._receive(t, TRANSFER_SEED, n)
            self._first_from_received(t)
            if p.load_prefix or rf:
                # P computed on KV loaded from the store, or D kept its own: not one full prefill's
                t.bitwise = False
            return

        if not anonymous:
            with self.mu:
                old = self.sessions.get(p.session_id)
            if old is not None:  # the KV arrives by transfer (or is prefilled here): a resident copy is stale
                self.drop_session(old)
        pages, ev = self.allocate(need, p.session_id)
        t.meta["evicted_sessions"] = ev
        if anonymous:
            t.pages = pages
        else:
            s = Session(id=p.session_id, pages=pages, pinned=1)
            self._touch(s)
            with self.mu:
                self.sessions[s.id] = s
            t.s = s
        if p.load:
            # A LoadSessionCommand (re-homing): the snapshot becomes the session's KV as it is,
            # nothing is computed here. With the snapshot's token ids (input_ids: the ids its
            # pushes carried to the prefill store) the session holds [0, tokens) with them and
            # the recompute check holds the loaded KV to a full prefill of them; without, it holds
            # them without ids until its next turn (held_prefix), unverified.
            self._receive(t, TRANSFER_SNAPSHOT, p.recv_tokens)
            t.start = t.kv = p.recv_tokens
            t.meta.update(load=True)
            if p.ids is None:
                t.meta.update(load_unverified=True)
            t.bitwise = False  # KV from another worker's prefill and decode steps: allclose
            self.stats["session_loads"] = self.stats.get("session_loads", 0) + 1
        elif p.local:
            # local_prefill: prefill everything here, as a colocated worker (a fail-open or a
            # fallback without a prefill worker keeps nothing; a new session's first turn keeps it).
            t.meta["local_prefill"] = True
            self._append_prefill(t, 0, resident=False)
        elif p.recv_kind == TRANSFER_SNAPSHOT:
            self._receive(t, TRANSFER_SNAPSHOT, p.recv_tokens)
            t.start = min(p.recv_tokens, n - 1)
            self._append_prefill(t, t.start, resident=False)
        else:
            self._receive(t, TRANSFER_SEED, n)
            self._first_from_received(t)
            if p.load_prefix:
                t.bitwise = False  # P computed the tail on KV loaded from its store

    def _alloc_for_turn(self, t: Turn, n: int) -> List[int]:
        """n more pages for a turn on the session held here (t.s): while allocate waits for
        them the turn only waits (Session.waiting). When the sidecar's capacity release took
        the session meanwhile (release_for_capacity), the pages go back and the turn answers 409
        session_not_resident, to be re-decided."""
        s = t.s
        with self.mu:
            s.waiting += 1
        try:
            more, ev = self.allocate(n, s.id)
        finally:
            with self.mu:
                s.waiting -= 1
                gone = s.gone
        if gone:
            self.pool.free(more)
            with self.mu:
                self.mu.notify_all()
            raise ApiError(
                409,
                "session_not_resident",
                "session %r was released on %s while its turn waited for pages" % (s.id, self.cfg.worker_id),
            )
        t.meta["evicted_sessions"] = ev
        return more

    def _receive(self, t: Turn, kind: int, tokens: int) -> None:
        p = t.p
        pages = t.page_list()[: pages_for(tokens, self.pool.page_size)]
        try:
            r = self.xfer.receive(p.room, p.seed_key, kind, pages, tokens, p.peer)
        except TransferError as e:
            raise ApiError(502, "transfer_failed", str(e)) from e
        wall = r.wall_s
        t.aux = (r.first_token, r.first_logit) if r.first_token is not None else None
        moved = wall
        if r.duration_us and r.duration_us / 1e6 < wall:
            moved = r.duration_us / 1e6
        t.meta.update(
            received_bytes=r.bytes, receive_wait_ms=_ms(wall), transfer_real_ms=_ms(moved), transfer_ms=_ms(moved)
        )
        self.stats["received_bytes"] += r.bytes
        t.kv = tokens
        t.received_at = time.monotonic()

    def _first_from_received(self, t: Turn) -> None:
        """Step 0 after a P->D transfer: the received KV of [0, n) becomes the served cache
        (decode steps from it are bitwise those of a local prefill); the first token's logits are
        computed here by running the last prompt token over [0, n-1) (its KV is not written: the
        pool keeps P's)."""
        n, pages = t.p.input, t.page_list()
        t0 = time.monotonic()
        if t.aux is not None and 0 <= t.aux[0] < self.spec.vocab_size:
            # P's first token from the aux row (SGLang's _commit_transfer_to_req): no forward
            # here, and it is emitted before anything else; the pages become the dense cache
            # for the next step only (decode_steps).
            t.cache, t.lazy_cache = None, n
            t.first_local, t.bitwise, t.start = False, True, n
            t.meta["first_token_source"] = "aux"
            t.meta["prefill_tokens"] = 0
            t.meta["prefill_ms"] = _ms(time.monotonic() - t0)
            t.kv = n
            t.pending, t.pending_token = None, t.aux[0]
            if self.cfg.verify_recompute:
                t.logits.append(None)
            return
        t.meta["first_token_source"] = "local"
        if t.aux is not None:
            t.meta["aux_token_out_of_range"] = t.aux[0]
            t.aux = None
        probe = self._cache_from_pool(pages, n - 1)
        logits, _ = self._forward(t.ids[n - 1 : n], probe)
        del probe
        t.cache = self._cache_from_pool(pages, n)
        t.first_local, t.bitwise, t.start = True, True, n
        t.meta["prefill_tokens"] = 1
        t.meta["prefill_ms"] = _ms(time.monotonic() - t0)
        self._step0(t, logits)

    def _append_prefill(self, t: Turn, start: int, resident: bool) -> None:
        """Gathers [0, start) from the pool and prefills [start, n) on it."""
        n, pages = t.p.input, t.page_list()
        t0 = time.monotonic()
        cache = self._cache_from_pool(pages, start)
        if resident and t.s is not None and start < t.s.kv_len:
            t.dirty = True
        logits, cache = self._forward(t.ids[start:n], cache)
        self._write_back(pages, cache, start, n)
        t.cache, t.kv = cache, n
        t.meta["prefill_tokens"] = n - start
        t.meta["prefill_ms"] = _ms(time.monotonic() - t0)
        self.stats["prefill_tokens"] += n - start
        self._step0(t, logits)

    def _step0(self, t: Turn, logits: torch.Tensor) -> None:
        t.kv = t.p.input
        if self.cfg.verify_recompute:
            t.logits.append(logits)
        t.pending = logits

    def decode_steps(self, t: Turn, emit: Callable[[int, int], None]) -> None:
        """Greedy decode: max_new tokens; emit(i, token) after each one. With keep_session the
        last token is run too, so that the KV covers input + output tokens (kv_len_after)."""
        p, pages = t.p, t.page_list()
        scripted = p.ids is None
        logits = t.pending
        t0 = time.monotonic()
        t.meta["first_step_ms"] = _ms(t0 - t.received_at) if t.received_at else 0.0
        for i in range(p.max_new):
            tok = t.pending_token if (i == 0 and t.pending_token is not None) else int(logits.argmax())
            t.out.append(tok)
            # The token at position n+i: the greedy one, or the scripted context's token when
            # the client sends only token counts (so that every worker derives the same context).
            nxt = (
                scripted_tokens(p.seed_key, p.input + i, p.input + i + 1, self.spec.vocab_size)[0] if scripted else tok
            )
            t.fed.append(nxt)
            self.stats["decode_tokens"] += 1
            emit(i, tok)
            if i == p.max_new - 1 and not (t.s is not None and p.keep):
                break
            pos = t.kv
            if t.cache is None:  # step 0 was P's token: the dense cache now, after it was emitted
                g0 = time.monotonic()
                t.cache = self._cache_from_pool(pages, t.lazy_cache)
                t.meta["gather_ms"] = _ms(time.monotonic() - g0)
            logits, t.cache = self._forward([nxt], t.cache)
            self._write_back(pages, t.cache, pos, pos + 1)
            t.kv = pos + 1
            if (
                self.cfg.verify_recompute
                and i < p.max_new - 1
                and (self.cfg.verify_max_steps <= 0 or len(t.logits) < self.cfg.verify_max_steps)
            ):
                t.logits.append(logits)
        t.meta["decode_ms"] = _ms(time.monotonic() - t0)
        t.cache = None  # the served dense cache: not needed past the last step (the check reads the pool)
        self._leave(t)

    def _leave(self, t: Turn) -> None:
        if t.active:
            t.active = False
            self.gpu.leave()
            self._report_running()

    # -- finish ---------------------------------------------------------------------------------

    def finish(self, t: Turn, ok: bool) -> None:
        """A kept session that succeeded is trimmed to its KV and committed; a failure leaves a
        direct turn's session as it was when its resident KV is intact, else drops it."""
        if t.finished:
            return
        t.finished = True
        t.cache = None
        self._leave(t)
        try:
            if t.s is None:
                self.pool.free(t.pages)
                t.pages = []
                with self.mu:
                    self.mu.notify_all()
                return
            s = t.s
            try:
                if s.gone:  # released while the turn waited for pages: nothing of it is held here
                    return
                if not t.p.keep:
                    self.drop_session(s)
                    return
                if not ok:
                    if ((not t.p.recv_kind and not t.p.local) or t.extend) and not t.dirty:
                        self._trim(s, s.kv_len)
                    else:
                        self.drop_session(s)
                    return
                pages = self._trim(s, t.kv)
                if t.p.load and t.p.ids is None:
                    s.tokens = [None] * t.kv  # the snapshot's KV, its ids unknown here
                else:
                    s.tokens = list(t.ids) + t.fed[: t.kv - t.p.input]
                ids = known_ids(s.tokens, t.kv)  # they go with the commit (and the snapshot)
                try:
                    self.xfer.commit(s.id, t.kv, pages, ids)
                    s.committed = True
                except BridgeError as e:
                    log.error("CommitSession %s len %d failed: %s", s.id, t.kv, e)
            finally:
                with self.mu:
                    s.pinned -= 1
                    self._touch(s)
                    self.mu.notify_all()
        finally:
            if t.unlock is not None:
                t.unlock()
                t.unlock = None

    def _trim(self, s: Session, kv: int) -> List[int]:
        keep = pages_for(kv, self.pool.page_size)
        surplus = s.pages[keep:]
        s.pages = s.pages[:keep]
        s.kv_len = kv
        self.pool.free(surplus)
        return list(s.pages)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> float:
    """max |a - b| over (tokens, ...) tensors, in chunks of rows tokens (no whole float32 copy)."""
    m = 0.0
    for i in range(0, a.shape[0], rows):
        m = max(m, float((a[i : i + rows].float() - b[i : i + rows].float()).abs().max()))
    return m


class Verifier:
    """Recompute from scratch, in the same worker, and compare.

    The reference: one full prefill of the prompt in a fresh cache (the computation P does; after
    P's prefill from the snapshot, the prefix's prefill and then the tail's on it, as P split it),
    then the served turn's decode steps, teacher-forced on the tokens it placed (so both paths
    see the same context). Compared per step: the logits (max |diff|) and the greedy token.
    Tolerance:
    - bitwise (|diff| == 0) where the arithmetic is the same: decode steps from KV that a full
      prefill produced (P's KV received by SEED / RESEED_PREFILL / PD_FALLBACK), and that KV
      itself against the reference prefill's;
    - allclose (|diff| <= atol) where it is not: the first token computed on D from received
      KV, an append-prefill on resident KV (DIRECT_TO_D) or on a snapshot (RESEED_SNAPSHOT)
      against a full prefill, and the KV that decode steps wrote on an earlier worker;
    - a served token must be the reference's argmax, or tie it within atol.
    Each violation is one mismatch."""

    def __init__(self, w: Worker):
        self.w = w

    def prefill_split(self, p: Plan) -> int:
        """Where P's prefill from the snapshot split the prompt (Worker._load_prefix: the load cut
        to whole pages, at least the last token computed); 0 when P prefilled all of it."""
        ps = self.w.pool.page_size
        return max(0, min(p.load_prefix, p.input - 1) // ps * ps) if p.load_prefix else 0

    def check(self, t: Turn) -> Dict:
        w, p = self.w, t.p
        atol = w.cfg.atol
        t0 = time.monotonic()
        until = t0 + w.gpu.max_defer_s  # the check as a whole yields to served requests this long at most
        split = self.prefill_split(p)
        if split:
            # P prefilled from the snapshot: [0, split) was loaded, [split, input) computed on it.
            # The reference computes the same two parts from the token ids (the prefix from
            # scratch, then the tail on it), so that a stale or misplaced loaded page shows while
            # the order of 16-bit arithmetic over a long context does not.
            _, cache = w._forward(t.ids[:split], M.new_cache(w.model), low=True, defer_until=until)
            ref_logits, cache = w._forward(t.ids[split:], cache, low=True, defer_until=until)
        else:
            ref_logits, cache = w._forward(t.ids, M.new_cache(w.model), low=True, defer_until=until)
        refs = [ref_logits]
        for tok in t.fed[: len(t.logits) - 1]:
            lg, cache = w._forward([tok], cache, low=True, defer_until=until)
            refs.append(lg)
        mism, max_diff, bitwise_steps = 0, 0.0, 0
        for i, (a, b) in enumerate(zip(t.logits, refs)):
            if a is None:  # step 0 came from P's aux row: its token and that token's logit
                tok, lg = t.aux
                d = abs(float(b[tok]) - lg)
                max_diff = max(max_diff, d)
                bitwise_steps += d == 0.0
                sb = int(b.argmax())
                bad = (
                    d > atol
                    or (t.bitwise and w.cfg.bitwise_strict and d != 0.0)
                    or (tok != sb and float(b[sb] - b[tok]) > atol)
                )
                if bad:
                    mism += 1
                    log.warning(
                        "recompute mismatch: session %s mode %s first token (aux) %d/%d |dlogit| %.3g",
                        p.seed_key,
                        p.mode,
                        tok,
                        sb,
                        d,
                    )
                continue
            d = float((a - b).abs().max())
            max_diff = max(max_diff, d)
            if d == 0.0:
                bitwise_steps += 1
            expect_bitwise = t.bitwise and (i > 0 or not t.first_local) and w.cfg.bitwise_strict
            bad = d > atol or (expect_bitwise and d != 0.0)
            sa, sb = int(a.argmax()), int(b.argmax())
            if sa != sb and float(b[sb] - b[sa]) > atol:
                bad = True
            if bad:
                mism += 1
                log.warning(
                    "recompute mismatch: session %s mode %s step %d |dlogit| %.3g tokens %d/%d",
                    p.seed_key,
                    p.mode,
                    i,
                    d,
                    sa,
                    sb,
                )
        # The KV the served turn left in the pool against the reference's.
        # One layer at a time (a whole gather of a 42K-token session is another 6 GB on the
        # device), the reference's layers freed as they are compared.
        kv_end = min(t.kv, M.cache_len(cache))
        kv_diff = 0.0
        if kv_end > 0 and t.page_list():
            for l in range(w.spec.num_layers):
                kk, vv = w.pool.gather(t.page_list(), 0, kv_end, layer=l)
                rk, rv = M.cache_kv(cache, l, 0, kv_end)
                kv_diff = max(kv_diff, _max_abs_diff(kk[0], rk), _max_abs_diff(vv[0], rv))
                del kk, vv, rk, rv
        del cache, refs
        if w.pool.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the check's blocks back to the processes sharing the GPU
        kv_bitwise = t.bitwise and w.cfg.bitwise_strict and not t.extend
        if kv_diff > atol or (kv_bitwise and kv_diff != 0.0):
            mism += 1
            log.warning(
                "recompute mismatch: session %s mode %s KV |diff| %.3g over %d tokens",
                p.seed_key,
                p.mode,
                kv_diff,
                kv_end,
            )
        n_refs = len(t.fed[: len(t.logits) - 1]) + 1
        w.stats["recompute_checked"] += 1
        w.stats["recompute_mismatches"] += mism
        return {
            "recompute_checked": True,
            "recompute_mismatches": mism,
            "max_abs_logit_diff": max_diff,
            "max_abs_kv_diff": kv_diff,
            "recompute_steps": n_refs,
            "bitwise_steps": bitwise_steps,
            "bitwise_expected": bool(t.bitwise),
            "recompute_atol": atol,
            "recompute_ms": _ms(time.monotonic() - t0),
        }
