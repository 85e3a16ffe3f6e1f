"""wire.py's hand-written messages against the committed API image, proto/api.binpb (the
FileDescriptorSet `make proto-image` writes with buf).

Every WorkerBridge call goes through a real gRPC server on a Unix socket that records the bytes
bridge.py sends and answers with bytes the real protobuf runtime builds from the image. Each
request is walked field by field against its message in the image (every field number must exist
there with the wire type of its declared type, nested messages too) and decoded by protobuf, whose
values must be the ones bridge.py was given; each answer's fields must come out of bridge.py's
decoder with the values protobuf put in. The scripted control plane of the tests (kvctest.py, the
other user of wire.py) is checked the same way against kvc.v1.SidecarService, and the integer
constants bridge.py and kvctest.py use against the enums of the image. payload.py, the codec of the
kv_hints execution payload (kvc.v1.ExecutionPayload in protojson), is checked field by field (name,
number, JSON name, type) and enum by enum against the image, and against protobuf's own JSON. A
drift names the field.
"""

import os
import queue
import tempfile
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import kvctest
from kvcentric_sglang import bridge
from kvcentric_sglang import payload as kvc_payload
from kvcentric_sglang.bridge import KVBuffer, WorkerBridge

IMAGE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "proto", "api.binpb")
PKG = "kvc.v1."

_FD = descriptor_pb2.FieldDescriptorProto
_I64_TYPES = {_FD.TYPE_DOUBLE, _FD.TYPE_FIXED64, _FD.TYPE_SFIXED64}
_I32_TYPES = {_FD.TYPE_FLOAT, _FD.TYPE_FIXED32, _FD.TYPE_SFIXED32}
_LEN_TYPES = {_FD.TYPE_STRING, _FD.TYPE_BYTES, _FD.TYPE_MESSAGE}
_TYPE_NAMES = {v: k[len("TYPE_") :].lower() for k, v in _FD.Type.items()}


@pytest.fixture(scope="module")
def pool():
    fds = descriptor_pb2.FileDescriptorSet.FromString(open(IMAGE, "rb").read())
    p = descriptor_pool.DescriptorPool()
    pending = {f.name: f for f in fds.file}
    while pending:  # dependencies first
        ready = [f for f in pending.values() if all(d not in pending for d in f.dependency)]
        assert ready, "proto/api.binpb: unresolvable imports among %s" % sorted(pending)
        for f in ready:
            p.Add(f)
            del pending[f.name]
    return p


def _cls(pool, name):
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(PKG + name))


def _repeated(fd) -> bool:
    r = getattr(fd, "is_repeated", None)  # protobuf >= 6; label before
    return r if r is not None else fd.label == fd.LABEL_REPEATED


def _wire_types(fd):
    """The wire types a parser of fd accepts: its type's, and LEN for a packed repeated scalar."""
    if fd.type in _LEN_TYPES:
        return {2}
    own = 1 if fd.type in _I64_TYPES else 5 if fd.type in _I32_TYPES else 0
    return {own, 2} if _repeated(fd) else {own}


def _fields(raw: bytes):
    """(number, wire type, value) of every field of raw; independent of wire.py's parser."""
    i, out = 0, []

    def varint():
        nonlocal i
        shift = v = 0
        while True:
            c = raw[i]
            i += 1
            v |= (c & 0x7F) << shift
            if not c & 0x80:
                return v
            shift += 7

    while i < len(raw):
        key = varint()
        num, wt = key >> 3, key & 7
        if wt == 0:
            v = varint()
        elif wt in (1, 5):
            n = 8 if wt == 1 else 4
            v, i = raw[i : i + n], i + n
        elif wt == 2:
            n = varint()
            v, i = raw[i : i + n], i + n
        else:
            raise AssertionError("wire type %d at byte %d" % (wt, i))
        out.append((num, wt, v))
    return out


def schema_problems(raw: bytes, desc, path: str):
    """Every field of raw must exist in desc with a wire type its declared type allows."""
    problems = []
    for num, wt, v in _fields(raw):
        fd = desc.fields_by_number.get(num)
        if fd is None:
            problems.append(
                "%s: wire.py writes field %d (wire type %d), which %s in proto/api.binpb does not have"
                % (path, num, wt, desc.full_name)
            )
        elif wt not in _wire_types(fd):
            problems.append(
                "%s.%s: wire.py writes field %d as wire type %d, the image declares %s%s (wire type %s)"
                % (
                    path,
                    fd.name,
                    num,
                    wt,
                    "repeated " if _repeated(fd) else "",
                    _TYPE_NAMES[fd.type],
                    " or ".join(map(str, sorted(_wire_types(fd)))),
                )
            )
        elif fd.type == _FD.TYPE_MESSAGE:
            problems += schema_problems(v, fd.message_type, "%s.%s" % (path, fd.name))
    return problems


