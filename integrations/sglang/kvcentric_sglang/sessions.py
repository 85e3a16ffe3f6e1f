"""Decode-side session hooks: SGLang's streaming sessions -> CommitSession / ReleaseSession.

* ``commit_after`` is an AFTER hook of ``StreamingSession.try_cache_finished_req``: when the
  slot kept the finished turn (True), the turn is committed: CommitSession(session,
  kv_committed_len, pages of [0, kv_committed_len), token ids of [0, kv_committed_len): the
  request's origin_input_ids + output_ids). The ids travel with the snapshot to the prefill
  store, and a decode sidecar that loads the session elsewhere (re-homing) sends them back as
  the load's input_ids: the fresh streaming slot's request, and so the session's history, is
  built from them.
* ``release_around`` is an AROUND hook of ``StreamingSession.release_session``: ReleaseSession
  goes to the sidecar BEFORE SGLang unlocks the tree prefix and frees the pages (the sidecar
  returns only once no snapshot push reads them).
* ``continuity_around`` is an AROUND hook of ``Session.create_req``: the gateway sends D the
  FULL context of a kvcentric turn; SGLang prepends the session's history itself, so the hook
  strips the history when it is an exact token prefix of the input, and refuses the turn
  (abort with a clear message) otherwise: a turn never appends to KV of another history.
* ``release_for_capacity`` / ``truncate`` carry out the sidecar's WatchCommands.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Dict, List, Optional, Tuple

import grpc

from . import metrics, runtime
from .bridge import REASON_CAPACITY, BridgeError

logger = logging.getLogger(__name__)

# Sessions committed through this process and their last commit: what a restarted sidecar is
# told again (watch.py re-commits them).
_resident: Dict[str, Tuple[int, List[int]]] = {}
_resident_ids: Dict[str, List[int]] = {}  # their token ids of [0, committed_len), when known
_resident_lock = threading.Lock()
_evicting = contextvars.ContextVar("kvc_evicting", default=False)


def resident_sessions() -> Dict[str, Tuple[int, List[int]]]:
    with _resident_lock:
        return dict(_resident)


def resident_ids(session_id: str) -> List[int]:
    """The token ids of a resident session's last commit ([] when it had none)."""
    with _resident_lock:
        return list(_resident_ids.get(session_id, ()))


MAX_TOKEN_ID = (1 << 31) - 1


def commit_ids(req, committed_len: int) -> List[int]:
    """The token ids of [0, committed_len) of a finished request: origin_input_ids, then
    output_ids. [] when they do not cover the range or an id is outside [0, 2^31) (the commit
    then goes without ids, and a load of the session elsewhere goes without them too)."""
    out = list(getattr(req, "output_ids", None) or ())
    sp = getattr(req, "sampling_params", None)
    if sp is not None and getattr(sp, "max_new_tokens", None) is not None:
        out = out[: sp.max_new_tokens]  # as the session's history counts them (_history)
    ids = list(getattr(req, "origin_input_ids", None) or ()) + out
    if len(ids) < committed_len:
        return []
    ids = [int(x) for x in ids[:committed_len]]
    if any(x < 0 or x > MAX_TOKEN_ID for x in ids):
        return []
    return ids


