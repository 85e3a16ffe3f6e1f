"""The ``kvcentric`` P/D transfer backend (``--disaggregation-transfer-backend kvcentric``).

Built on SGLang's own base classes (``sglang.srt.disaggregation.base.conn``) and mapped onto the
sidecar's WorkerBridge:

===============================  ==============================================================
SGLang                           WorkerBridge
===============================  ==============================================================
KvcKVManager(kv_args, mode)      RegisterKVPool (pool.from_kv_args: K..K,V..V -> K0,V0,...; MLA;
                                 aux_item_lens; tp rank/size)
KvcKVSender.send(pages, ...)     SendKV per chunk on the room's own ordered worker thread (the
                                 scheduler never blocks: SendKV waits until the decode side
                                 prepared the room); the last chunk carries the aux rows read
                                 from the metadata buffers (set_buf ran before the last send).
                                 With a to_store hint (SEED of a colocated D): SendKV(to_store,
                                 generation) into the prefill sidecar's own store, no decode
                                 side, no aux; D loads it through the KvcLinker
KvcKVReceiver.send_metadata      PrepareReceive(room, session, kind, pages, tokens, P's peer
                                 address = bootstrap_host:bootstrap_port), then a background
                                 WaitReceive; the aux rows are written into this request's
                                 metadata row BEFORE poll() reports KVPoll.Success
KvcKVBootstrapServer             nothing to serve (the sidecars pair the two sides by room)
===============================  ==============================================================

Session id and transfer kind come from the request's kv_hints ("kvc" action) through the
create_sender / _create_receiver_and_enqueue AFTER hooks (plugin.py): ``sender.session_id``,
``receiver.session_id``, ``receiver.kind``, ``receiver.tokens``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from types import SimpleNamespace
from typing import List, Optional

import numpy as np
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)

from . import metrics, runtime
from . import pool as kvpool
from .bridge import TRANSFER_SEED, BridgeError

logger = logging.getLogger(__name__)

# SendKV blocks until the decode side prepared the room (the prefill sidecar's --room-timeout,
# 60 s by default) and the bytes moved.
SEND_TIMEOUT_S = 180.0
WAIT_TIMEOUT_S = 180.0


class KvcTransferError(Exception):
    """A kvcentric transfer failed; the message carries the sidecar's gRPC code and detail."""


class _PrefillInfo(SimpleNamespace):
    pass


class _PrefillInfoTable:
    """The decode scheduler asks the manager for the prefill side's DP layout per bootstrap
    address. kvcentric pairs P and D rank to rank through the sidecars, so every address is one
    DP rank (dp_size 1)."""

    def get(self, addr, default=None):
        return _PrefillInfo(dp_size=1, follow_bootstrap_room=True, tp_size=1, attn_tp_size=1)


class KvcKVManager(BaseKVManager):
    """Registers this worker's KV pool (and aux row sizes) with its sidecar."""

    supports_role_switch = False
    supports_deferred_decode_kv_release = False
    enable_deferred_decode_kv_release = False
    supports_host_destination = False

    def __init__(self, args: KVArgs, disaggregation_mode, server_args, is_mla_backend: Optional[bool] = False):
        from .plugin import verify_applied

        verify_applied()
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        mode = getattr(disaggregation_mode, "value", str(disaggregation_mode))
        self.role = "prefill" if mode == "prefill" else "decode"
        self.prefill_info_table = _PrefillInfoTable()
        self.enable_all_cp_ranks_for_transfer = False
        self.attn_cp_size, self.attn_cp_rank = 1, 0
        self.transfer_infos = {}
        tp_size = int(getattr(server_args, "tp_size", 1) or 1)
        tp_rank = int(getattr(args, "engine_rank", 0) or 0) if tp_size > 1 else 0
        self.aux_ptrs: List[int] = list(getattr(args, "aux_data_ptrs", None) or [])
        self.aux_item_lens: List[int] = list(getattr(args, "aux_item_lens", None) or [])
        for p in self.aux_ptrs:
            if kvpool._device_of(p) is not None:
                raise kvpool.PoolUnsupported(
                    "SGLang's metadata (aux) buffers are in GPU memory (SGLANG_MOONCAKE_CUSTOM_MEM_POOL="
                    "INTRA_NODE_NVLINK?); kvcentric reads and writes aux rows in host memory: unset it"
                )
        self.registration = kvpool.from_kv_args(
            args,
            self.is_mla_backend,
            tp_rank=tp_rank,
            tp_size=tp_size if tp_size > 1 else 0,
            model=str(getattr(server_args, "served_model_name", "") or ""),
        )
        path = getattr(server_args, "kvc_bridge_socket", None) or runtime.socket_path(self.role, int(args.gpu_id))
        self.bridge = runtime.bridge_for(path)
        self.kv_bytes_per_token, self.transfer_endpoint = self.registration.register(self.bridge)
        runtime.state.bridge = self.bridge
        runtime.state.registration = self.registration
        runtime.state.page_size = self.registration.page_size
        runtime.state.role = self.role
        from . import demand, watch

        watch.start_for_process(self.bridge, self.registration)
        if self.role == "decode":
            demand.start_for_process(self.bridge)
        logger.info(
            "kvcentric: registered %s pool with %s: %d layers, %d pages of %d tokens, %d B/token",
            self.role,
            path,
            self.registration.num_layers,
            self.registration.page_count,
            self.registration.page_size,
            self.kv_bytes_per_token,
        )

    def register_to_bootstrap(self):
        """Nothing to register: the gateway gives decode the prefill sidecar's peer address."""

    def try_ensure_parallel_info(self, bootstrap_addr) -> bool:
        return True

    def clear_deferred_abort_state(self, room) -> None:
        pass

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        return False

    def _ensure_prefill_recompute_executor(self):
        raise KvcTransferError("kvcentric has no prefill DP-rank queries (every bootstrap address is one rank)")

    def submit_prefill_recompute(self, *a, **kw):
        raise KvcTransferError("kvcentric does not support retraction re-bootstrap")

    def register_buffer_to_engine(self):
        self.registration.register(self.bridge)

    def deregister_buffer_to_engine(self):
        pass