def value_problems(msg, want: dict, path: str):
    """msg (decoded by protobuf) holds exactly want: {field name: value, nested dict or list of dicts}."""
    problems = []
    desc = msg.DESCRIPTOR
    for name, w in want.items():
        fd = desc.fields_by_name.get(name)
        if fd is None:
            problems.append("%s.%s: not a field of %s in proto/api.binpb" % (path, name, desc.full_name))
            continue
        got = getattr(msg, name)
        where = "%s.%s (field %d)" % (path, name, fd.number)
        if isinstance(w, dict):
            problems += value_problems(got, w, where)
        elif isinstance(w, list) and w and isinstance(w[0], dict):
            if len(got) != len(w):
                problems.append("%s: %d elements, want %d" % (where, len(got), len(w)))
            for i, (g, x) in enumerate(zip(got, w)):
                problems += value_problems(g, x, "%s[%d]" % (where, i))
        else:
            g = list(got) if _repeated(fd) else got
            if g != w:
                problems.append("%s: protobuf reads %r, the Python encoder was given %r" % (where, g, w))
    for fd, _ in msg.ListFields():
        if fd.name not in want:
            problems.append(
                "%s.%s (field %d): set, but nothing was given for it (a value under the wrong number?)"
                % (path, fd.name, fd.number)
            )
    return problems


def build(cls, d: dict):
    m = cls()
    _fill(m, d)
    return m


def _fill(m, d: dict):
    for name, v in d.items():
        if isinstance(v, dict):
            _fill(getattr(m, name), v)
            if not v:
                getattr(m, name).SetInParent()
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for x in v:
                _fill(getattr(m, name).add(), x)
        elif isinstance(v, list):
            getattr(m, name).extend(v)
        else:
            setattr(m, name, v)


class RecordingSidecar:
    """A real kvc.v1.WorkerBridgeService on a Unix socket: records each request's bytes and
    answers with the bytes set for its method (a list of messages for a server stream)."""

    def __init__(self, pool, sock: str):
        self.service = pool.FindServiceByName(PKG + "WorkerBridgeService")
        self.requests, self.answers = [], {}
        handlers = {}
        for m in self.service.methods:
            if m.server_streaming:
                handlers[m.name] = grpc.unary_stream_rpc_method_handler(self._stream(m.name))
            else:
                handlers[m.name] = grpc.unary_unary_rpc_method_handler(self._unary(m.name))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.service.full_name, handlers),))
        self.server.add_insecure_port("unix://" + sock)
        self.server.start()

    def _unary(self, name):
        def h(req, ctx):
            self.requests.append((name, req))
            return self.answers.get(name, b"")

        return h

    def _stream(self, name):
        def h(req, ctx):
            self.requests.append((name, req))
            yield from self.answers.get(name, [])

        return h


