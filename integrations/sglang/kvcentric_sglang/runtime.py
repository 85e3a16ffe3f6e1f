"""Process-wide state of the plugin inside one SGLang scheduler process: the bridge to this
GPU's sidecar, what was registered, and the request -> kvcentric hint lookup.

One SGLang scheduler process drives one GPU (one TP rank), and one sidecar serves that GPU, so
one WorkerBridge per process is right. The socket path comes from KVC_SGLANG_BRIDGE_SOCKET, a
template with {role} (prefill / decode) and {gpu_id}; the default matches the sidecars' systemd
units: /run/kvcentric-{role}-{gpu_id}/bridge.sock.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .bridge import TRANSFER_SEED, TRANSFER_SNAPSHOT, WorkerBridge

DEFAULT_SOCKET = "/run/kvcentric-{role}-{gpu_id}/bridge.sock"
ACTION_TYPE = "kvc"

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

    def reset(self):
        self.__init__()


state = _State()


# ---- kv_hints ----------------------------------------------------------------------------------


@dataclass
class KvcHint:
    """The gateway's "kvc" action of a request's kv_hints (action_type "kvc")."""

    mode: str = ""
    session_id: str = ""
    room: Optional[int] = None
    prefill_peer_addr: str = ""
    snapshot_seqlen: int = 0
    role: str = ""
    input_tokens: int = 0
    decision_id: str = ""
    full_context: bool = True
    # SEED into a colocated decode worker (docs/sglang.md): on P, the sender writes the prompt's
    # KV into the prefill sidecar's own store as the session's snapshot of this generation; D's
    # request then carries snapshot_seqlen and loads it through the KvcLinker.
    to_store: bool = False
    generation: int = 0
    # Prefill from the snapshot (RouteExecution.load_prefix_tokens / load_generation): P loads
    # [0, load_prefix_tokens) of the session's snapshot from its sidecar's store first.
    load_prefix_tokens: int = 0
    load_generation: int = 0
    # Suffix-only receive (RouteExecution.receive_from): D keeps [0, receive_from) and P's sender
    # sends only the pages past it.
    receive_from: int = 0
    # Tensor parallelism: the prefill worker's rank peers, in rank order (rank r of this worker
    # receives from entry r; prefill_peer_addr is rank 0's). Empty without tensor parallelism.
    prefill_peer_addrs: List[str] = field(default_factory=list)

    @property
    def transfer_kind(self) -> int:
        return TRANSFER_SNAPSHOT if self.mode == "RESEED_SNAPSHOT" else TRANSFER_SEED

    def peer_for(self, tp_rank: int, tp_size: int) -> str:
        """The prefill sidecar that tensor-parallel rank tp_rank of tp_size (0: none) receives
        from: entry tp_rank of prefill_peer_addrs, else prefill_peer_addr. ValueError when the
        list does not have this worker's tp_size entries (unequal TP on prefill and decode is
        not supported: rank r pairs with rank r)."""
        if not self.prefill_peer_addrs:
            return self.prefill_peer_addr
        n = max(int(tp_size or 0), 1)
        if len(self.prefill_peer_addrs) != n or not 0 <= int(tp_rank) < n:
            raise ValueError("kv_hints prefill_peer_addrs has %d ranks; this worker is rank %d of tp_size %d "
                             "(prefill and decode pair only with equal tensor parallelism)"
                             % (len(self.prefill_peer_addrs), int(tp_rank), n))
        return self.prefill_peer_addrs[int(tp_rank)]


def _get(o: Any, k: str, default=None):
    if isinstance(o, dict):
        return o.get(k, default)
    return getattr(o, k, default)


def parse_hint(kv_hints: Any) -> Optional[KvcHint]:
    """The kvc action of a KvHintsEnvelope (or its dict form), or None. A kvc payload of the
    wrong shape raises ValueError."""
    if kv_hints is None:
        return None
    for a in _get(kv_hints, "actions", None) or []:
        if _get(a, "action_type") != ACTION_TYPE:
            continue
        p = _get(a, "payload", None) or {}
        if not isinstance(p, dict):
            raise ValueError("kv_hints kvc payload must be an object, got %s" % type(p).__name__)
        room = p.get("room")
        peers = p.get("prefill_peer_addrs") or []
        if not isinstance(peers, list) or not all(isinstance(x, str) for x in peers):
            raise ValueError("malformed kv_hints kvc payload %r: prefill_peer_addrs must be a list of strings" % (p,))
        try:
            return KvcHint(mode=str(p.get("mode", "")), session_id=str(p.get("session_id", "") or ""),
                           room=int(room) if room is not None else None,
                           prefill_peer_addr=str(p.get("prefill_peer_addr", "") or ""),
                           snapshot_seqlen=int(p.get("snapshot_seqlen", 0) or 0), role=str(p.get("role", "") or ""),
                           input_tokens=int(p.get("input_tokens", 0) or 0),
                           decision_id=str(p.get("decision_id", "") or ""),
                           full_context=bool(p.get("full_context", True)),
                           to_store=bool(p.get("to_store", False)), generation=int(p.get("generation", 0) or 0),
                           prefill_peer_addrs=list(peers),
                           load_prefix_tokens=int(p.get("load_prefix_tokens", 0) or 0),
                           load_generation=int(p.get("load_generation", 0) or 0),
                           receive_from=int(p.get("receive_from", 0) or 0))
        except (TypeError, ValueError) as e:
            raise ValueError("malformed kv_hints kvc payload %r: %s" % (p, e)) from None
    return None


def hint_of_req(req: Any) -> Optional[KvcHint]:
    """The kvc hint of an SGLang Req (its kv_hints), or None."""
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
