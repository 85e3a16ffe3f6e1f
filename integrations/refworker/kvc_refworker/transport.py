"""How the worker moves KV through its sidecar: two interchangeable paths.

- PluginTransport (when sglang is importable): the SAME plugin code a real SGLang worker runs,
  driven the way SGLang's scheduler drives it: KvcKVManager(KVArgs, mode, server_args) registers
  the pool (kv_data_ptrs/lens/item_lens from the pool's get_contiguous_buf_infos, K..K,V..V, and
  aux rows); prefill builds a KvcKVSender per room (session id set as the create_sender hook
  does), init(num_pages, aux_index), writes the aux row (first token) and send()s the pages, then
  polls to Success; decode builds a KvcKVReceiver (session id, kind and tokens set as the
  _create_receiver_and_enqueue hook does), init, send_metadata(pages, aux_index), polls to
  Success, and reads P's first token from the aux row. Commits and releases go through
  kvcentric_sglang.sessions (commit / release), as its StreamingSession hooks do.
- BridgeTransport: the plugin's WorkerBridge client called directly (no sglang: the GPU
  machine), with the same aux rows: the pool is registered with two aux buffers of AUX_ITEM
  bytes, P's last SendKV carries its first token and that token's logit (SendKVRequest.aux) and
  the decode side reads them from WaitReceiveResponse.aux, as SGLang's decode worker takes P's
  first token from the metadata buffer.
"""

import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

from kvcentric_sglang.bridge import TRANSFER_SEED, BridgeError


class TransferError(Exception):
    pass


@dataclass
class Received:
    bytes: int = 0
    duration_us: int = 0
    wall_s: float = 0.0
    first_token: Optional[int] = None  # from P's aux row
    first_logit: Optional[float] = None


AUX_ROWS = 256
AUX_ITEM = 64  # bytes per row of each aux buffer (SGLang's output_ids rows are int32 x 16)


def _pack_aux(token: int, logit: float):
    return [struct.pack("<i", token).ljust(AUX_ITEM, b"\0"), struct.pack("<f", logit).ljust(AUX_ITEM, b"\0")]


def _unpack_aux(rows) -> (Optional[int], Optional[float]):
    """(first token, its logit) from the two aux rows _pack_aux made; (None, None) when the
    transfer carried none (a snapshot, or a sender without aux rows)."""
    if len(rows) < 2 or len(rows[0]) < 4 or len(rows[1]) < 4:
        return None, None
    return struct.unpack_from("<i", rows[0])[0], struct.unpack_from("<f", rows[1])[0]


class BridgeTransport:
    name = "bridge"

    def __init__(self, bridge, pool, model_name: str, timeout_s: float):
        self.bridge, self.pool, self.timeout_s, self.model_name = bridge, pool, timeout_s, model_name
        self.kv_bytes_per_token, self.endpoint = bridge.register_kv_pool(
            pool.page_size,
            pool.item_len,
            pool.rows // pool.page_size,
            pool.layers,
            pool.bridge_buffers(),
            model=model_name,
            aux_item_lens=[AUX_ITEM, AUX_ITEM],
        )

    def send(
        self,
        room: int,
        session_id: str,
        pages: List[int],
        tokens: int,
        first_token: int,
        first_logit: float,
        first_page: int = 0,
    ) -> int:
        """pages cover [0, tokens); with first_page > 0 (a suffix-only receive) only the pages from
        first_page on are sent."""
        try:
            return self.bridge.send_kv(
                room,
                session_id,
                pages[first_page:],
                first_page=first_page,
                last=True,
                tokens=tokens,
                aux=_pack_aux(first_token, first_logit),
            )
        except BridgeError as e:
            raise TransferError("SendKV room %d: %s" % (room, e)) from e

    def load(self, session_id: str, generation: int, pages: List[int], tokens: int):
        """Prefill from the snapshot: the sidecar copies [0, tokens) of the session's snapshot from
        its store into pages (LoadFromStore)."""
        try:
            return self.bridge.load_from_store(session_id, generation, tokens, pages, timeout_s=self.timeout_s)
        except BridgeError as e:
            raise TransferError("LoadFromStore %s: %s" % (session_id, e)) from e

    def receive(self, room: int, session_id: str, kind: int, pages: List[int], tokens: int, peer: str) -> Received:
        t0 = time.monotonic()
        try:
            self.bridge.prepare_receive(room, session_id, kind, pages, tokens, peer)
            r = self.bridge.wait_receive(room, timeout_s=self.timeout_s)
        except BridgeError as e:
            raise TransferError("room %d: %s" % (room, e)) from e
        if not r.ok:
            raise TransferError("transfer of room %d failed: %s" % (room, r.error))
        if r.tokens and r.tokens != tokens:
            raise TransferError("transfer of room %d carried %d tokens, want %d" % (room, r.tokens, tokens))
        out = Received(bytes=r.bytes, duration_us=r.duration_us, wall_s=time.monotonic() - t0)
        if kind == TRANSFER_SEED:
            out.first_token, out.first_logit = _unpack_aux(r.aux)
        return out

    def commit(self, session_id: str, length: int, pages: List[int], token_ids: Optional[List[int]] = None) -> None:
        """token_ids: the ids of [0, length), pushed with the snapshot (None: unknown)."""
        self.bridge.commit_session(session_id, length, pages, token_ids or ())

    def release(self, session_id: str, evicted: bool) -> None:
        self.bridge.release_session(session_id, evicted=evicted)

    def reregister(self) -> None:
        self.bridge.register_kv_pool(
            self.pool.page_size,
            self.pool.item_len,
            self.pool.rows // self.pool.page_size,
            self.pool.layers,
            self.pool.bridge_buffers(),
            model=self.model_name,
            aux_item_lens=[AUX_ITEM, AUX_ITEM],
        )