# Each case: the bridge.py method, how it is called, the request protobuf must read (field names of
# the image), the answer to send (built by protobuf) and what bridge.py must return for each of the
# answer's fields.
U64 = (1 << 64) - 3  # a uint64 above int64's range
CASES = [
    dict(
        method="RegisterKVPool",
        client="register_kv_pool",
        call=lambda b: b.register_kv_pool(
            16,
            4096,
            100,
            2,
            [
                KVBuffer(layer=1, kind=bridge.KV_KIND_V, size_bytes=409600, shm_path="/dev/shm/kvc-x", shm_offset=4096),
                KVBuffer(
                    layer=1,
                    kind=bridge.KV_KIND_K,
                    size_bytes=8192,
                    cuda_ipc_handle=b"\x01\x02" * 32,
                    cuda_device=3,
                    cuda_offset=65536,
                ),
            ],
            model="tiny",
            layout=bridge.POOL_LAYOUT_MLA,
            tp_rank=1,
            tp_size=2,
            aux_item_lens=[4, 8, 3],
        ),
        request={
            "page_size": 16,
            "item_len": 4096,
            "page_count": 100,
            "num_layers": 2,
            "buffers": [
                {"layer": 1, "kind": 2, "size_bytes": 409600, "shm": {"path": "/dev/shm/kvc-x", "offset": 4096}},
                {
                    "layer": 1,
                    "kind": 1,
                    "size_bytes": 8192,
                    "cuda": {"ipc_handle": b"\x01\x02" * 32, "device": 3, "offset": 65536},
                },
            ],
            "model": "tiny",
            "layout": 2,
            "tp_rank": 1,
            "tp_size": 2,
            "aux_item_lens": [4, 8, 3],
        },
        answer={"kv_bytes_per_token": 12288, "transfer_endpoint": "tcp://127.0.0.1:7001"},
        returns={"kv_bytes_per_token": lambda r: r[0], "transfer_endpoint": lambda r: r[1]},
    ),
    dict(
        method="CommitSession",
        client="commit_session",
        call=lambda b: b.commit_session("s-1", 5, [3], [7, 0, (1 << 31) - 1, 9, 151643]),
        request={"session_id": "s-1", "committed_len": 5, "pages": [3], "token_ids": [7, 0, (1 << 31) - 1, 9, 151643]},
        answer={"push_enqueued": True},
        returns={"push_enqueued": lambda r: r},
    ),
    dict(
        method="ReleaseSession",
        client="release_session",
        call=lambda b: b.release_session("s-2", evicted=True),
        request={"session_id": "s-2", "reason": 2},
        answer={"push_aborted": True},
        returns={"push_aborted": lambda r: r},
    ),
    dict(
        method="PrepareReceive",
        client="prepare_receive",
        call=lambda b: b.prepare_receive(7, "s-3", bridge.TRANSFER_SNAPSHOT, [5, 6], 20, "10.0.0.1:7000"),
        request={
            "room": 7,
            "session_id": "s-3",
            "kind": 2,
            "pages": [5, 6],
            "tokens": 20,
            "source_peer_addr": "10.0.0.1:7000",
        },
        answer={},
        returns={},
    ),
    dict(
        method="WaitReceive",
        client="wait_receive",
        call=lambda b: b.wait_receive(8, timeout_s=2.5),
        request={"room": 8, "timeout_ms": 2500},
        answer={
            "ok": True,
            "bytes": 1 << 33,
            "tokens": 20,
            "error": "late",
            "duration_us": 1500,
            "aux": [b"a", b"", b"\x00c"],
        },
        returns={
            "ok": lambda r: r.ok,
            "bytes": lambda r: r.bytes,
            "tokens": lambda r: r.tokens,
            "error": lambda r: r.error,
            "duration_us": lambda r: r.duration_us,
            "aux": lambda r: r.aux,
        },
    ),
    dict(
        method="SendKV",
        client="send_kv",
        call=lambda b: b.send_kv(
            9, "s-4", [1, 2], first_page=4, last=True, tokens=30, aux=[b"x", b""], to_store=True, generation=U64
        ),
        request={
            "room": 9,
            "session_id": "s-4",
            "pages": [1, 2],
            "first_page": 4,
            "last": True,
            "tokens": 30,
            "aux": [b"x", b""],
            "to_store": True,
            "generation": U64,
        },
        answer={"bytes": 999},
        returns={"bytes": lambda r: r},
    ),
    dict(
        method="LoadFromStore",
        client="load_from_store",
        call=lambda b: b.load_from_store("s-6", U64, 48, [3, 9, 4]),
        request={"session_id": "s-6", "generation": U64, "tokens": 48, "pages": [3, 9, 4]},
        answer={"bytes": 1 << 33, "tokens": 48, "generation": U64, "seqlen": 50, "duration_us": 700},
        returns={
            "bytes": lambda r: r.bytes,
            "tokens": lambda r: r.tokens,
            "generation": lambda r: r.generation,
            "seqlen": lambda r: r.seqlen,
            "duration_us": lambda r: r.duration_us,
        },
    ),
    dict(
        method="SnapshotStatus",
        client="snapshot_status",
        call=lambda b: b.snapshot_status("s-5"),
        request={"session_id": "s-5"},
        answer={
            "exists": True,
            "seqlen": 77,
            "generation": U64,
            "freshness_s": 0.25,
            "prefill_worker": "p-1",
            "last_pushed_len": 64,
        },
        returns={
            "exists": lambda r: r.exists,
            "seqlen": lambda r: r.seqlen,
            "generation": lambda r: r.generation,
            "freshness_s": lambda r: r.freshness_s,
            "prefill_worker": lambda r: r.prefill_worker,
            "last_pushed_len": lambda r: r.last_pushed_len,
        },
    ),
    dict(
        method="ReportDemand",
        client="report_demand",
        call=lambda b: b.report_demand(3, 1 << 33, 4096, unevictable_tokens=1 << 34, running_requests=7),
        request={
            "waiting_requests": 3,
            "waiting_tokens": 1 << 33,
            "free_tokens": 4096,
            "unevictable_tokens": 1 << 34,
            "running_requests": 7,
        },
        answer={},
        returns={},
    ),
    dict(
        method="AckCommand",
        client="ack_command",
        call=lambda b: b.ack_command(U64, True, "boom", freed_tokens=12),
        request={"command_id": U64, "ok": True, "error": "boom", "freed_tokens": 12},
        answer={},
        returns={},
    ),
]