def slot_pages(streaming_session, slot, length: int) -> List[int]:
    """Page indices covering tokens [0, length) of a session slot, in token order."""
    page = streaming_session.cache.page_size
    row = streaming_session.cache.req_to_token_pool.req_to_token[slot.kv.req_pool_idx, :length]
    return [int(x) // page for x in row[::page].tolist()]


def commit(session_id: str, committed_len: int, pages: List[int], token_ids: Optional[List[int]] = None) -> bool:
    """CommitSession through the process bridge; remembered for re-commits. token_ids: the ids
    of [0, committed_len), or None/[] for none. Errors are logged (a failed commit only delays
    the snapshot) and re-raised for NOT registered pools."""
    ids = list(token_ids or ())
    if ids and len(ids) != committed_len:
        ids = []
    with _resident_lock:
        _resident[session_id] = (committed_len, list(pages))
        if ids:
            _resident_ids[session_id] = ids
        else:
            _resident_ids.pop(session_id, None)
    b = runtime.state.bridge
    if b is None:
        return False
    try:
        pushed = b.commit_session(session_id, committed_len, pages, ids)
    except BridgeError as e:
        logger.error("kvcentric: CommitSession %s len %d: %s", session_id, committed_len, e)
        return False
    metrics.session("committed")
    return pushed


def commit_after(result, streaming_session, req, *args, **kwargs):
    """AFTER StreamingSession.try_cache_finished_req(req) -> bool."""
    if not result:
        return result
    sid = req.session.session_id
    slot = streaming_session.slots.get(sid)
    if slot is None or not slot.kv.holds_kv:
        return result
    committed = int(slot.kv.kv_committed_len)
    commit(sid, committed, slot_pages(streaming_session, slot, committed), commit_ids(req, committed))
    return result


def release(session_id: str, evicted: bool = False) -> bool:
    """ReleaseSession through the process bridge; NOT_FOUND (never committed) is fine."""
    with _resident_lock:
        _resident.pop(session_id, None)
        _resident_ids.pop(session_id, None)
    b = runtime.state.bridge
    if b is None:
        return False
    try:
        aborted = b.release_session(session_id, evicted=evicted)
    except BridgeError as e:
        if e.code != grpc.StatusCode.NOT_FOUND:
            logger.error("kvcentric: ReleaseSession %s: %s (freeing anyway)", session_id, e)
        return False
    metrics.session("evicted" if evicted else "released")
    return aborted


def release_around(original, streaming_session, session_id, *args, **kwargs):
    """AROUND StreamingSession.release_session(session_id): the sidecar first, then SGLang frees."""
    if session_id in streaming_session.slots:
        release(session_id, evicted=_evicting.get())
    return original(streaming_session, session_id, *args, **kwargs)


class ReleaseRefused(RuntimeError):
    """A release command the worker refuses (the watcher acks it ok=false with this message)."""


def idle_sessions(streaming_session, view, exclude: str = "") -> List[str]:
    """Sessions committed through this process whose slot holds KV and that no request of the
    view uses, waits for or queues: what the sidecar's capacity release could take."""
    busy = view.sessions("waiting") | view.sessions("queued") | view.sessions("in_use")
    with _resident_lock:
        committed = set(_resident)
    return sorted(
        sid
        for sid, slot in streaming_session.slots.items()
        if sid != exclude and sid in committed and slot.kv.holds_kv and sid not in busy
    )


def release_for_capacity(streaming_session, session_id: str, reason: int = REASON_CAPACITY, view=None) -> int:
    """A WatchCommands release: frees the session's slot (ReleaseSession with reason EVICTED
    first, through the hook). The SGLang session stays open: its next turn re-prefills from
    history. Returns the tokens freed.

    ``view`` (demand.View of the scheduler, when known) refuses, leaving the slot and SGLang's
    state as they are: a session a request uses (running, pre-allocated, receiving), for any
    reason; and a capacity release of a session whose turn waits for pages (or is queued for
    them) while another committed session holding KV is idle (idle_sessions) — releasing it
    would turn a turn needing a few pages into a reseed of the whole context into the same full
    pool; the sidecar passes over a refused session and takes the idle one. With no such
    session the release goes ahead (the waiting turn re-prefills from history)."""
    slot = streaming_session.slots.get(session_id)
    if slot is None:
        raise KeyError("session %s holds no KV on this worker" % session_id)
    if view is not None:
        if session_id in view.sessions("in_use"):
            raise ReleaseRefused("session %s is in use by a running, pre-allocated or receiving request" % session_id)
        if reason == REASON_CAPACITY and session_id in (view.sessions("waiting") | view.sessions("queued")):
            idle = idle_sessions(streaming_session, view, exclude=session_id)
            if idle:
                raise ReleaseRefused(
                    "session %s has a turn waiting for pages, and %d idle session(s) can be released instead (%s)"
                    % (session_id, len(idle), ", ".join(idle[:3]))
                )
    freed = max(0, int(slot.kv.kv_allocated_len) - int(slot.kv.cache_protected_len)) if slot.kv.holds_kv else 0
    tok = _evicting.set(True)
    try:
        streaming_session.release_session(session_id)
    finally:
        _evicting.reset(tok)
    return freed


def truncate(streaming_session, session_id: str, keep_tokens: int) -> int:
    """A WatchCommands truncate: keep only [0, keep_tokens) of the session's KV (a page
    boundary, not below the tree-owned prefix), free the rest, commit the shorter length.
    Returns the tokens freed."""
    slot = streaming_session.slots.get(session_id)
    if slot is None or not slot.kv.holds_kv:
        raise KeyError("session %s holds no KV on this worker" % session_id)
    page = streaming_session.cache.page_size
    if keep_tokens < 0 or keep_tokens % page:
        raise ValueError("keep_tokens %d is not a page boundary (page %d)" % (keep_tokens, page))
    if keep_tokens < slot.kv.cache_protected_len:
        raise ValueError(
            "keep_tokens %d is inside the tree-owned prefix (%d tokens); release the session instead"
            % (keep_tokens, slot.kv.cache_protected_len)
        )
    before = int(slot.kv.kv_allocated_len)
    if keep_tokens >= before:
        return 0
    ids = resident_ids(session_id)
    streaming_session._free_tail(slot.kv, keep_tokens)
    committed = int(slot.kv.kv_committed_len)
    commit(
        session_id,
        committed,
        slot_pages(streaming_session, slot, committed),
        ids[:committed] if len(ids) >= committed else None,
    )
    return before - int(slot.kv.kv_allocated_len)


# ---- continuity (D gets the full context) ---------------------------------------------------------


class ContinuityError(ValueError):
    pass


def strip_history(history: List[int], full: List[int], session_id: str) -> List[int]:
    """The new tokens of a full-context turn: full minus history, when history is an exact
    prefix of full. Raises ContinuityError naming the first differing position otherwise."""
    n = len(history)
    if len(full) <= n or list(full[:n]) != list(history):
        i = next((k for k, (a, b) in enumerate(zip(history, full)) if a != b), min(n, len(full)))
        raise ContinuityError(
            "kvcentric: session %s: the resident history (%d tokens) is not a prefix of this turn's %d input tokens "
            "(first difference at token %d); the turn is refused so it never appends to KV of another history "
            "(close the session and reseed it)" % (session_id, n, len(full), i)
        )
    return list(full[n:])


def _history(session) -> Optional[List[int]]:
    if not session.req_nodes:
        return None
    [node] = session.req_nodes.values()
    last = node.req
    origin = list(last.origin_input_ids)
    if getattr(session, "committed_origin_len", None) is not None:
        origin = origin[: session.committed_origin_len]
    out = list(last.output_ids[: last.sampling_params.max_new_tokens])
    return origin + out


def continuity_around(original, session, req, *args, **kwargs):
    """AROUND Session.create_req(req, ...) for streaming sessions with a kvc hint: strip the
    resident history from the full-context input, or refuse the turn."""
    try:
        hint = runtime.parse_hint(getattr(req, "kv_hints", None))
    except ValueError:
        hint = None  # _create_generation_req refuses the request with the reason
    if hint is None or not session.streaming or session._inflight:
        return original(session, req, *args, **kwargs)
    hist = _history(session)
    if hist is None:
        return original(session, req, *args, **kwargs)
    try:
        req.input_ids = (
            type(req.input_ids)(strip_history(hist, list(req.input_ids), session.session_id))
            if not isinstance(req.input_ids, list)
            else strip_history(hist, req.input_ids, session.session_id)
        )
    except ContinuityError as e:
        new_req = original(session, req, *args, **kwargs)
        if new_req.to_finish is None and new_req.finished_reason is None:
            session._inflight = False  # as create_req's own refusals: the session stays usable
            new_req.set_finish_with_abort(str(e))
        return new_req
    return original(session, req, *args, **kwargs)
