"""Test harness: real sidecar processes, a scripted control plane (a real gRPC
SidecarService on a loopback port, hand-encoded like the bridge), SGLang pools in /dev/shm."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent import futures
from types import SimpleNamespace
from typing import Dict, List, Optional

import grpc

from kvcentric_sglang import wire

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
WORKER_ROLE_PREFILL, WORKER_ROLE_DECODE = 1, 2
EVENT_KINDS = {
    1: "committed",
    2: "released",
    3: "evicted",
    4: "snapshot_ingested",
    5: "snapshot_evicted",
    6: "transfer_done",
    7: "transfer_failed",
}


def binary(name: str, module: str) -> str:
    """$KVC_BIN_DIR/name, else a fresh `go build` of module/cmd/name."""
    d = os.environ.get("KVC_BIN_DIR")
    if d and os.path.exists(os.path.join(d, name)):
        return os.path.join(d, name)
    if not shutil.which("go"):
        raise RuntimeError("%s not in $KVC_BIN_DIR and no Go toolchain to build it" % name)
    out = os.path.join(tempfile.mkdtemp(prefix="kvc-py-bin-"), name)
    subprocess.run(
        ["go", "build", "-o", out, "./cmd/" + name],
        cwd=os.path.join(REPO, module),
        check=True,
        env=dict(os.environ, CGO_ENABLED="0", GOTOOLCHAIN=os.environ.get("GOTOOLCHAIN", "go1.27.3")),
    )
    return out


class Sidecar:
    """One real kvc-sidecar-{prefill,decode} process (tcp transport) with a ready file."""

    def __init__(
        self,
        binary_path: str,
        wid: str,
        tmp: str,
        control_plane: str = "",
        extra: List[str] = (),
        sock: Optional[str] = None,
    ):
        self.binary, self.wid, self.cp, self.extra = binary_path, wid, control_plane, list(extra)
        self.dir = os.path.join(tmp, wid)
        os.makedirs(self.dir, exist_ok=True)
        self.sock = sock or os.path.join(self.dir, "bridge.sock")
        self.log_path = os.path.join(self.dir, "sidecar.log")
        self.proc = None
        self.start()

    def start(self):
        ready = os.path.join(self.dir, "ready.json")
        if os.path.exists(ready):
            os.unlink(ready)
        args = [
            self.binary,
            "--worker-id",
            self.wid,
            "--bridge-socket",
            self.sock,
            "--transport",
            "tcp",
            "--ready-file",
            ready,
            "--worker-health-interval",
            "0",
            "--log-level",
            "debug",
            "--insecure",
        ] + self.extra
        if self.cp:
            args += ["--control-plane", self.cp]
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stderr=self.log, stdout=self.log)
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("%s did not start: %s" % (self.wid, self.tail()))
            time.sleep(0.02)
        with open(ready) as f:
            self.ready = json.load(f)

    @property
    def peer_addr(self) -> str:
        return self.ready["peer_addr"]

    def tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def kill(self):
        """SIGKILL: a crashed sidecar."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()


# ---- scripted control plane ------------------------------------------------------------------