STREAM = [  # WatchCommands: each answer message and what decode_worker_command must make of it
    (
        {"command_id": 1, "attach": {"sidecar_instance": "sc-9", "pool_registered": True, "resident_sessions": 4}},
        {
            "command_id": lambda c: c.command_id,
            "attach.sidecar_instance": lambda c: c.attach.sidecar_instance,
            "attach.pool_registered": lambda c: c.attach.pool_registered,
            "attach.resident_sessions": lambda c: c.attach.resident_sessions,
        },
    ),
    (
        {"command_id": U64, "reason": 1, "release": {"session_id": "s-6"}},
        {"command_id": lambda c: c.command_id, "reason": lambda c: c.reason, "release.session_id": lambda c: c.release},
    ),
    (
        {"command_id": 3, "reason": 3, "truncate": {"session_id": "s-7", "keep_tokens": 96}},
        {
            "command_id": lambda c: c.command_id,
            "reason": lambda c: c.reason,
            "truncate.session_id": lambda c: c.truncate[0],
            "truncate.keep_tokens": lambda c: c.truncate[1],
        },
    ),
]


def _lookup(d: dict, dotted: str):
    for k in dotted.split("."):
        d = d[k]
    return d


@pytest.fixture
def sidecar(pool):
    with tempfile.TemporaryDirectory(prefix="kvc-drift-") as tmp:
        sock = os.path.join(tmp, "bridge.sock")
        s = RecordingSidecar(pool, sock)
        b = WorkerBridge(sock, timeout_s=10)
        yield s, b
        b.close()
        s.server.stop(0)


def test_every_client_method_has_a_case():
    public = {n for n in dir(WorkerBridge) if not n.startswith("_") and callable(getattr(WorkerBridge, n))}
    covered = {c["client"] for c in CASES} | {"watch_commands"}
    assert public - {"close"} == covered, "WorkerBridge methods without a drift case: %s" % sorted(
        public - {"close"} - covered
    )


@pytest.mark.parametrize("case", CASES, ids=[c["method"] for c in CASES])
def test_unary_call_matches_image(pool, sidecar, case):
    s, b = sidecar
    m = next((x for x in s.service.methods if x.name == case["method"]), None)
    assert m is not None, "WorkerBridgeService.%s: bridge.py calls it, proto/api.binpb has no such RPC" % case["method"]
    in_cls = message_factory.GetMessageClass(m.input_type)
    out_cls = message_factory.GetMessageClass(m.output_type)
    s.answers[m.name] = build(out_cls, case["answer"]).SerializeToString()
    result = case["call"](b)

    assert [n for n, _ in s.requests] == [m.name]
    raw = s.requests[0][1]
    problems = schema_problems(raw, m.input_type, m.input_type.name)
    if not problems:
        problems = value_problems(in_cls.FromString(raw), case["request"], m.input_type.name)
    for name, get in case["returns"].items():
        fd = m.output_type.fields_by_name.get(name)
        if fd is None:
            problems.append("%s.%s: bridge.py reads it, the image has no such field" % (m.output_type.name, name))
        elif get(result) != case["answer"][name]:
            problems.append(
                "%s.%s (field %d): bridge.py decoded %r, protobuf sent %r"
                % (m.output_type.name, name, fd.number, get(result), case["answer"][name])
            )
    assert not problems, "\n".join(problems)


