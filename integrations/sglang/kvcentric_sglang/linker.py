"""KvcLinker: an out-of-tree SGLang ``UnifiedCacheLinker`` ("dynamic") that lands kvcentric
transfers in a colocated decode worker's own request slots.

Launch (colocated decode worker)::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "KvcLinker",
        "linker_module_path": "kvcentric_sglang.linker", "linker_extra_config": {}}'

A snapshot receive on D' (RESEED_SNAPSHOT, a seed stored by P first, a sidecar's load): the
request's kv_hints payload carries receive {kind: TRANSFER_KIND_SNAPSHOT, room, peer_addr,
tokens}: the prefill store holds [0, tokens) of the context. SGLang's match path asks
``lookup`` how many pages of the device-uncached tail are restorable: floor(tokens / page)
pages (only when the tail starts at token 0: the snapshot covers the session from its first token, and a transfer cannot
start mid-way). ``load`` receives the request-private device slots SGLang allocated;
``start_layer_wise_loading`` issues PrepareReceive(room, SNAPSHOT, pages, tokens) and a
background WaitReceive, and completes every layer of the batch's counter when the bytes landed
(the forward waits at layer 0). SGLang then prefills only the tail and the streaming session
takes over the row; CommitSession follows from the session hook.

Prefill from the snapshot on P (a prefill server launched with the same linker): the request
arrives with kv_hints {session_id, load_prefix_tokens, load_generation} (RouteExecution's). The
match path asks ``lookup`` about the device-uncached tail: floor(load_prefix_tokens / page) pages
when the tail starts at token 0 (a P whose radix tree already holds part of the prompt serves
that part itself and computes the rest). ``load`` copies them at once from the prefill
sidecar's own store into the request-private slots SGLang allocated (``LoadFromStore``, the
entry held while it is read): SGLang counts them as the request's prefix (``req.prefix_indices``
through ``prefix_device_indices``) and prefills only [load_prefix_tokens, input); the sender then
sends the whole context as usual. A load the store cannot serve (no snapshot, another
generation, fewer tokens) makes ``load`` answer False, and SGLang recomputes the whole prompt:
never slower than without the hint, never wrong.

The linker never offloads: snapshots are pushed by the decode sidecar from CommitSession.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import List, Optional, Tuple

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker

from . import metrics, runtime
from .bridge import TRANSFER_SNAPSHOT, BridgeError
from .payload import ExecutionPayload, peer_for

logger = logging.getLogger(__name__)

# rid -> the request's kvc hint and first-page tokens (set by the _create_generation_req hook),
# bounded: the oldest entries go first (a request is matched, and re-matched after a refused
# admission, within moments of its creation).
_hints: "OrderedDict[str, Tuple[ExecutionPayload, Optional[List[int]]]]" = OrderedDict()
_hints_lock = threading.Lock()
MAX_HINTS = 65536


def remember_hint(rid: str, hint: Optional[ExecutionPayload], first_page_tokens: Optional[List[int]] = None) -> None:
    if hint is None:
        return
    with _hints_lock:
        _hints[rid] = (hint, first_page_tokens)
        _hints.move_to_end(rid)
        while len(_hints) > MAX_HINTS:
            _hints.popitem(last=False)


def forget(rid: str) -> None:
    with _hints_lock:
        _hints.pop(rid, None)


def _hint(rid: str):
    with _hints_lock:
        return _hints.get(rid)


class _Load:
    def __init__(self, rid: str, hint: ExecutionPayload, pages: List[int], tokens: int):
        self.rid, self.hint, self.pages, self.tokens = rid, hint, pages, tokens
        self.result = None


class KvcLinker(UnifiedCacheLinker):
    """kvcentric transfers into request slots through SGLang's external-linker path."""

    def __init__(self, server_args, params, *, components=None, extra_config=None, forward_stream=None):
        from .plugin import verify_applied

        verify_applied()
        extra_config = dict(extra_config or {})
        self.server_args = server_args
        self.params = params
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kv_pool = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools = {PoolName.KV: kv_pool}
        self.layer_done_counter = LayerWiseLoadCounter(int(getattr(kv_pool, "layer_num", 1)))
        self.wait_timeout_s = float(extra_config.get("wait_timeout_s", 120.0))
        self._queued: List[_Load] = []
        self._lock = threading.Lock()
        self.loads_done = 0
        # prefill from the snapshot (P only): loads served from the store, tokens loaded, and
        # the loads it could not serve (the request then prefills everything)
        self.store_loads = 0
        self.store_load_tokens = 0
        self.store_load_misses = 0
        self.store_loaded: "OrderedDict[str, int]" = OrderedDict()  # rid -> tokens loaded (bounded)
        self.prefill = _is_prefill(server_args, extra_config)
        # Every rank must take the same branch of a load (SGLang reduces the hit, not the
        # load's answer), and each rank's store may refuse on its own: prefill from the
        # snapshot runs on tensor-parallel prefill servers only once that is agreed (not built).
        self.prefill_loads = self.prefill and int(getattr(server_args, "tp_size", 1) or 1) == 1
        if self.prefill and not self.prefill_loads:
            logger.warning("kvcentric linker: prefill from the snapshot is off on a tensor-parallel prefill server")
        self.bridge = runtime.state.bridge
        # On P the KV manager (created after the tree cache) registers the pool with the prefill
        # sidecar; the first load takes its bridge.
        if not self.prefill and self.bridge is None and extra_config.get("register", True):
            self.bridge = _register_colocated(server_args, kv_pool, extra_config)

    # -- match ----------------------------------------------------------------------------------

    def lookup(self, rid: str, transfers: List[PoolTransfer]) -> List[int]:
        got = _hint(rid)
        if got is None:
            return []
        hint, first_page = got
        if self.prefill:
            # load_prefix_tokens > 0: P's own store holds the session's snapshot of (at least)
            # [0, load_prefix_tokens) of this context (prefill from the snapshot)
            want = hint.load_prefix_tokens if hint.session_id and self.prefill_loads else 0
        else:
            # A snapshot receive: the prefill sidecar's store holds [0, receive.tokens) of this
            # request's context (RESEED_SNAPSHOT; a seed stored by P first, docs/sglang.md)
            r = hint.receive
            if r is None or r.kind != TRANSFER_SNAPSHOT or not (r.peer_addr or r.peer_addrs):
                return []
            want = r.tokens
        if want <= 0:
            return []
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if kv is None or not kv.keys:
            return []
        if first_page is not None and kv.keys[0] != _first_page_hash(first_page, self.page_size):
            # The uncached tail does not start at token 0 (part of the prompt is already in the
            # tree): a snapshot transfer covers [0, n) and cannot land mid-sequence.
            logger.info("kvcentric linker: %s: tail does not start at token 0; no snapshot load", rid)
            return []
        n = min(len(kv.keys), want // self.page_size)
        return list(range(1, n + 1))

    def load(self, rid: str, transfers: List[PoolTransfer]) -> bool:
        got = _hint(rid)
        kv = next((t for t in transfers if t.name == PoolName.KV), None)
        if got is None or kv is None or kv.device_indices is None or self.bridge is None:
            return False
        idx = kv.device_indices.tolist()
        pages = [int(x) // self.page_size for x in idx[:: self.page_size]]
        if self.prefill:
            return self._load_from_store(rid, got[0], pages, len(idx))
        with self._lock:
            self._queued.append(_Load(rid, got[0], pages, len(idx)))
        metrics.turn("receive_snapshot")
        return True

    def _load_from_store(self, rid: str, hint: ExecutionPayload, pages: List[int], tokens: int) -> bool:
        """P: copies [0, tokens) of the session's snapshot from the prefill sidecar's store into
        the request's private slots now (the scheduler thread; a copy inside this GPU's sidecar),
        before SGLang prepares the request, so that a refusal still falls back to recomputing."""
        metrics.turn("load")
        bridge = self.bridge or runtime.state.bridge
        if bridge is None:
            logger.warning("kvcentric linker: %s: no prefill sidecar registered; prefilling the whole prompt", rid)
            self.store_load_misses += 1
            metrics.store_load("error")
            return False
        self.bridge = bridge
        try:
            r = bridge.load_from_store(hint.session_id, hint.load_generation, tokens, pages)
        except BridgeError as e:
            # NOT_FOUND / FAILED_PRECONDITION (SNAPSHOT_CHANGED, BASE_MISMATCH) / a failed copy:
            # the store cannot serve it, SGLang computes the whole prompt
            logger.info(
                "kvcentric linker: %s: snapshot prefix of %s not loaded (%s); prefilling the whole prompt",
                rid,
                hint.session_id,
                e,
            )
            self.store_load_misses += 1
            metrics.store_load(_load_result(e.code))
            return False
        self.store_loads += 1
        metrics.store_load("hit", tokens)
        metrics.kv_bytes("loaded", r.bytes)
        self.store_load_tokens += tokens
        with self._lock:
            self.store_loaded[rid] = tokens
            while len(self.store_loaded) > MAX_HINTS:
                self.store_loaded.popitem(last=False)
        logger.debug(
            "kvcentric linker: %s: loaded %d tokens of %s (generation %d, %d B) from the store",
            rid,
            tokens,
            hint.session_id,
            r.generation,
            r.bytes,
        )
        return True

    # -- layer-wise loading ----------------------------------------------------------------------

    def start_layer_wise_loading(self) -> int:
        with self._lock:
            loads, self._queued = self._queued, []
        index = self.layer_done_counter.update_producer()
        if not loads:
            for layer in range(self.layer_done_counter.num_layers):
                self.layer_done_counter.complete(index, layer)
            return index
        # PrepareReceive and WaitReceive run off the scheduler thread; the forward waits on the
        # layer counter.
        threading.Thread(target=self._wait, args=(index, loads), name="kvc-linker-%d" % index, daemon=True).start()
        return index

    def _wait(self, index: int, loads: List[_Load]) -> None:
        reg = runtime.state.registration
        try:
            for ld in loads:
                h = ld.hint
                # With tensor parallelism, the prefill rank of this rank's index.
                peer = peer_for(h.receive, getattr(reg, "tp_rank", 0), getattr(reg, "tp_size", 0))
                self.bridge.prepare_receive(h.receive.room, h.session_id, TRANSFER_SNAPSHOT, ld.pages, ld.tokens, peer)
        except (BridgeError, ValueError) as e:
            metrics.transfer_failed("receive_snapshot")
            logger.error("kvcentric linker: PrepareReceive: %s", e)
            self.layer_done_counter.fail(index, RuntimeError(str(e)))
            return
        for ld in loads:
            try:
                ld.result = self.bridge.wait_receive(ld.hint.receive.room, timeout_s=self.wait_timeout_s)
            except BridgeError as e:
                metrics.transfer_failed("receive_snapshot")
                self.layer_done_counter.fail(index, RuntimeError("WaitReceive room %d: %s" % (ld.hint.receive.room, e)))
                return
            if not ld.result.ok:
                metrics.transfer_failed("receive_snapshot")
                self.layer_done_counter.fail(
                    index,
                    RuntimeError("snapshot transfer of room %d failed: %s" % (ld.hint.receive.room, ld.result.error)),
                )
                return
            metrics.kv_bytes("received", ld.result.bytes)
        self.loads_done += len(loads)
        for layer in range(self.layer_done_counter.num_layers):
            self.layer_done_counter.complete(index, layer)

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def cancel_queued_load(self, rid: str) -> bool:
        with self._lock:
            n = len(self._queued)
            self._queued = [q for q in self._queued if q.rid != rid]
            return len(self._queued) != n

    # -- no offloads ------------------------------------------------------------------------------

    def offload(self, transfers, session_id=None) -> bool:
        return False

    def num_completed_offloads(self) -> int:
        return 0

    def pop_completed_offload(self) -> bool:
        return False

    def reset(self) -> None:
        with self._lock:
            self._queued = []
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()


def _load_result(code) -> str:
    """kvc_plugin_store_loads_total's result of a refused LoadFromStore: NOT_FOUND (no snapshot
    of the session) a miss, FAILED_PRECONDITION (another generation, fewer tokens) a mismatch,
    anything else (the copy failed, the sidecar unreachable) an error."""
    import grpc

    if code == grpc.StatusCode.NOT_FOUND:
        return "miss"
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return "mismatch"
    return "error"


class _Key(list):
    """Token list carrying the request's hash namespace (as SGLang's RadixKey)."""

    extra_key = None
    cache_salt = None


def first_page_key(req, page: int) -> "_Key":
    k = _Key(list(req.origin_input_ids[:page]))
    k.extra_key, k.cache_salt = getattr(req, "extra_key", None), getattr(req, "cache_salt", None)
    return k


def _first_page_hash(tokens, page: int) -> str:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(tokens, None, page_size=page)[0]


def _is_prefill(server_args, extra_config) -> bool:
    """Whether this scheduler process is a P/D prefill server (extra_config "role" wins, then the
    server's --disaggregation-mode)."""
    role = extra_config.get("role")
    if role:
        return str(role) == "prefill"
    mode = getattr(server_args, "disaggregation_mode", None)
    if mode is None:
        try:
            from sglang.srt.runtime_context import get_disagg

            mode = get_disagg().disaggregation_mode
        except Exception:
            mode = None
    return str(getattr(mode, "value", mode) or "") == "prefill"


def _rank_and_gpu(server_args, extra_config):
    """(tp_rank, gpu id) of this scheduler process: extra_config wins, then SGLang's parallel
    state and the current CUDA device, then rank 0 on --base-gpu-id."""
    tp_rank = extra_config.get("tp_rank")
    if tp_rank is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            tp_rank = int(get_parallel().tp_rank)
        except Exception:
            tp_rank = 0
    gpu = extra_config.get("gpu_id")
    if gpu is None:
        try:
            import torch

            gpu = torch.cuda.current_device() if torch.cuda.is_available() else None
        except Exception:
            gpu = None
    if gpu is None:
        gpu = int(getattr(server_args, "base_gpu_id", 0) or 0)
    return int(tp_rank), int(gpu)


def _register_colocated(server_args, kv_pool, extra_config):
    """A colocated decode worker has no P/D KV manager: the linker registers the pool."""
    from . import pool as kvpool

    tp = int(getattr(server_args, "tp_size", 1) or 1)
    tp_rank, gpu = _rank_and_gpu(server_args, extra_config)
    path = extra_config.get("bridge_socket") or runtime.socket_path("decode", gpu)
    bridge = runtime.bridge_for(path)
    reg = kvpool.from_pool(kv_pool, tp_rank=tp_rank if tp > 1 else 0, tp_size=tp if tp > 1 else 0)
    reg.register(bridge)
    runtime.state.bridge, runtime.state.registration = bridge, reg
    runtime.state.page_size, runtime.state.role = reg.page_size, "decode"
    from . import demand, watch

    watch.start_for_process(bridge, reg)
    demand.start_for_process(bridge)
    return bridge