class ScriptedControlPlane:
    """A real kvc.v1.SidecarService on 127.0.0.1:0: welcomes every sidecar (epoch 1, a policy
    with small snapshot deltas), records hellos and session events, and sends the commands a
    test scripts (set_snapshot_target). It makes no routing decisions: the test plays the
    gateway and the router."""

    def __init__(self, delta_tokens: int = 16):
        self.delta = delta_tokens
        self.hellos: Dict[str, dict] = {}
        self.events: List[dict] = []
        self.acks: List[tuple] = []
        self._out: Dict[str, "queue.Queue"] = {}
        self._cv = threading.Condition()
        self._next = 1
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        h = grpc.method_handlers_generic_handler(
            "kvc.v1.SidecarService",
            {
                "Connect": grpc.stream_stream_rpc_method_handler(
                    self._connect, request_deserializer=None, response_serializer=None
                )
            },
        )
        self.server.add_generic_rpc_handlers((h,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.addr = "127.0.0.1:%d" % self.port
        self.server.start()

    def close(self):
        self.server.stop(0)

    def _welcome(self) -> bytes:
        policy = wire.Writer().int(16, self.delta).bool(20, True).int(23, 1)
        return wire.Writer().msg(1, wire.Writer().int(1, 1).str(2, "scripted-cp").msg(3, policy)).done()

    def _connect(self, request_iterator, context):
        first = wire.parse(next(request_iterator))
        if 1 not in first:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello first")
        h = wire.parse(first[1])
        wid = wire.as_str(h.get(1))
        q = queue.Queue()
        with self._cv:
            self.hellos[wid] = {
                "role": h.get(2) or 0,
                "peer_addr": wire.as_str(h.get(11)),
                "transfer_endpoint": wire.as_str(h.get(6)),
            }
            self._out[wid] = q
            self._cv.notify_all()

        def reader():
            try:
                for raw in request_iterator:
                    m = wire.parse(raw)
                    with self._cv:
                        if 4 in m:
                            e = wire.parse(m[4])
                            self.events.append(
                                {
                                    "worker": wid,
                                    "session": wire.as_str(e.get(1)),
                                    "kind": EVENT_KINDS.get(e.get(2) or 0, str(e.get(2))),
                                    "kv_len": wire.as_int64(e.get(3)),
                                    "generation": e.get(4) or 0,
                                    "detail": wire.as_str(e.get(8)),
                                }
                            )
                        elif 5 in m:
                            a = wire.parse(m[5])
                            self.acks.append((wid, a.get(1) or 0, bool(a.get(2)), wire.as_str(a.get(3))))
                        self._cv.notify_all()
            except grpc.RpcError:
                pass
            q.put(None)

        threading.Thread(target=reader, daemon=True).start()
        yield self._welcome()
        while True:
            m = q.get()
            if m is None or not context.is_active():
                return
            yield m

    def wait(self, pred, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not pred(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def set_snapshot_target(self, decode_wid: str, session: str, prefill_wid: str, generation: int = 1) -> int:
        p = self.hellos[prefill_wid]
        with self._cv:
            cid, self._next = self._next, self._next + 1
        cmd = (
            wire.Writer()
            .int(1, cid)
            .int(2, 1)
            .msg(
                3,
                wire.Writer()
                .str(1, session)
                .str(2, prefill_wid)
                .str(3, p["peer_addr"])
                .str(4, p["transfer_endpoint"])
                .int(5, generation),
            )
        )
        self._out[decode_wid].put(wire.Writer().msg(2, cmd).done())
        return cid


# ---- SGLang objects ------------------------------------------------------------------------------

PAGE, HEADS, HEAD_DIM, LAYERS, POOL_TOKENS = 16, 2, 8, 3, 512


def shm_path(tmp: str, name: str) -> str:
    return "/dev/shm/kvcpy-%s-%s" % (os.path.basename(tmp), name)


def mha_pool(tmp: str, name: str, size: int = POOL_TOKENS, layers: int = LAYERS):
    """SGLang's real MHATokenToKVPool on CPU (bf16), its buffers moved into a /dev/shm file."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from kvcentric_sglang import pool as kvpool

    p = MHATokenToKVPool(
        size=size,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    p._kvc_mem = kvpool.place_pool_in_shm(p, shm_path(tmp, name))
    return p


def mla_pool(tmp: str, name: str, size: int = POOL_TOKENS, layers: int = LAYERS):
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    from kvcentric_sglang import pool as kvpool

    p = MLATokenToKVPool(
        size=size,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    p._kvc_mem = kvpool.place_pool_in_shm(p, shm_path(tmp, name))
    return p


def metadata_buffers(size: int = 8):
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(
        size, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=16, max_top_logprobs_num=8
    )


def kv_args(pool, meta, gpu_id: int = 0):
    """KVArgs as SGLang's PrefillBootstrapQueue / DecodePreallocQueue._init_kv_manager fill them."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.gpu_id = 0, 0, 0, gpu_id
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = (list(x) for x in pool.get_contiguous_buf_infos())
    a.num_draft_entries = 0
    a.kv_layout = None
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.page_size = pool.page_size
    a.kv_head_num = a.total_kv_head_num = HEADS
    a.ib_device = ""
    return a


def server_args(sock: str, tp_size: int = 1):
    return SimpleNamespace(tp_size=tp_size, kvc_bridge_socket=sock, served_model_name="test-model")


def kv_manager(role: str, pool, meta, sidecar: "Sidecar"):
    """The kvcentric KV manager of a P/D worker (role "prefill" or "decode") on pool and meta, as
    SGLang's PrefillBootstrapQueue / DecodePreallocQueue make it: the class the hooked
    get_kv_class of that role's module returns, registering the pool with the sidecar."""
    from sglang.srt.disaggregation import decode as sdecode
    from sglang.srt.disaggregation import prefill as sprefill
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend

    mod, mode = (sprefill, DisaggregationMode.PREFILL) if role == "prefill" else (sdecode, DisaggregationMode.DECODE)
    be = TransferBackend("kvcentric")  # the enum member install() added
    return mod.get_kv_class(be, KVClassType.MANAGER)(kv_args(pool, meta), mode, server_args(sidecar.sock))


def bootstrap_queue(pmgr, p: "Sidecar"):
    """SGLang's PrefillBootstrapQueue around P's manager, with the fields create_sender reads
    (its bootstrap port: the prefill sidecar's peer port). Returns (queue, host, port)."""
    from sglang.srt.disaggregation import prefill as sprefill
    from sglang.srt.disaggregation.utils import TransferBackend

    host, port = p.peer_addr.rsplit(":", 1)
    pq = sprefill.PrefillBootstrapQueue.__new__(sprefill.PrefillBootstrapQueue)
    pq.transfer_backend, pq.kv_manager = TransferBackend("kvcentric"), pmgr
    pq.bootstrap_port, pq.max_input_len = int(port), 1 << 20
    return pq, host, int(port)


def token_bytes(pool, pages, n: int) -> bytes:
    """Bytes of tokens [0, n) laid over pages, every buffer (K0..,V0.. or C0..), in order."""
    import torch

    bufs = pool.kv_buffer if hasattr(pool, "kv_buffer") else pool.k_buffer + pool.v_buffer
    slots = torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in range(n)], dtype=torch.long)
    return b"".join(b[slots].contiguous().view(torch.uint8).numpy().tobytes() for b in bufs)


def fill_random(pool, pages, seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    bufs = pool.kv_buffer if hasattr(pool, "kv_buffer") else pool.k_buffer + pool.v_buffer
    for b in bufs:
        for pg in pages:
            b[pg * PAGE : (pg + 1) * PAGE] = torch.randn(b[pg * PAGE : (pg + 1) * PAGE].shape, generator=g).to(b.dtype)


def payload_json(
    mode="",
    role="",
    session_id="",
    room=None,
    prefill_peer_addr="",
    prefill_peer_addrs=(),
    snapshot_seqlen=0,
    to_store=False,
    generation=0,
    input_tokens=0,
    receive_from=0,
    **fields,
):
    """The ExecutionPayload JSON a test's decision shorthand stands for (the fields the policy and
    the gateway set for that mode; the plugin reads only the fields): a decode half (role
    "decode" or "") gets a receive unless the mode is DIRECT_TO_D (a SNAPSHOT one when the mode is
    RESEED_SNAPSHOT or a snapshot_seqlen is given), a prefill half (role "prefill" or "") a send
    (store_generation = generation with to_store). Other keyword arguments are payload fields."""
    from kvcentric_sglang import payload as P

    p = P.ExecutionPayload(
        mode=P.ENUMS["RouteMode"].get("ROUTE_MODE_" + mode, 0) if mode else 0,
        session_id=session_id,
        input_tokens=input_tokens,
    )
    if role:
        p.role = P.ROLE_PREFILL if role == "prefill" else P.ROLE_DECODE
    if role in ("", "decode") and mode != "DIRECT_TO_D":
        snap = mode == "RESEED_SNAPSHOT" or snapshot_seqlen > 0
        p.receive = P.ExecutionReceive(
            kind=P.TRANSFER_SNAPSHOT if snap else P.TRANSFER_SEED,
            peer_addr=prefill_peer_addr,
            peer_addrs=list(prefill_peer_addrs),
            tokens=snapshot_seqlen if snap else 0,
            from_token=receive_from,
        )
    if role in ("", "prefill") and mode not in ("DIRECT_TO_D", "RESEED_SNAPSHOT"):
        p.send = P.ExecutionSend(from_token=receive_from, store_generation=generation if to_store else 0)
    out = P.to_json(p)
    for half in ("receive", "send"):
        if half in out and room is not None:
            out[half]["room"] = room if isinstance(room, str) else str(room)
    out.update(fields)
    return out


def kvc_hints(**shorthand):
    """SGLang's KvHintsEnvelope carrying payload_json(**shorthand) as its kvc action."""
    from sglang.srt.managers.kv_hints import KvHintAction, KvHintsEnvelope

    return KvHintsEnvelope(
        protocol_version="1",
        message_id="m-%s" % shorthand.get("room", 0),
        actions=[
            KvHintAction(action_id="a1", action_type="kvc", action_version="2", payload=payload_json(**shorthand))
        ],
    )


def req(rid: str, input_ids, *, room=None, host=None, port=None, hints=None, max_new_tokens: int = 8, session=None):
    """A real SGLang Req."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        rid,
        None,
        array("q", input_ids),
        SamplingParams(max_new_tokens=max_new_tokens),
        bootstrap_host=host,
        bootstrap_port=port,
        bootstrap_room=room,
        kv_hints=hints,
        session=session,
        vocab_size=1000,
    )


def wait_poll(obj, want, timeout: float = 30.0):
    """Polls a sender / receiver like the scheduler does until it reports want (or Failed)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = obj.poll()
        if not seen or seen[-1] != s:
            seen.append(s)
        if s == want or s == KVPoll.Failed:
            return s, seen
        time.sleep(0.01)
    return obj.poll(), seen


def http_json(sidecar: "Sidecar", path: str):
    import urllib.request

    with urllib.request.urlopen("http://%s%s" % (sidecar.ready["http_addr"], path), timeout=10) as r:
        return json.loads(r.read())


def sessions_of(sidecar: "Sidecar") -> dict:
    return {s["session_id"]: s for s in http_json(sidecar, "/v1/sessions")}


def metrics(sidecar: "Sidecar", *names: str) -> Dict[str, Optional[float]]:
    """The values of the named metrics on the sidecar's /metrics (the first sample of each; None
    when it is absent)."""
    import re
    import urllib.request

    with urllib.request.urlopen("http://%s/metrics" % sidecar.ready["http_addr"], timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in names:
        m = re.search(r"^%s(?:\{[^}]*\})? (\S+)$" % name, text, re.M)
        out[name] = float(m.group(1)) if m else None
    return out


def streaming_session(session_id: str):
    """SGLang's streaming Session, as a client's open_session makes it."""
    from sglang.srt.session.session_controller import Session

    return Session(capacity_of_str_len=1 << 20, session_id=session_id, streaming=True)


def generation_req(rid: str, input_ids, hints, *, max_new_tokens: int = 4, vocab_size: int = 1000):
    """The request as the scheduler creates it (non-session path), through the hooked
    Scheduler._create_generation_req, its extra_key cleared as the radix cache expects."""
    from array import array

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams

    r = Scheduler._create_generation_req(
        SimpleNamespace(page_size=PAGE),
        SimpleNamespace(kv_hints=hints),
        rid,
        None,
        array("q", input_ids),
        SamplingParams(max_new_tokens=max_new_tokens),
        vocab_size=vocab_size,
    )
    r.extra_key = None
    return r


def turn_input(rid: str, input_ids, session_id: str, *, max_new_tokens: int = 5):
    """A session's next turn as the tokenizer hands it to Session.create_req (the fields it reads
    of a TokenizedGenerateReqInput): the full context on the open session, with the gateway's
    DIRECT_TO_D hint."""
    from sglang.srt.managers.io_struct import SessionParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SimpleNamespace(
        rid=rid,
        input_text=None,
        input_ids=list(input_ids),
        mm_inputs=None,
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        lora_id=None,
        session_params=SessionParams(id=session_id),
        custom_logit_processor=None,
        return_hidden_states=False,
        return_routed_experts=False,
        routed_experts_start_len=0,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        routed_dp_rank=None,
        disagg_prefill_dp_rank=None,
        priority=None,
        routing_key=None,
        extra_key=None,
        cache_salt=None,
        http_worker_ipc=None,
        time_stats=None,
        require_reasoning=False,
        return_sampling_mask=False,
        sampling_logprobs_mode="selected",
        kv_hints=kvc_hints(mode="DIRECT_TO_D", session_id=session_id),
    )


def push_snapshot(cp: ScriptedControlPlane, d: "Sidecar", p: "Sidecar", w: "Colocated", store, sid, prompt, out):
    """D's first turn of session sid (random KV), committed through the hook on w (attached to
    D's sidecar d and the process's bridge); the control plane points D's snapshots at P, so D's
    sidecar pushes the session into P's store. store: a WorkerBridge on P's sidecar. Returns (the
    pages of [0, n) in D's pool, the stored snapshot's status)."""
    assert cp.wait(lambda c: d.wid in c.hellos and p.wid in c.hellos), (d.tail(), p.tail())
    cp.set_snapshot_target(d.wid, sid, p.wid)
    r = w.first_turn(streaming_session(sid), prompt, out)
    n = len(prompt) + len(out)
    fill_random(w.kv, [x // PAGE for x in w.rtp.req_to_token[r.kv.req_pool_idx, :n:PAGE].tolist()], seed=5)
    assert w.streaming.try_cache_finished_req(r)  # CommitSession -> push D->P
    assert cp.wait(lambda c: any(e["kind"] == "snapshot_ingested" and e["session"] == sid for e in c.events)), (
        cp.events,
        d.tail(),
        p.tail(),
    )
    st = store.snapshot_status(sid)
    assert st.exists and st.seqlen == n, st
    return w.slot_pages(sid, n), st


class Colocated:
    """A colocated decode worker's KV side, built from SGLang's real classes as its scheduler
    builds them: MHATokenToKVPool (moved into /dev/shm), PagedTokenToKVPoolAllocator,
    ReqToTokenPool, UnifiedRadixCache (python tree core) with its StreamingSession."""

    def __init__(self, tmp: str, name: str, size: int = POOL_TOKENS, rows: int = 16, max_context: int = 1024):
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE))
        self.kv = mha_pool(tmp, name, size=size)
        self.alloc = PagedTokenToKVPoolAllocator(
            size=size, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=self.kv, need_sort=False
        )
        self.rtp = ReqToTokenPool(size=rows, max_context_len=max_context, device="cpu", enable_memory_saver=False)
        self.params = CacheInitParams(
            req_to_token_pool=self.rtp,
            token_to_kv_pool_allocator=self.alloc,
            page_size=PAGE,
            disable=False,
            tree_components=(ComponentType.FULL,),
        )
        self.cache = UnifiedRadixCache(params=self.params)
        self.streaming = self.cache.session
        self.bridge = self.registration = None  # attach()

    def first_turn(self, session, tokens, outputs):
        """A streaming session's first turn, admitted, run and finished the way the scheduler
        does it (row allocation, hand to the session, prompt checkpoint, finish). Returns the Req."""
        from array import array

        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        r = Req(
            rid="t0-%s" % session.session_id,
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=len(outputs)),
            session=session,
        )
        r.extra_key = None
        n = len(tokens) + len(outputs)
        cap = (n + PAGE - 1) // PAGE * PAGE
        self.rtp.alloc([r])
        self.rtp.write((r.kv.req_pool_idx, slice(0, cap)), self.alloc.alloc(cap))
        r.kv.kv_allocated_len = cap
        r.last_node = self.cache.root_node_handle()
        r.lock = self.cache.lock(r.last_node)
        self.cache.maybe_hand_to_session(r)
        self.cache.checkpoint(r, up_to=len(tokens) // PAGE * PAGE)
        r.output_ids = array("q", outputs)
        r.kv.kv_committed_len = n
        r.finished_reason = FINISH_LENGTH(length=len(outputs))
        return r

    def slot_pages(self, session_id: str, n: int):
        from kvcentric_sglang import sessions

        return sessions.slot_pages(self.streaming, self.streaming.slots[session_id], n)

    def attach(self, sock: str, process: bool = True):
        """Registers the pool with the sidecar on sock through a WorkerBridge and, when process,
        makes them the process's bridge and registration (what the hooks commit through).
        Returns (bridge, registration), also kept as self.bridge, self.registration."""
        from kvcentric_sglang import pool as kvpool
        from kvcentric_sglang import runtime
        from kvcentric_sglang.bridge import WorkerBridge

        self.bridge = WorkerBridge(sock)
        self.registration = kvpool.from_pool(self.kv)
        self.registration.register(self.bridge)
        if process:
            runtime.state.bridge, runtime.state.registration = self.bridge, self.registration
        return self.bridge, self.registration

    def committed_session(self, session_id: str, tokens, outputs):
        """A streaming session whose first turn (tokens, then outputs generated) finished and was
        cached into the session's slot (the commit hook: CommitSession). Returns the Session."""
        s = streaming_session(session_id)
        assert self.streaming.try_cache_finished_req(self.first_turn(s, tokens, outputs))
        return s

    def next_turn(self, session, full, rid: str, max_new_tokens: int = 5):
        """The session's next turn on the full context `full` as SGLang builds it
        (Session.create_req: the continuity hook strips the history, SGLang prepends it again)
        and as the scheduler tries to admit it (match_prefix over full[:-1]). Returns (the Req,
        the match result)."""
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        r = session.create_req(
            turn_input(rid, full, session.session_id, max_new_tokens=max_new_tokens), None, vocab_size=1000
        )
        assert r.to_finish is None and list(r.origin_input_ids) == list(full), r.to_finish
        r.extra_key = None
        return r, self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", full[:-1])), req=r))

    def linker(self, sock: str):
        """A KvcLinker on this worker's cache that registers the pool with the sidecar on sock
        itself (a colocated decode worker). Returns the linker."""
        from kvcentric_sglang.linker import KvcLinker

        lk = KvcLinker(
            SimpleNamespace(tp_size=1),
            self.params,
            components={"full"},
            extra_config={"bridge_socket": sock, "wait_timeout_s": 20},
        )
        self.cache.init_cache_linker(lk)
        return lk