class PluginTransport:
    name = "plugin"

    def __init__(self, bridge_socket: str, pool, role: str, model_name: str, timeout_s: float, poll_s: float = 0.0005):
        from types import SimpleNamespace

        import numpy as np

        os.environ.setdefault("KVC_SGLANG_WATCH", "0")  # its watcher runs SGLang-side release hooks
        from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from kvcentric_sglang import backend, sessions

        self.np, self.KVPoll, self.backend, self.sessions = np, KVPoll, backend, sessions
        self.pool, self.timeout_s, self.poll_s = pool, timeout_s, poll_s
        # The aux (metadata) buffers: host memory, one row per request in flight.
        self._aux = [np.zeros((AUX_ROWS, AUX_ITEM), dtype=np.uint8) for _ in range(2)]
        self._free_rows = list(range(AUX_ROWS))
        self._rows_lock = threading.Lock()
        ptrs, lens, items = pool.buf_infos()
        a = KVArgs()
        a.engine_rank, a.gpu_id, a.page_size = 0, max(0, pool.device.index or 0), pool.page_size
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = list(ptrs), list(lens), list(items)
        a.aux_data_ptrs = [int(x.ctypes.data) for x in self._aux]
        a.aux_data_lens = [int(x.nbytes) for x in self._aux]
        a.aux_item_lens = [AUX_ITEM] * len(self._aux)
        a.state_types, a.num_draft_entries, a.kv_layout = [], 0, None
        sa = SimpleNamespace(kvc_bridge_socket=bridge_socket, tp_size=1, served_model_name=model_name)
        mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.mgr = backend.KvcKVManager(a, mode, sa, False)
        self.kv_bytes_per_token, self.endpoint = self.mgr.kv_bytes_per_token, self.mgr.transfer_endpoint
        self.bridge = self.mgr.bridge

    def _row(self) -> int:
        with self._rows_lock:
            if not self._free_rows:
                raise TransferError("no free aux row (more than %d transfers in flight)" % AUX_ROWS)
            return self._free_rows.pop()

    def _free_row(self, i: int) -> None:
        with self._rows_lock:
            self._free_rows.append(i)

    def _wait(self, x, what: str):
        deadline = time.monotonic() + self.timeout_s
        while True:
            st = x.poll()
            if st == self.KVPoll.Success:
                return
            if st == self.KVPoll.Failed:
                try:
                    x.failure_exception()
                except Exception as e:  # noqa: BLE001 - the backend's KvcTransferError
                    raise TransferError(str(e)) from e
                raise TransferError("%s failed" % what)
            if time.monotonic() > deadline:
                x.abort()
                raise TransferError("%s: no result within %.0fs" % (what, self.timeout_s))
            time.sleep(self.poll_s)  # the scheduler's event loop polls the same way, once per step

    def load(self, session_id: str, generation: int, pages: List[int], tokens: int):
        """Prefill from the snapshot through the plugin's own bridge client (LoadFromStore)."""
        try:
            return self.bridge.load_from_store(session_id, generation, tokens, pages, timeout_s=self.timeout_s)
        except BridgeError as e:
            raise TransferError("LoadFromStore %s: %s" % (session_id, e)) from e

    def send(
        self,
        room: int,
        session_id: str,
        pages: List[int],
        tokens: int,
        first_token: int,
        first_logit: float,
        first_page: int = 0,
    ) -> int:
        row = self._row()
        try:
            s = self.backend.KvcKVSender(self.mgr, "", room)
            s.session_id = session_id  # what the create_sender hook sets from kv_hints
            s.skip_pages = first_page  # ... and receive_from: the decode side holds these pages
            s.init(len(pages), row)
            for buf, data in zip(self._aux, _pack_aux(first_token, first_logit)):  # MetadataBuffers.set_buf
                buf[row] = self.np.frombuffer(data, dtype=self.np.uint8)
            s.send(self.np.asarray(pages, dtype=self.np.int32), num_kv_tokens=tokens)
            self._wait(s, "SendKV room %d" % room)
            return int(s.get_transfer_metric().transfer_total_bytes or 0)
        finally:
            self._free_row(row)

    def receive(self, room: int, session_id: str, kind: int, pages: List[int], tokens: int, peer: str) -> Received:
        row = self._row()
        t0 = time.monotonic()
        try:
            self._aux[0][row] = 0
            r = self.backend.KvcKVReceiver(self.mgr, peer, room)
            r.session_id, r.kind, r.tokens = session_id, kind, tokens  # the _create_receiver_and_enqueue hook
            r.init(0)
            r.send_metadata(self.np.asarray(pages, dtype=self.np.int32), aux_index=row)
            self._wait(r, "room %d" % room)
            res = r.result
            out = Received(
                bytes=res.bytes if res else 0, duration_us=res.duration_us if res else 0, wall_s=time.monotonic() - t0
            )
            if res is not None and res.tokens and res.tokens != tokens:
                raise TransferError("transfer of room %d carried %d tokens, want %d" % (room, res.tokens, tokens))
            if kind == TRANSFER_SEED and res is not None and res.aux:
                out.first_token = struct.unpack_from("<i", self._aux[0][row].tobytes())[0]
                out.first_logit = struct.unpack_from("<f", self._aux[1][row].tobytes())[0]
            return out
        finally:
            self._free_row(row)

    def commit(self, session_id: str, length: int, pages: List[int], token_ids: Optional[List[int]] = None) -> None:
        """Through the plugin's sessions.commit: the ids go with CommitSession as SGLang's hook sends them."""
        self.sessions.commit(session_id, length, pages, token_ids)

    def release(self, session_id: str, evicted: bool) -> None:
        self.sessions.release(session_id, evicted=evicted)

    def reregister(self) -> None:
        self.mgr.registration.register(self.bridge)


