"""kvc.v1.WorkerBridgeService client (see proto/kvc/v1/bridge.proto for the contract)."""

from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence

import grpc

from . import metrics, wire

KV_KIND_K, KV_KIND_V, KV_KIND_COMBINED = 1, 2, 3
POOL_LAYOUT_MHA, POOL_LAYOUT_MLA = 1, 2
REASON_CAPACITY, REASON_CONTROL_PLANE, REASON_PREFIX_MISMATCH = 1, 2, 3
RELEASE_RELEASED, RELEASE_EVICTED = 1, 2
TRANSFER_SEED, TRANSFER_SNAPSHOT = 1, 2

_SERVICE = "/kvc.v1.WorkerBridgeService/"


class BridgeError(Exception):
    """A call failed; .code is the grpc.StatusCode (stable: INVALID_ARGUMENT, NOT_FOUND,
    FAILED_PRECONDITION, OUT_OF_RANGE, ...) and .details the sidecar's message."""

    def __init__(self, method: str, code, details: str):
        super().__init__("%s: %s: %s" % (method, code, details))
        self.method, self.code, self.details = method, code, details


@dataclass
class KVBuffer:
    """One layer buffer (K or V) of the worker's KV pool, as a shared-memory file region or a
    CUDA IPC handle. Buffers go in the order layer 0 K, layer 0 V, layer 1 K, ..."""

    layer: int
    kind: int  # KV_KIND_K, KV_KIND_V or KV_KIND_COMBINED (MLA)
    size_bytes: int
    shm_path: str = ""
    shm_offset: int = 0
    cuda_ipc_handle: bytes = b""
    cuda_device: int = 0
    cuda_offset: int = 0

    def _encode(self) -> wire.Writer:
        w = wire.Writer().int(1, self.layer).int(2, self.kind)
        if self.cuda_ipc_handle:
            w.msg(4, wire.Writer().bytes(1, self.cuda_ipc_handle).int(2, self.cuda_device).int(3, self.cuda_offset))
        else:
            w.msg(3, wire.Writer().str(1, self.shm_path).int(2, self.shm_offset))
        return w.int(5, self.size_bytes)


@dataclass
class TransferResult:
    ok: bool
    bytes: int
    tokens: int
    error: str
    duration_us: int
    aux: List[bytes] = field(default_factory=list)  # the sender's aux rows (SEED); empty for a snapshot


@dataclass
class StoreLoad:
    """LoadFromStore's answer: the bytes copied into the worker's pages, the tokens loaded, and
    the snapshot's generation and seqlen when it was read."""

    bytes: int
    tokens: int
    generation: int
    seqlen: int
    duration_us: int


@dataclass
class SnapshotStatus:
    exists: bool
    seqlen: int
    generation: int
    freshness_s: float
    prefill_worker: str
    last_pushed_len: int


@dataclass
class AttachStatus:
    sidecar_instance: str
    pool_registered: bool
    resident_sessions: int


@dataclass
class WorkerCommand:
    """One message of WatchCommands: exactly one of attach, release (a session id) or
    truncate ((session id, keep_tokens)) is set."""

    command_id: int
    reason: int
    attach: Optional[AttachStatus] = None
    release: Optional[str] = None
    truncate: Optional[tuple] = None


def decode_worker_command(raw: bytes) -> WorkerCommand:
    """Decodes one WatchCommandsResponse; malformed input raises ValueError."""
    f = wire.parse(raw)
    c = WorkerCommand(command_id=wire.as_int64(f.get(1)) & ((1 << 64) - 1), reason=wire.as_int64(f.get(2)))
    if 3 in f:
        a = wire.as_msg(f[3])
        c.attach = AttachStatus(wire.as_str(a.get(1)), bool(wire.as_int64(a.get(2))), wire.as_int64(a.get(3)))
    elif 4 in f:
        c.release = wire.as_str(wire.as_msg(f[4]).get(1))
    elif 5 in f:
        t = wire.as_msg(f[5])
        c.truncate = (wire.as_str(t.get(1)), wire.as_int64(t.get(2)))
    return c


