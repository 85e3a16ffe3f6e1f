"""The plugin's Prometheus metrics (``kvc_plugin_*``), served by SGLang's own ``/metrics``.

SGLang 0.5.23 with ``--enable-metrics`` runs prometheus_client in multiprocess mode: the launcher
sets ``PROMETHEUS_MULTIPROC_DIR`` (``sglang.srt.utils.set_prometheus_multiproc_dir``) before it
spawns the scheduler processes, every process's metrics are written to files there, and the HTTP
server's ``/metrics`` (``add_prometheus_middleware``) reads them all through a
``MultiProcessCollector``. The plugin runs in those scheduler processes, so its counters made with
prometheus_client land in the same directory and appear on the same endpoint, with no port of
their own. Without ``--enable-metrics`` they stay in the process's memory and nobody reads them.

prometheus_client picks its value store (in memory or the multiprocess files) when it is first
imported, so it is imported, and the metrics made, at the first count, never at ``install()``:
``load_plugins()`` runs in the launcher before SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` there
(SGLang's own collectors wait the same way).

Every metric has a ``tp_rank`` label (the scheduler process's tensor-parallel rank, 0 without
TP): the collector adds the processes' counters up per label set, so a turn of a TP-N worker
counts once per rank; bytes are each rank's own shard. docs/sglang.md lists the metrics.

The package declares grpcio only (prometheus_client comes with SGLang): where prometheus_client
is not installed (kvc-refworker's bridge client without SGLang) every count is a no-op.
"""

from __future__ import annotations

import threading
from typing import Any, Dict

_lock = threading.Lock()
_m: Dict[str, Any] = {}
_off = False  # prometheus_client is not installed: nothing is counted

# kvc_plugin_turns_total{kind}: the execution payload's parts the plugin took on
TURN_KINDS = ("open", "local_prefill", "receive", "receive_snapshot", "send", "send_store", "load")
# kvc_plugin_kv_bytes_total{direction}
BYTE_DIRECTIONS = ("received", "sent", "stored", "loaded")
# kvc_plugin_transfer_failures_total{direction}
FAILURE_DIRECTIONS = ("receive", "receive_snapshot", "send", "send_store")
# kvc_plugin_store_loads_total{result}
STORE_RESULTS = ("hit", "miss", "mismatch", "error")
# kvc_plugin_sessions_total{op}
SESSION_OPS = ("committed", "released", "evicted")


def _metrics() -> Dict[str, Any]:
    global _off
    if _m or _off:
        return _m
    with _lock:
        if _m or _off:
            return _m
        try:
            from prometheus_client import Counter
        except ImportError:
            _off = True
            return _m

        def c(name, doc, *labels):
            return Counter(name, doc, labelnames=labels + ("tp_rank",))

        _m.update(
            turns=c(
                "kvc_plugin_turns_total",
                "Turns the kvcentric plugin acted on, by the part of the execution payload taken on.",
                "kind",
            ),
            kv_bytes=c(
                "kvc_plugin_kv_bytes_total",
                "KV bytes moved through the sidecar for this worker, by direction.",
                "direction",
            ),
            failures=c(
                "kvc_plugin_transfer_failures_total",
                "KV transfers of this worker that failed after they started, by direction.",
                "direction",
            ),
            store_loads=c(
                "kvc_plugin_store_loads_total",
                "Prefill-from-the-snapshot loads from the prefill sidecar's store, by result.",
                "result",
            ),
            store_tokens=c(
                "kvc_plugin_store_load_tokens_total",
                "Tokens loaded from the prefill sidecar's store instead of prefilled.",
            ),
            sessions=c(
                "kvc_plugin_sessions_total",
                "Session commits and releases the sidecar accepted through the bridge, by operation.",
                "op",
            ),
            bridge_errors=c(
                "kvc_plugin_bridge_errors_total",
                "WorkerBridge (sidecar) calls that failed, by call and gRPC code.",
                "call",
                "code",
            ),
        )
    return _m


def _rank() -> str:
    from . import runtime

    return str(int(getattr(runtime.state.registration, "tp_rank", 0) or 0))


def _inc(metric: str, n: float = 1, **labels) -> None:
    if n <= 0:
        return
    m = _metrics().get(metric)
    if m is not None:
        m.labels(tp_rank=_rank(), **labels).inc(n)


def turn(kind: str) -> None:
    """A turn whose payload part ``kind`` (TURN_KINDS) the plugin took on."""
    _inc("turns", kind=kind)


def kv_bytes(direction: str, n: int) -> None:
    """n KV bytes moved (BYTE_DIRECTIONS)."""
    _inc("kv_bytes", int(n or 0), direction=direction)


def transfer_failed(direction: str) -> None:
    """A transfer that started failed (FAILURE_DIRECTIONS)."""
    _inc("failures", direction=direction)


def store_load(result: str, tokens: int = 0) -> None:
    """A LoadFromStore's outcome (STORE_RESULTS) and, on a hit, the tokens loaded."""
    _inc("store_loads", result=result)
    if result == "hit":
        _inc("store_tokens", int(tokens or 0))


def session(op: str) -> None:
    """A CommitSession / ReleaseSession the sidecar accepted (SESSION_OPS)."""
    _inc("sessions", op=op)


def bridge_error(call: str, code: Any) -> None:
    """A failed WorkerBridge call: its method name and gRPC status code."""
    _inc("bridge_errors", call=call, code=getattr(code, "name", None) or str(code))
