"""WatchClient: the worker's standing WatchCommands stream from its sidecar.

A background thread keeps the stream open, reconnecting with exponential backoff (0.1 s doubling
to 5 s) whenever it breaks (the sidecar restarted, the socket went away). The first message of
every stream is the attach status: when ``pool_registered`` is false (a new sidecar process),
the client calls ``on_reregister()`` (register the pool again) and then ``on_recommit()``
(CommitSession for every resident session), before anything else.

Release and truncate commands change the worker's KV and so must run where SGLang may free
pages: the scheduler thread. The client queues them; the scheduler drains the queue
(``run_pending(scheduler)``, called from the plugin's Scheduler.process_input_requests hook) and
every command is acknowledged with AckCommand (ok, error, tokens freed): a callback that raises
is acked ok=false with the exception as the error (a release the worker refuses).
``on_release(ctx, session_id, reason)`` and ``on_truncate(ctx, session_id, keep_tokens)`` get
run_pending's ctx (the plugin's: the scheduler; kvc-refworker's: its worker).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Callable, Optional

from .bridge import BridgeError, WorkerBridge, WorkerCommand

logger = logging.getLogger(__name__)


class WatchClient:
    def __init__(
        self,
        bridge: WorkerBridge,
        *,
        on_reregister: Callable[[], None],
        on_recommit: Callable[[], None],
        on_release: Optional[Callable[[object, str, int], int]] = None,
        on_truncate: Optional[Callable[[object, str, int], int]] = None,
        worker_instance: Optional[str] = None,
        backoff_max_s: float = 5.0,
    ):
        self.bridge = bridge
        self.on_reregister, self.on_recommit = on_reregister, on_recommit
        self.on_release, self.on_truncate = on_release, on_truncate
        self.worker_instance = worker_instance or "pid-%d-%d" % (os.getpid(), int(time.time() * 1000))
        self.backoff_max_s = backoff_max_s
        self.pending: "queue.Queue[WorkerCommand]" = queue.Queue()
        self.attaches = []  # every AttachStatus seen, in order
        self.reregistrations = 0
        self.errors = []
        self._stop = threading.Event()
        self._stream = None
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="kvc-watch", daemon=True)

    def start(self) -> "WatchClient":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        s = self._stream
        if s is not None:
            s.cancel()
        self._thread.join(timeout=10)

    def wait_for(self, pred: Callable[["WatchClient"], bool], timeout: float) -> bool:
        """Blocks until pred(self) holds (checked at every attach and command), or timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def _notify(self):
        with self._cv:
            self._cv.notify_all()

    def _loop(self):
        backoff = 0.1
        while not self._stop.is_set():
            try:
                self._stream = self.bridge.watch_commands(self.worker_instance)
                for cmd in self._stream:
                    backoff = 0.1
                    if cmd.attach is not None:
                        self._attached(cmd)
                    else:
                        self.pending.put(cmd)
                    self._notify()
            except BridgeError as e:
                if self._stop.is_set():
                    return
                logger.info("kvcentric: WatchCommands stream ended: %s; reconnecting in %.1fs", e, backoff)
            except Exception as e:  # a callback failed: keep the stream alive, report it
                logger.exception("kvcentric: WatchCommands handling failed")
                self.errors.append(repr(e))
            self._notify()
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max_s)

    def _attached(self, cmd: WorkerCommand):
        a = cmd.attach
        self.attaches.append(a)
        if not a.pool_registered:
            logger.info("kvcentric: sidecar %s holds no pool: registering again", a.sidecar_instance)
            self.on_reregister()
            self.on_recommit()
            self.reregistrations += 1

    def run_pending(self, ctx) -> int:
        """Carries out queued release / truncate commands (on the scheduler thread) with the
        callbacks (ctx their first argument) and acks each. Returns how many ran."""
        n = 0
        while True:
            try:
                cmd = self.pending.get_nowait()
            except queue.Empty:
                return n
            n += 1
            ok, err, freed = True, "", 0
            try:
                if cmd.release is not None:
                    if self.on_release is None:
                        raise RuntimeError("this worker carries out no release commands")
                    freed = int(self.on_release(ctx, cmd.release, cmd.reason) or 0)
                elif cmd.truncate is not None:
                    if self.on_truncate is None:
                        raise RuntimeError("this worker carries out no truncate commands")
                    freed = int(self.on_truncate(ctx, cmd.truncate[0], cmd.truncate[1]) or 0)
                else:
                    raise RuntimeError("unknown command %d" % cmd.command_id)
            except Exception as e:
                ok, err = False, "%s: %s" % (type(e).__name__, e)
            try:
                self.bridge.ack_command(cmd.command_id, ok, err, freed)
            except BridgeError as e:
                logger.warning("kvcentric: AckCommand %d: %s", cmd.command_id, e)
            self._notify()


def start_for_process(bridge: WorkerBridge, registration) -> Optional[WatchClient]:
    """Starts the process's WatchClient once the pool is registered (KV manager or linker):
    re-registers the pool and re-commits resident sessions when a restarted sidecar attaches,
    runs release / truncate commands through sessions.py on the scheduler's streaming sessions,
    a release with the scheduler's view of its requests (demand.scheduler_view: the refusals of
    sessions.release_for_capacity). KVC_SGLANG_WATCH=0 disables it."""
    from . import demand, runtime, sessions

    if os.environ.get("KVC_SGLANG_WATCH", "1") == "0" or runtime.state.watch is not None:
        return runtime.state.watch

    def recommit():
        for sid, (n, pages) in sessions.resident_sessions().items():
            try:
                bridge.commit_session(sid, n, pages, sessions.resident_ids(sid))
            except BridgeError as e:
                logger.error("kvcentric: re-commit of %s: %s", sid, e)

    def release(scheduler, sid, reason):
        return sessions.release_for_capacity(streaming_of(scheduler), sid, reason, demand.scheduler_view(scheduler))

    w = WatchClient(
        bridge,
        on_reregister=lambda: registration.register(bridge),
        on_recommit=recommit,
        on_release=release,
        on_truncate=lambda scheduler, sid, keep: sessions.truncate(streaming_of(scheduler), sid, keep),
    )
    runtime.state.watch = w
    return w.start()


def streaming_of(scheduler):
    """The scheduler's StreamingSession (its UnifiedRadixCache's); raises when it has none."""
    ss = getattr(getattr(scheduler, "tree_cache", None), "session", None)
    if ss is None:
        raise RuntimeError("this worker's cache holds no streaming sessions (--enable-streaming-session)")
    return ss
