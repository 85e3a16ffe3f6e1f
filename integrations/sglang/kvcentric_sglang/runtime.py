"""Process-wide state of the plugin inside one SGLang scheduler process: the bridge to this
GPU's sidecar, what was registered, and the request -> kvcentric payload lookup.

One SGLang scheduler process drives one GPU (one TP rank), and one sidecar serves that GPU, so
one WorkerBridge per process is right. The socket path comes from KVC_SGLANG_BRIDGE_SOCKET, a
template with {role} (prefill / decode) and {gpu_id}; the default matches the sidecars' systemd
units: /run/kvcentric-{role}-{gpu_id}/bridge.sock.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional

from .bridge import WorkerBridge
from .payload import ExecutionPayload, PayloadError, from_envelope

DEFAULT_SOCKET = "/run/kvcentric-{role}-{gpu_id}/bridge.sock"

_lock = threading.Lock()
_bridges: Dict[str, WorkerBridge] = {}


def socket_path(role: str, gpu_id: int) -> str:
    tmpl = os.environ.get("KVC_SGLANG_BRIDGE_SOCKET", DEFAULT_SOCKET)
    return tmpl.format(role=role, gpu_id=gpu_id, gpu=gpu_id)


def bridge_for(path: str) -> WorkerBridge:
    """The process's WorkerBridge on this socket (one channel per path)."""
    with _lock:
        b = _bridges.get(path)
        if b is None:
            timeout_s = float(os.environ.get("KVC_SGLANG_BRIDGE_TIMEOUT_S", "30"))
            b = _bridges[path] = WorkerBridge(path, timeout_s=timeout_s)
        return b


class _State:
    """What the process registered; set by the KV manager (P/D) or the linker (colocated D)."""

    def __init__(self):
        self.bridge: Optional[WorkerBridge] = None
        self.registration = None  # pool.PoolRegistration
        self.page_size: int = 0
        self.req_to_token = None  # torch tensor [rows, max_len] of token slots (decode)
        self.role: str = ""
        self.watch = None  # watch.WatchClient
        self.demand = None  # demand.DemandReporter (decode)

    def reset(self):
        if self.demand is not None:
            self.demand.close()
        self.__init__()


state = _State()


# ---- kv_hints ----------------------------------------------------------------------------------


def parse_hint(kv_hints: Any) -> Optional[ExecutionPayload]:
    """The gateway's ExecutionPayload in a KvHintsEnvelope (SGLang's object or its dict form),
    or None. A kvc action of the wrong shape or version raises ValueError naming the field."""
    try:
        return from_envelope(kv_hints)
    except PayloadError as e:
        raise ValueError("malformed kv_hints kvc payload: %s" % e) from None


def hint_of_req(req: Any) -> Optional[ExecutionPayload]:
    """The ExecutionPayload of an SGLang Req (its kv_hints), or None."""
    return parse_hint(getattr(req, "kv_hints", None))


def session_id_of_req(req: Any) -> str:
    """The kvcentric session id of a request: the kvc hint's, else the streaming session's,
    else SGLang's top-level session id."""
    h = hint_of_req(req)
    if h is not None and h.session_id:
        return h.session_id
    s = getattr(req, "session", None)
    if s is not None and getattr(s, "session_id", None):
        return s.session_id
    sid = getattr(req, "session_id", None)
    return sid or ""