class CommandStream:
    """An open WatchCommands stream: iterate for WorkerCommands; cancel() ends it (the iterator
    then raises BridgeError with code CANCELLED)."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> Iterator[WorkerCommand]:
        try:
            for raw in self._call:
                yield decode_worker_command(raw)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:  # not our own cancel()
                metrics.bridge_error("WatchCommands", e.code())
            raise BridgeError("WatchCommands", e.code(), e.details()) from None

    def cancel(self) -> None:
        self._call.cancel()


class WorkerBridge:
    """Client of the sidecar's WorkerBridge on a Unix socket.

    Typical SGLang hook points (see README.md): register_kv_pool once the KV pool exists;
    commit_session after each committed step of a session; release_session before freeing a
    session's pages (it returns only once no snapshot push reads them); prepare_receive /
    wait_receive around a P->D or snapshot transfer on decode; send_kv after each prefill chunk.
    """

    def __init__(self, socket_path: str, timeout_s: float = 30.0):
        # No idle timeout: the sidecar reads a closed bridge connection as a possible worker
        # death (it then probes /health), so the channel stays open while the worker lives.
        self._ch = grpc.insecure_channel("unix://" + socket_path, options=[("grpc.client_idle_timeout_ms", 2**31 - 1)])
        self._timeout = timeout_s

    def close(self) -> None:
        self._ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, body: bytes, timeout: Optional[float] = None) -> dict:
        fn = self._ch.unary_unary(_SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            raw = fn(body, timeout=timeout or self._timeout)
        except grpc.RpcError as e:
            metrics.bridge_error(method, e.code())
            raise BridgeError(method, e.code(), e.details()) from None
        return wire.parse(raw)

    def register_kv_pool(
        self,
        page_size: int,
        item_len: int,
        page_count: int,
        num_layers: int,
        buffers: Sequence[KVBuffer],
        model: str = "",
        layout: int = 0,
        tp_rank: int = 0,
        tp_size: int = 0,
        aux_item_lens: Sequence[int] = (),
    ):
        """Hands the pool to the sidecar. layout is POOL_LAYOUT_MHA (K0, V0, K1, V1, ...) or
        POOL_LAYOUT_MLA (one KV_KIND_COMBINED buffer per layer); tp_rank/tp_size name this rank;
        aux_item_lens are the bytes of one row of each aux (metadata) buffer.
        Returns (kv_bytes_per_token, transfer_endpoint)."""
        w = wire.Writer().int(1, page_size).int(2, item_len).int(3, page_count).int(4, num_layers)
        for b in buffers:
            w.msg(5, b._encode())
        w.str(6, model).int(7, layout).int(8, tp_rank).int(9, tp_size).packed(10, aux_item_lens)
        r = self._call("RegisterKVPool", w.done())
        return wire.as_int64(r.get(1)), wire.as_str(r.get(2))

    def commit_session(
        self, session_id: str, committed_len: int, pages: Iterable[int], token_ids: Iterable[int] = ()
    ) -> bool:
        """pages cover tokens [0, committed_len) in order; token_ids, when given, are the ids of
        [0, committed_len) (exactly committed_len of them, each in [0, 2^31)): the sidecar pushes
        them with the snapshot, so a load of it elsewhere rebuilds the request from them.
        Returns whether a push was enqueued."""
        w = wire.Writer().str(1, session_id).int(2, committed_len).packed(3, pages).packed(4, token_ids)
        return bool(self._call("CommitSession", w.done()).get(1))

    def release_session(self, session_id: str, evicted: bool = False) -> bool:
        """Returns after any in-flight push of the session was aborted; the pages may then be
        freed. Returns whether a push was aborted."""
        w = wire.Writer().str(1, session_id).int(2, RELEASE_EVICTED if evicted else RELEASE_RELEASED)
        return bool(self._call("ReleaseSession", w.done()).get(1))

    def prepare_receive(
        self, room: int, session_id: str, kind: int, pages: Sequence[int], tokens: int, source_peer_addr: str
    ) -> None:
        """Decode side: these pages (covering [0, tokens)) receive the transfer of room."""
        w = (
            wire.Writer()
            .int(1, room)
            .str(2, session_id)
            .int(3, kind)
            .packed(4, pages)
            .int(5, tokens)
            .str(6, source_peer_addr)
        )
        self._call("PrepareReceive", w.done())

    def wait_receive(self, room: int, timeout_s: float = 60.0) -> TransferResult:
        """Decode side: blocks until the room's transfer is done or failed."""
        w = wire.Writer().int(1, room).int(2, int(timeout_s * 1000))
        fn = self._ch.unary_unary(_SERVICE + "WaitReceive", request_serializer=None, response_deserializer=None)
        try:
            raw = fn(w.done(), timeout=timeout_s + 5)
        except grpc.RpcError as e:
            metrics.bridge_error("WaitReceive", e.code())
            raise BridgeError("WaitReceive", e.code(), e.details()) from None
        a = wire.parse_all(raw)
        r = {k: v[-1] for k, v in a.items()}
        return TransferResult(
            ok=bool(r.get(1)),
            bytes=wire.as_int64(r.get(2)),
            tokens=wire.as_int64(r.get(3)),
            error=wire.as_str(r.get(4)),
            duration_us=wire.as_int64(r.get(5)),
            aux=[bytes(x) for x in a.get(6, [])],
        )

    def send_kv(
        self,
        room: int,
        session_id: str,
        pages: Sequence[int],
        first_page: int = 0,
        last: bool = False,
        tokens: int = 0,
        aux: Sequence[bytes] = (),
        timeout_s: Optional[float] = None,
        to_store: bool = False,
        generation: int = 0,
    ) -> int:
        """Prefill side: send these pages (chunk starting at first_page of the transfer) to the
        decode side of room; with last, tokens is the transfer's total and aux the request's aux
        rows (one per aux buffer), which reach the receiver's WaitReceive. Blocks until the
        decode side prepared the room and the bytes moved. Returns bytes moved.

        With to_store the chunk goes into the prefill sidecar's own snapshot store instead, as the
        session's snapshot of generation (> 0): the SEED of a colocated decode worker, which loads
        it through the KvcLinker. tokens (the whole transfer's) is then needed on every chunk."""
        w = (
            wire.Writer()
            .int(1, room)
            .str(2, session_id)
            .packed(3, pages)
            .int(4, first_page)
            .bool(5, last)
            .int(6, tokens)
            .rbytes(7, aux)
            .bool(8, to_store)
            .int(9, generation)
        )
        return wire.as_int64(self._call("SendKV", w.done(), timeout=timeout_s).get(1))

    def load_from_store(
        self, session_id: str, generation: int, tokens: int, pages: Sequence[int], timeout_s: Optional[float] = None
    ) -> "StoreLoad":
        """Prefill side (prefill from the snapshot): the sidecar copies tokens [0, tokens) of the
        session's snapshot of generation (0 = any) from its own store into these pages of the
        worker's pool (covering [0, tokens) in order), holding the entry while it reads. A
        BridgeError NOT_FOUND / FAILED_PRECONDITION means the store cannot serve it (no
        snapshot, another generation, fewer tokens): prefill the whole context instead."""
        w = wire.Writer().str(1, session_id).int(2, generation).int(3, tokens).packed(4, pages)
        r = self._call("LoadFromStore", w.done(), timeout=timeout_s)
        return StoreLoad(
            bytes=wire.as_int64(r.get(1)),
            tokens=wire.as_int64(r.get(2)),
            generation=r.get(3) or 0,
            seqlen=wire.as_int64(r.get(4)),
            duration_us=wire.as_int64(r.get(5)),
        )

    def snapshot_status(self, session_id: str) -> SnapshotStatus:
        r = self._call("SnapshotStatus", wire.Writer().str(1, session_id).done())
        return SnapshotStatus(
            exists=bool(r.get(1)),
            seqlen=wire.as_int64(r.get(2)),
            generation=r.get(3) or 0,
            freshness_s=wire.as_double(r.get(4)),
            prefill_worker=wire.as_str(r.get(5)),
            last_pushed_len=wire.as_int64(r.get(6)),
        )

    def watch_commands(self, worker_instance: str) -> CommandStream:
        """Opens the worker's standing WatchCommands stream (no deadline): the attach status
        first, then release / truncate commands to carry out and acknowledge with ack_command."""
        fn = self._ch.unary_stream(_SERVICE + "WatchCommands", request_serializer=None, response_deserializer=None)
        return CommandStream(fn(wire.Writer().str(1, worker_instance).done()))

    def report_demand(
        self,
        waiting_requests: int,
        waiting_tokens: int,
        free_tokens: int,
        unevictable_tokens: int = 0,
        running_requests: int = 0,
        timeout_s: Optional[float] = None,
    ) -> None:
        """Decode side: requests waiting for pages (and the tokens they need in all) against the
        tokens the pool can give without releasing a session, the committed KV of the sessions
        its requests are using (unevictable) and how many requests hold their pages (running,
        pre-allocated or receiving). Sent on every change, 0 waiting when the queue drained."""
        w = (
            wire.Writer()
            .int(1, waiting_requests)
            .int(2, waiting_tokens)
            .int(3, free_tokens)
            .int(4, unevictable_tokens)
            .int(5, running_requests)
        )
        self._call("ReportDemand", w.done(), timeout=timeout_s)

    def ack_command(self, command_id: int, ok: bool, error: str = "", freed_tokens: int = 0) -> None:
        w = wire.Writer().int(1, command_id).bool(2, ok).str(3, error).int(4, freed_tokens)
        self._call("AckCommand", w.done())