def test_watch_commands_matches_image(pool, sidecar):
    s, b = sidecar
    m = next(x for x in s.service.methods if x.name == "WatchCommands")
    assert m.server_streaming
    out_cls = message_factory.GetMessageClass(m.output_type)
    s.answers[m.name] = [build(out_cls, a).SerializeToString() for a, _ in STREAM]
    got = list(b.watch_commands("inst-1"))

    raw = s.requests[0][1]
    problems = schema_problems(raw, m.input_type, m.input_type.name)
    problems += value_problems(
        message_factory.GetMessageClass(m.input_type).FromString(raw), {"worker_instance": "inst-1"}, m.input_type.name
    )
    assert len(got) == len(STREAM)
    for i, (cmd, (answer, reads)) in enumerate(zip(got, STREAM)):
        for dotted, get in reads.items():
            want = _lookup(answer, dotted)
            v = get(cmd)
            if v != want:
                problems.append(
                    "%s[%d].%s: bridge.py decoded %r, protobuf sent %r" % (m.output_type.name, i, dotted, v, want)
                )
    assert not problems, "\n".join(problems)


def _enum_problems(pool, enum_name: str, prefix: str, consts: dict):
    e = pool.FindEnumTypeByName(PKG + enum_name)
    problems = []
    for name, v in consts.items():
        ev = e.values_by_name.get(prefix + name)
        if ev is None:
            problems.append("%s: %s has no %s%s" % (name, enum_name, prefix, name))
        elif ev.number != v:
            problems.append("%s = %d, but %s.%s%s = %d" % (name, v, enum_name, prefix, name, ev.number))
    return problems


def test_constants_match_image_enums(pool):
    problems = _enum_problems(
        pool, "KVKind", "KV_KIND_", {"K": bridge.KV_KIND_K, "V": bridge.KV_KIND_V, "COMBINED": bridge.KV_KIND_COMBINED}
    )
    problems += _enum_problems(
        pool, "PoolLayout", "POOL_LAYOUT_", {"MHA": bridge.POOL_LAYOUT_MHA, "MLA": bridge.POOL_LAYOUT_MLA}
    )
    problems += _enum_problems(
        pool,
        "WorkerCommandReason",
        "WORKER_COMMAND_REASON_",
        {
            "CAPACITY": bridge.REASON_CAPACITY,
            "CONTROL_PLANE": bridge.REASON_CONTROL_PLANE,
            "PREFIX_MISMATCH": bridge.REASON_PREFIX_MISMATCH,
        },
    )
    problems += _enum_problems(
        pool,
        "ReleaseReason",
        "RELEASE_REASON_",
        {"RELEASED": bridge.RELEASE_RELEASED, "EVICTED": bridge.RELEASE_EVICTED},
    )
    problems += _enum_problems(
        pool, "TransferKind", "TRANSFER_KIND_", {"SEED": bridge.TRANSFER_SEED, "SNAPSHOT": bridge.TRANSFER_SNAPSHOT}
    )
    problems += _enum_problems(
        pool, "SessionEventKind", "SESSION_EVENT_KIND_", {v.upper(): k for k, v in kvctest.EVENT_KINDS.items()}
    )
    assert not problems, "\n".join(problems)


# ---- the scripted control plane (kvctest.py): kvc.v1.SidecarService.Connect -------------------------


class _Ctx:
    def is_active(self):
        return True

    def abort(self, code, details):
        raise AssertionError("aborted: %s %s" % (code, details))