class KvcKVSender(BaseKVSender):
    """Prefill side of one room: SendKV per chunk, in order, on the room's own thread."""

    def __init__(
        self, mgr: KvcKVManager, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False
    ):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room) if bootstrap_room is not None else 0
        self.session_id = ""  # set by the create_sender hook from the request
        # to_store (kv_hints): SendKV into the prefill sidecar's own store as the session's
        # snapshot of generation, tokens = the prompt's (set by the create_sender hook)
        self.to_store = False
        self.generation = 0
        self.tokens = 0
        # Suffix-only receive (kv_hints receive_from, set by the create_sender hook): the decode
        # worker keeps the session's first skip_pages pages; only the pages past them are sent.
        self.skip_pages = 0
        self.num_pages = 0
        self.aux_index: Optional[int] = None
        self._sent_pages = 0
        self._sent_tokens = 0
        self._last_queued = False
        self._q: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._state = KVPoll.WaitingForInput
        self._error: Optional[str] = None
        self._bytes = 0
        self._started = None
        self._latency = None
        self._early_send_wait_event = None
        self.conclude_state = None

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_pages = int(num_kv_indices)
        self.aux_index = aux_index

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def refuse(self, why: str) -> None:
        """Fails the transfer before it starts (the request-carrying hook found it unservable)."""
        self._fail("room %d refused: %s" % (self.bootstrap_room, why))

    def send(self, kv_indices, state_indices=None, num_kv_tokens: Optional[int] = None, indices_event=None):
        if state_indices is not None and any(s is not None for s in state_indices):
            self._fail("state components cannot be transferred by kvcentric")
            return
        if indices_event is not None:
            indices_event.synchronize()
        if self._early_send_wait_event is not None:
            self._early_send_wait_event.synchronize()
        pages = [int(x) for x in np.asarray(kv_indices).reshape(-1)]
        if self._last_queued:
            # As Mooncake's sender, the chunk that reaches num_kv_indices pages is the last; a
            # later empty "last chunk" call has nothing left to send.
            if pages:
                self._fail("room %d: %d pages sent after the last chunk" % (self.bootstrap_room, len(pages)))
            return
        first = self._sent_pages
        self._sent_pages += len(pages)
        page_size = self.kv_mgr.registration.page_size
        self._sent_tokens += int(num_kv_tokens) if num_kv_tokens is not None else len(pages) * page_size
        last = self.num_pages > 0 and self._sent_pages >= self.num_pages
        self._last_queued = last
        if self.to_store and self.tokens <= 0:
            self._fail("room %d: a store seed needs the prompt's token count" % self.bootstrap_room)
            return
        aux: List[bytes] = []
        if last and self.kv_mgr.aux_ptrs and self.aux_index is not None and not self.to_store:
            # set_buf(req) ran before the last send; the row is reused once the request leaves,
            # so it is read now, on the scheduler thread.
            aux = kvpool.read_aux_rows(self.kv_mgr.aux_ptrs, self.kv_mgr.aux_item_lens, self.aux_index)
        if self.skip_pages > first and not self.to_store:
            # the decode worker holds these pages already (receive_from): not sent
            drop = min(self.skip_pages - first, len(pages))
            pages, first = pages[drop:], first + drop
            if not pages and not last:
                return
        with self._lock:
            if self._state == KVPoll.Failed:
                return
            self._state = KVPoll.Transferring
            if self._started is None:
                self._started = time.monotonic()
        self._q.put((pages, first, last, self._sent_tokens if last else 0, aux))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvc-send-%d" % self.bootstrap_room, daemon=True)
            self._thread.start()

    def _run(self):
        while True:
            pages, first, last, tokens, aux = self._q.get()
            try:
                if self.to_store:  # the store seed: every chunk names the whole prompt
                    n = self.kv_mgr.bridge.send_kv(
                        self.bootstrap_room,
                        self.session_id,
                        pages,
                        first_page=first,
                        last=last,
                        tokens=self.tokens,
                        timeout_s=SEND_TIMEOUT_S,
                        to_store=True,
                        generation=self.generation,
                    )
                else:
                    n = self.kv_mgr.bridge.send_kv(
                        self.bootstrap_room,
                        self.session_id,
                        pages,
                        first_page=first,
                        last=last,
                        tokens=tokens,
                        aux=aux,
                        timeout_s=SEND_TIMEOUT_S,
                    )
            except BridgeError as e:
                metrics.transfer_failed("send_store" if self.to_store else "send")
                self._fail("SendKV room %d chunk at page %d: %s" % (self.bootstrap_room, first, e))
                return
            metrics.kv_bytes("stored" if self.to_store else "sent", n)
            with self._lock:
                self._bytes += n
                if last:
                    self._state = KVPoll.Success
                    self._latency = time.monotonic() - self._started
                    return

    def _fail(self, msg: str):
        with self._lock:
            self._state = KVPoll.Failed
            self._error = msg
        logger.warning("kvcentric: %s", msg)

    def poll(self) -> KVPoll:
        with self._lock:
            return self._state

    def poll_pp_consensus(self) -> KVPoll:
        return self.poll()

    def failure_exception(self):
        raise KvcTransferError(self._error or "kvcentric transfer of room %d failed" % self.bootstrap_room)

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=self._latency, transfer_total_bytes=self._bytes or None)

    def mark_prefill_complete(self) -> None:
        pass

    def abort(self):
        self._fail("aborted")

    def clear(self):
        pass