def make(kind: str, bridge_socket: str, bridge, pool, role: str, model_name: str, timeout_s: float):
    """kind: auto (plugin when sglang is importable, else bridge), plugin or bridge."""
    if kind in ("auto", "plugin"):
        try:
            import sglang.srt.disaggregation.base.conn  # noqa: F401
        except Exception as e:  # noqa: BLE001
            if kind == "plugin":
                raise
            _ = e
        else:
            return PluginTransport(bridge_socket, pool, role, model_name, timeout_s)
    return BridgeTransport(bridge, pool, model_name, timeout_s)


def start_watch(xfer, worker, stop: threading.Event):
    """The sidecar's WatchCommands for this worker, through the plugin's WatchClient: a
    restarted sidecar gets the pool registered and the resident sessions committed again;
    release and truncate commands run on a thread of their own (the refworker's "scheduler"),
    woken by the client whenever a command arrives, and are acked."""
    from kvcentric_sglang.watch import WatchClient

    w = WatchClient(
        xfer.bridge,
        on_reregister=xfer.reregister,
        on_recommit=worker.recommit_all,
        on_release=lambda wk, sid, reason: wk.release_for_capacity(sid, reason),
        on_truncate=lambda wk, sid, keep: wk.truncate(sid, keep),
    ).start()

    def run():
        while not stop.is_set():
            w.wait_for(lambda c: not c.pending.empty() or stop.is_set(), timeout=5.0)
            w.run_pending(worker)

    threading.Thread(target=run, name="kvc-commands", daemon=True).start()
    return w