def test_scripted_control_plane_matches_image(pool):
    svc = pool.FindServiceByName(PKG + "SidecarService")
    m = next(x for x in svc.methods if x.name == "Connect")
    req_cls, resp_cls = (message_factory.GetMessageClass(t) for t in (m.input_type, m.output_type))
    cp = kvctest.ScriptedControlPlane(delta_tokens=24)
    try:
        hello = {
            "hello": {
                "worker_id": "p-1",
                "role": 1,
                "transfer_endpoint": "tcp://10.0.0.2:7001",
                "peer_addr": "10.0.0.2:7000",
            }
        }
        event = {
            "session_event": {"session_id": "s-1", "kind": 4, "kv_len": 64, "generation": U64, "detail": "ingested"}
        }
        ack = {"ack": {"command_id": 12, "ok": True, "error": "none"}}
        inbox = queue.Queue()
        for x in (hello, event, ack):
            inbox.put(build(req_cls, x).SerializeToString())

        def requests():
            while True:
                x = inbox.get()
                if x is None:
                    return
                yield x

        gen = cp._connect(requests(), _Ctx())
        welcome = next(gen)
        assert cp.wait(lambda c: len(c.events) == 1 and len(c.acks) == 1, 10)
        cid = cp.set_snapshot_target("p-1", "s-1", "p-1", generation=U64)  # to the one stream there is
        command = next(gen)
        inbox.put(None)

        problems = schema_problems(welcome, m.output_type, "ConnectResponse")
        problems += value_problems(
            resp_cls.FromString(welcome),
            {
                "welcome": {
                    "epoch": 1,
                    "leader_id": "scripted-cp",
                    "policy": {"snapshot_delta_tokens": 24, "snapshots_enabled": True, "version": 1},
                }
            },
            "ConnectResponse",
        )
        problems += schema_problems(command, m.output_type, "ConnectResponse")
        problems += value_problems(
            resp_cls.FromString(command),
            {
                "command": {
                    "command_id": cid,
                    "epoch": 1,
                    "set_snapshot_target": {
                        "session_id": "s-1",
                        "prefill_worker_id": "p-1",
                        "peer_addr": "10.0.0.2:7000",
                        "transfer_endpoint": "tcp://10.0.0.2:7001",
                        "generation": U64,
                    },
                }
            },
            "ConnectResponse",
        )
        h = cp.hellos.get("p-1")
        if h != {"role": 1, "peer_addr": "10.0.0.2:7000", "transfer_endpoint": "tcp://10.0.0.2:7001"}:
            problems.append("Hello: kvctest decoded %r from %r" % (h, hello))
        want_event = {
            "worker": "p-1",
            "session": "s-1",
            "kind": "snapshot_ingested",
            "kv_len": 64,
            "generation": U64,
            "detail": "ingested",
        }
        if cp.events[0] != want_event:
            problems.append("SessionEvent: kvctest decoded %r, protobuf sent %r" % (cp.events[0], event))
        if cp.acks[0] != ("p-1", 12, True, "none"):
            problems.append("CommandAck: kvctest decoded %r, protobuf sent %r" % (cp.acks[0], ack))
        assert not problems, "\n".join(problems)
    finally:
        inbox.put(None)
        cp.close()


# ---- the execution payload (payload.py): kvc.v1.ExecutionPayload in kv_hints, protojson ----------

_KINDS = {"string": _FD.TYPE_STRING, "bool": _FD.TYPE_BOOL, "int64": _FD.TYPE_INT64, "uint64": _FD.TYPE_UINT64}


def _payload_field_problems(pool, msg: str):
    d = pool.FindMessageTypeByName(PKG + msg)
    problems = []
    codec = {name: (num, kind) for name, num, kind in kvc_payload.FIELDS[msg]}
    for fd in d.fields:
        if fd.name not in codec:
            problems.append("%s.%s (field %d) is in the image but not in payload.py" % (msg, fd.name, fd.number))
    for name, (num, kind) in codec.items():
        fd = d.fields_by_name.get(name)
        if fd is None:
            problems.append("payload.py: %s.%s is not in the image" % (msg, name))
            continue
        if fd.number != num:
            problems.append("%s.%s: payload.py says field %d, the image %d" % (msg, name, num, fd.number))
        if fd.json_name != kvc_payload.json_name(name):
            problems.append(
                "%s.%s: JSON name %s in the image, %s in payload.py"
                % (msg, name, fd.json_name, kvc_payload.json_name(name))
            )
        repeated, base = (
            kind.startswith("repeated "),
            kind[len("repeated ") :] if kind.startswith("repeated ") else kind,
        )
        if repeated != _repeated(fd):
            problems.append("%s.%s: repeated in one and not the other" % (msg, name))
        if base.startswith("enum:"):
            ok = fd.type == _FD.TYPE_ENUM and fd.enum_type.name == base[len("enum:") :]
        elif base.startswith("message:"):
            ok = fd.type == _FD.TYPE_MESSAGE and fd.message_type.name == base[len("message:") :]
            if ok:
                problems += _payload_field_problems(pool, fd.message_type.name)
        else:
            ok = fd.type == _KINDS[base]
        if not ok:
            problems.append(
                "%s.%s: payload.py reads it as %s, the image declares %s"
                % (msg, name, kind, _TYPE_NAMES.get(fd.type, fd.type))
            )
    return problems