class KvcKVReceiver(BaseKVReceiver):
    """Decode side of one room: PrepareReceive, then WaitReceive on a background thread."""

    def __init__(self, mgr: KvcKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr  # the prefill sidecar's peer address (set by the gateway)
        self.bootstrap_room = int(bootstrap_room) if bootstrap_room is not None else 0
        # set by the _create_receiver_and_enqueue hook from the request
        self.session_id = ""
        self.kind = TRANSFER_SEED
        self.tokens = 0
        # Suffix-only receive (kv_hints receive_from): P sends only the pages past it; set with
        # the request and its req_to_token table (whose row names the pages of a decode prefix).
        self.receive_from = 0
        self.req = None
        self.req_to_token = None
        self.require_staging = False
        self.abort_notified = False
        self.bootstrap_infos = None
        self.conclude_state = None
        self._lock = threading.Lock()
        self._state = KVPoll.Bootstrapping
        self._error: Optional[str] = None
        self.result = None  # bridge.TransferResult once done

    def refuse(self, why: str) -> None:
        """Fails the transfer before it starts (the request-carrying hook found it unservable)."""
        self._fail("room %d refused: %s" % (self.bootstrap_room, why))

    def init(self, prefill_dp_rank: int = 0):
        with self._lock:
            if self._state == KVPoll.Bootstrapping:
                self._state = KVPoll.WaitingForInput

    def send_metadata(
        self,
        kv_indices,
        aux_index: Optional[int] = None,
        state_indices=None,
        decode_prefix_len: Optional[int] = None,
        destination=None,
    ):
        if self.poll() == KVPoll.Failed:
            return
        if state_indices is not None and any(s is not None for s in state_indices):
            self._fail("state components cannot be received by kvcentric")
            return
        ps = self.kv_mgr.registration.page_size
        if decode_prefix_len or self.receive_from:
            pages = self._pages_with_prefix(int(decode_prefix_len or 0), ps)
            if pages is None:
                return
            tokens = self.tokens
        else:
            pages = [int(x) for x in np.asarray(kv_indices).reshape(-1)]
            tokens = self.tokens or len(pages) * ps
        need = (tokens + ps - 1) // ps
        if need > len(pages):
            self._fail("%d pages cannot hold %d tokens" % (len(pages), tokens))
            return
        pages = pages[:need]
        self.aux_index = aux_index
        with self._lock:
            if self._state == KVPoll.Failed:
                return
            self._state = KVPoll.Transferring
        # PrepareReceive makes the decode sidecar offer the pages to the prefill sidecar (a
        # network round trip, up to 10 s when P is unreachable): never on the scheduler thread.
        threading.Thread(
            target=self._wait, args=(pages, tokens), name="kvc-recv-%d" % self.bootstrap_room, daemon=True
        ).start()

    def _pages_with_prefix(self, prefix: int, ps: int) -> Optional[List[int]]:
        """The room's pages covering [0, tokens) when this worker already holds [0, prefix) of
        the context (SGLang's decode_prefix_len: its streaming session's or radix cache's match;
        SGLang gives send_metadata only the pages past it). P sends from page receive_from // ps
        (kv_hints receive_from: what the control plane says D keeps), so:

        * [0, receive_from): this worker's own pages, never written (P does not send them);
        * [receive_from, prefix): held here too, but P sends them: they land in page 0 (SGLang's
          padded page, never read as KV), so KV that the radix tree or the session owns is never
          overwritten;
        * [prefix, tokens): the pages SGLang pre-allocated, written by P.

        A receive_from beyond what this worker holds is refused (P would skip KV it lacks).
        Returns None after failing the room."""
        rf = self.receive_from // ps * ps
        if rf > prefix:
            self._fail(
                "room %d: the control plane says this worker keeps %d tokens of session %s (receive_from) "
                "but it holds %d of them (its decode prefix); run the P/D decode worker with "
                "--enable-streaming-session --disaggregation-decode-enable-radix-cache so the session's KV "
                "is kept, or the gateway reseeds" % (self.bootstrap_room, rf, self.session_id, prefix)
            )
            return None
        if self.req is None or self.req_to_token is None or getattr(self.req, "kv", None) is None:
            self._fail(
                "room %d: a decode prefix of %d tokens without the request's req_to_token row"
                % (self.bootstrap_room, prefix)
            )
            return None
        tokens = self.tokens
        if not 0 < tokens or prefix >= tokens:
            self._fail("room %d: decode prefix %d of a %d-token context" % (self.bootstrap_room, prefix, tokens))
            return None
        row = self.req_to_token[self.req.kv.req_pool_idx, :tokens]
        pages = [int(x) // ps for x in row[::ps].tolist()]
        held = prefix // ps  # whole pages of [0, prefix); a partial last one is the session's own tail
        return pages[: rf // ps] + [0] * (held - rf // ps) + pages[held:]

    def _wait(self, pages, tokens):
        try:
            self.kv_mgr.bridge.prepare_receive(
                self.bootstrap_room, self.session_id, self.kind, pages, tokens, self.bootstrap_addr
            )
        except BridgeError as e:
            metrics.transfer_failed("receive")
            self._fail("PrepareReceive room %d: %s" % (self.bootstrap_room, e))
            return
        try:
            res = self.kv_mgr.bridge.wait_receive(self.bootstrap_room, timeout_s=WAIT_TIMEOUT_S)
        except BridgeError as e:
            metrics.transfer_failed("receive")
            self._fail("WaitReceive room %d: %s" % (self.bootstrap_room, e))
            return
        self.result = res
        if not res.ok:
            metrics.transfer_failed("receive")
            self._fail("transfer of room %d failed: %s" % (self.bootstrap_room, res.error))
            return
        metrics.kv_bytes("received", res.bytes)  # landed in this worker's pages
        err = None
        with self._lock:  # an aborted receiver's metadata row may already be someone else's
            if self._state == KVPoll.Failed:
                return
            if self.kv_mgr.aux_ptrs and self.aux_index is not None and self.kind == TRANSFER_SEED:
                try:
                    kvpool.write_aux_rows(self.kv_mgr.aux_ptrs, self.kv_mgr.aux_item_lens, self.aux_index, res.aux)
                except ValueError as e:
                    err = "room %d: aux rows: %s" % (self.bootstrap_room, e)
            if err is None:
                self._state = KVPoll.Success  # only after the aux row is in place
        if err is not None:
            metrics.transfer_failed("receive")
            self._fail(err)

    def _fail(self, msg: str):
        with self._lock:
            self._state = KVPoll.Failed
            self._error = msg
        logger.warning("kvcentric: %s", msg)

    def poll(self) -> KVPoll:
        with self._lock:
            return self._state

    def failure_exception(self):
        raise KvcTransferError(self._error or "kvcentric transfer of room %d failed" % self.bootstrap_room)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """The decode sidecar fails the room itself (its --room-timeout); nothing to notify."""

    def is_abort_release_safe(self) -> bool:
        return True

    def abort(self):
        self._fail("aborted")

    def clear(self):
        pass


class KvcKVBootstrapServer(BaseKVBootstrapServer):
    """SGLang starts a bootstrap server on prefill; kvcentric needs none (the sidecars pair the
    two sides of a room), so this one only records its address."""

    def __init__(self, host: str, port: int, *args, **kwargs):
        self.host, self.port = host, port

    def run(self):
        pass

    def close(self):
        pass