def test_payload_fields_match_image(pool):
    """Every field of ExecutionPayload (and the messages it holds) is in payload.py with its
    number, JSON name and type, and payload.py knows no field the image lacks."""
    problems = _payload_field_problems(pool, "ExecutionPayload")
    assert set(kvc_payload.FIELDS) == {"ExecutionPayload", "ExecutionReceive", "ExecutionSend"}
    assert not problems, "\n".join(problems)


def test_payload_enums_match_image(pool):
    problems = []
    for enum, values in kvc_payload.ENUMS.items():
        e = pool.FindEnumTypeByName(PKG + enum)
        image = {v.name: v.number for v in e.values}
        if image != values:
            problems.append("%s: payload.py %s, the image %s" % (enum, values, image))
    assert not problems, "\n".join(problems)


def _full_payload(pool):
    cls = _cls(pool, "ExecutionPayload")
    m = cls(
        decision_id="d-1",
        mode=3,
        role=2,
        session_id="s",
        input_tokens=1 << 40,
        cached_tokens=7,
        keep_session=True,
        open_session=True,
        truncate_to=4,
        local_prefill=True,
        load_prefix_tokens=96,
        load_generation=U64,
        load=True,
    )
    r = m.receive
    r.kind, r.room, r.peer_addr, r.tokens, r.from_token = 2, (1 << 62) + 1, "p:1", 80, 16
    m.receive.peer_addrs.extend(["p:1", "p:2"])
    m.send.room, m.send.from_token, m.send.store_generation = 9, 32, U64
    return cls, m


def test_payload_reads_protojson(pool):
    """payload.py decodes what protobuf's JSON mapping writes, with proto names (the gateway's
    form) and with JSON names, to the values protobuf put in; and protobuf parses payload.py's
    own JSON back to the same message."""
    import json

    from google.protobuf import json_format

    cls, m = _full_payload(pool)
    for proto_names in (True, False):
        raw = json.loads(json_format.MessageToJson(m, preserving_proto_field_name=proto_names))
        p = kvc_payload.from_json(raw)
        back = json_format.Parse(json.dumps(kvc_payload.to_json(p)), cls())
        assert back == m, "proto names %s: payload.py read %r, protobuf wrote %r" % (proto_names, p, raw)
    env = kvc_payload.envelope(kvc_payload.from_json(json.loads(json_format.MessageToJson(m))), "d-1")
    assert env["actions"][0]["action_version"] == kvc_payload.ACTION_VERSION == 2
    assert json_format.Parse(json.dumps(env["actions"][0]["payload"]), cls()) == m


@pytest.mark.parametrize(
    "payload,needle",
    [
        ({"transfer": "SEED"}, "unknown field"),
        ({"mode": "SEED"}, "unknown value"),
        ({"input_tokens": "12x"}, "integer"),
        ({"load_generation": -1}, "range"),
        ({"input_tokens": 1 << 63}, "range"),
        ({"keep_session": 1}, "true or false"),
        ({"receive": [1]}, "object"),
        ({"receive": {"peer_addrs": "p:1"}}, "list"),
        ({"session_id": "a", "sessionId": "b"}, "twice"),
    ],
)
def test_payload_refuses(payload, needle):
    with pytest.raises(kvc_payload.PayloadError, match=needle):
        kvc_payload.from_json(payload)


def test_envelope_versions():
    ok = {
        "protocol_version": "1",
        "actions": [
            {"action_type": "other", "action_version": 9, "payload": [1]},
            {"action_type": "kvc", "action_version": "2", "payload": {"load": True}},
        ],
    }
    assert kvc_payload.from_envelope(ok).load is True
    assert kvc_payload.from_envelope({"protocol_version": 1, "actions": []}) is None
    v1 = {"action_type": "kvc", "action_version": 1, "payload": {}}
    v2 = {"action_type": "kvc", "action_version": 2, "payload": {}}
    for bad, needle in [
        ({"protocol_version": 2, "actions": []}, "protocol_version"),
        ({"protocol_version": 1, "actions": [v1]}, "action_version"),
        ({"protocol_version": 1, "actions": [v2, v2]}, "more than one"),
    ]:
        with pytest.raises(kvc_payload.PayloadError, match=needle):
            kvc_payload.from_envelope(bad)
