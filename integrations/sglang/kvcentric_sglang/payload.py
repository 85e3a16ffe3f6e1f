"""kvcentric's execution payload (kvc.v1.ExecutionPayload, proto/kvc/v1/execution.proto): what one
worker does for one half of a request, carried as the "kvc" action (action_version 2) of SGLang's
kv_hints envelope. The Python codec of that message, shared by the SGLang plugin and
kvc-refworker; the JSON is the proto3 JSON mapping (protojson), as the gateway writes it:

- a field by its proto name (snake_case) or its lowerCamelCase JSON name, not both;
- int64/uint64 as JSON numbers or decimal strings (the gateway writes strings), in range;
- enums by name ("TRANSFER_KIND_SEED") or number; messages as objects; null = the default;
- an unknown field, a wrong type or a value out of range is a PayloadError naming the field.

The field tables below (FIELDS, ENUMS) are what tests/test_wire_drift.py checks against the
committed API image, proto/api.binpb: a field added, renumbered or retyped there without this
codec fails that test. Workers act on the fields; `mode` is a label only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

PROTOCOL_VERSION = 1
ACTION_TYPE = "kvc"
ACTION_VERSION = 2

# Enums as in the image: name -> number.
ENUMS: Dict[str, Dict[str, int]] = {
    "RouteMode": {
        "ROUTE_MODE_UNSPECIFIED": 0,
        "ROUTE_MODE_DIRECT_TO_D": 1,
        "ROUTE_MODE_SEED": 2,
        "ROUTE_MODE_RESEED_SNAPSHOT": 3,
        "ROUTE_MODE_RESEED_PREFILL": 4,
        "ROUTE_MODE_PD_FALLBACK": 5,
    },
    "WorkerRole": {"WORKER_ROLE_UNSPECIFIED": 0, "WORKER_ROLE_PREFILL": 1, "WORKER_ROLE_DECODE": 2},
    "TransferKind": {"TRANSFER_KIND_UNSPECIFIED": 0, "TRANSFER_KIND_SEED": 1, "TRANSFER_KIND_SNAPSHOT": 2},
}

TRANSFER_NONE, TRANSFER_SEED, TRANSFER_SNAPSHOT = 0, 1, 2
ROLE_PREFILL, ROLE_DECODE = 1, 2

# Field kinds (protobuf types): "string", "bool", "int64", "uint64", "enum:<Enum>",
# "message:<Message>", "repeated string".
FIELDS: Dict[str, List[Tuple[str, int, str]]] = {
    "ExecutionPayload": [
        ("decision_id", 1, "string"),
        ("mode", 2, "enum:RouteMode"),
        ("role", 3, "enum:WorkerRole"),
        ("session_id", 4, "string"),
        ("input_tokens", 5, "int64"),
        ("cached_tokens", 6, "int64"),
        ("keep_session", 7, "bool"),
        ("open_session", 8, "bool"),
        ("receive", 9, "message:ExecutionReceive"),
        ("send", 10, "message:ExecutionSend"),
        ("truncate_to", 11, "int64"),
        ("local_prefill", 12, "bool"),
        ("load_prefix_tokens", 13, "int64"),
        ("load_generation", 14, "uint64"),
        ("load", 15, "bool"),
    ],
    "ExecutionReceive": [
        ("kind", 1, "enum:TransferKind"),
        ("room", 2, "int64"),
        ("peer_addr", 3, "string"),
        ("peer_addrs", 4, "repeated string"),
        ("tokens", 5, "int64"),
        ("from_token", 6, "int64"),
    ],
    "ExecutionSend": [
        ("room", 1, "int64"),
        ("from_token", 2, "int64"),
        ("store_generation", 3, "uint64"),
    ],
}


class PayloadError(ValueError):
    """A kv_hints envelope or kvc payload that is not an ExecutionPayload (the message names the
    field)."""


@dataclass
class ExecutionReceive:
    kind: int = 0
    room: int = 0
    peer_addr: str = ""
    peer_addrs: List[str] = field(default_factory=list)
    tokens: int = 0
    from_token: int = 0


@dataclass
class ExecutionSend:
    room: int = 0
    from_token: int = 0
    store_generation: int = 0


@dataclass
class ExecutionPayload:
    decision_id: str = ""
    mode: int = 0
    role: int = 0
    session_id: str = ""
    input_tokens: int = 0
    cached_tokens: int = 0
    keep_session: bool = False
    open_session: bool = False
    receive: Optional[ExecutionReceive] = None
    send: Optional[ExecutionSend] = None
    truncate_to: int = 0
    local_prefill: bool = False
    load_prefix_tokens: int = 0
    load_generation: int = 0
    load: bool = False

    @property
    def mode_name(self) -> str:
        """The mode label without its prefix ("SEED", ...; "" when absent): for logs and meta
        only, never for a decision."""
        return enum_name("RouteMode", self.mode).replace("ROUTE_MODE_", "").replace("UNSPECIFIED", "")

    @property
    def receive_kind(self) -> int:
        return self.receive.kind if self.receive is not None else TRANSFER_NONE


_CLASSES = {"ExecutionPayload": ExecutionPayload, "ExecutionReceive": ExecutionReceive, "ExecutionSend": ExecutionSend}
_INT_RANGE = {"int64": (-(1 << 63), 1 << 63), "uint64": (0, 1 << 64)}
_DIGITS = re.compile(r"^-?[0-9]+$")


def enum_name(enum: str, v: int) -> str:
    for n, num in ENUMS[enum].items():
        if num == v:
            return n
    return str(v)


def json_name(proto_name: str) -> str:
    """protoc's lowerCamelCase JSON name of a field."""
    head, *rest = proto_name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _scalar(kind: str, v: Any, where: str):
    if kind == "string":
        if not isinstance(v, str):
            raise PayloadError("%s must be a string" % where)
        return v
    if kind == "bool":
        if not isinstance(v, bool):
            raise PayloadError("%s must be true or false" % where)
        return v
    if kind in _INT_RANGE:
        if isinstance(v, str) and _DIGITS.match(v.strip()):
            v = int(v.strip())
        elif isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise PayloadError("%s must be an integer (a number or a decimal string)" % where)
        lo, hi = _INT_RANGE[kind]
        if not lo <= v < hi:
            raise PayloadError("%s %d is out of the %s range" % (where, v, kind))
        return v
    if kind.startswith("enum:"):
        names = ENUMS[kind[len("enum:") :]]
        if isinstance(v, str):
            if v not in names:
                raise PayloadError("%s: unknown value %r (want one of %s)" % (where, v, ", ".join(names)))
            return names[v]
        if isinstance(v, bool) or not isinstance(v, int) or not -(1 << 31) <= v < (1 << 31):
            raise PayloadError("%s must be an enum name or number" % where)
        return v
    raise AssertionError(kind)


def _decode(msg: str, obj: Any, where: str):
    if not isinstance(obj, dict):
        raise PayloadError("%s must be an object, got %s" % (where, type(obj).__name__))
    known = {}
    for name, _num, kind in FIELDS[msg]:
        known[name] = (name, kind)
        known[json_name(name)] = (name, kind)
    seen: Dict[str, str] = {}
    out = _CLASSES[msg]()
    for k, v in obj.items():
        if k not in known:
            raise PayloadError("%s: unknown field %r" % (where, k))
        name, kind = known[k]
        if name in seen:
            raise PayloadError("%s: field %s given twice (%r and %r)" % (where, name, seen[name], k))
        seen[name] = k
        w = "%s.%s" % (where, name)
        if v is None:
            continue  # null is the field's default
        if kind.startswith("message:"):
            setattr(out, name, _decode(kind[len("message:") :], v, w))
        elif kind.startswith("repeated "):
            if not isinstance(v, list):
                raise PayloadError("%s must be a list" % w)
            setattr(out, name, [_scalar(kind[len("repeated ") :], x, "%s[%d]" % (w, i)) for i, x in enumerate(v)])
        else:
            setattr(out, name, _scalar(kind, v, w))
    return out


def from_json(obj: Any) -> ExecutionPayload:
    """The ExecutionPayload of a kvc action's payload (a dict, as json.loads gives it)."""
    return _decode("ExecutionPayload", obj, "payload")


def to_json(p) -> Dict[str, Any]:
    """p in the gateway's form: proto names, defaults left out, 64-bit integers as strings, enums
    by name (what protojson with UseProtoNames writes)."""
    msg = type(p).__name__
    out: Dict[str, Any] = {}
    for name, _num, kind in FIELDS[msg]:
        v = getattr(p, name)
        if kind.startswith("message:"):
            if v is not None:
                out[name] = to_json(v)
        elif not v:
            continue
        elif kind in _INT_RANGE:
            out[name] = str(int(v))
        elif kind.startswith("enum:"):
            out[name] = enum_name(kind[len("enum:") :], v)
        elif kind.startswith("repeated "):
            out[name] = list(v)
        else:
            out[name] = v
    return out


def _get(o: Any, k: str, default=None):
    if isinstance(o, dict):
        return o.get(k, default)
    return getattr(o, k, default)


def from_envelope(kv_hints: Any) -> Optional[ExecutionPayload]:
    """The kvc action's payload of a KvHintsEnvelope (SGLang's object or its dict form), or None
    when there is none (other orchestrators' actions are skipped). Another protocol or action
    version, two kvc actions or a payload that is not an ExecutionPayload is a PayloadError."""
    if kv_hints is None:
        return None
    pv = _get(kv_hints, "protocol_version", None)
    try:
        pv = int(pv)
    except (TypeError, ValueError):
        raise PayloadError("kv_hints.protocol_version %r is not supported (want %d)" % (pv, PROTOCOL_VERSION)) from None
    if pv != PROTOCOL_VERSION:
        raise PayloadError("kv_hints.protocol_version %d is not supported (want %d)" % (pv, PROTOCOL_VERSION))
    actions = _get(kv_hints, "actions", None) or []
    if not isinstance(actions, (list, tuple)):
        raise PayloadError("kv_hints.actions must be a list")
    out = None
    for i, a in enumerate(actions):
        if _get(a, "action_type") != ACTION_TYPE:
            continue
        av = _get(a, "action_version", None)
        try:
            av = int(av)
        except (TypeError, ValueError):
            av = None
        if av != ACTION_VERSION:
            raise PayloadError(
                "kv_hints.actions[%d]: kvc action_version %r is not supported (want %d)"
                % (i, _get(a, "action_version"), ACTION_VERSION)
            )
        if out is not None:
            raise PayloadError("kv_hints carries more than one kvc action")
        out = _decode("ExecutionPayload", _get(a, "payload", None), "kv_hints.actions[%d].payload" % i)
    return out


def envelope(p: ExecutionPayload, message_id: str = "m") -> Dict[str, Any]:
    """A kv_hints envelope (dict form) carrying p as its one kvc action."""
    role = {ROLE_PREFILL: "prefill", ROLE_DECODE: "decode"}.get(p.role, "")
    return {
        "protocol_version": PROTOCOL_VERSION,
        "message_id": message_id,
        "actions": [
            {
                "action_id": "%s/%s" % (message_id, role),
                "action_type": ACTION_TYPE,
                "action_version": ACTION_VERSION,
                "payload": to_json(p),
            }
        ],
    }


def peer_for(receive: Optional[ExecutionReceive], tp_rank: int, tp_size: int) -> str:
    """The prefill sidecar that tensor-parallel rank tp_rank of tp_size (0: none) receives from:
    entry tp_rank of peer_addrs, else peer_addr. ValueError when the list does not have this
    worker's tp_size entries (unequal TP on prefill and decode is not supported: rank r pairs
    with rank r)."""
    if receive is None:
        return ""
    if not receive.peer_addrs:
        return receive.peer_addr
    n = max(int(tp_size or 0), 1)
    if len(receive.peer_addrs) != n or not 0 <= int(tp_rank) < n:
        raise ValueError(
            "kv_hints receive.peer_addrs has %d ranks; this worker is rank %d of tp_size %d "
            "(prefill and decode pair only with equal tensor parallelism)" % (len(receive.peer_addrs), int(tp_rank), n)
        )
    return receive.peer_addrs[int(tp_rank)]


assert all(
    f.name == n for cls, spec in ((_CLASSES[m], FIELDS[m]) for m in FIELDS) for f, (n, _, _) in zip(fields(cls), spec)
), "payload.py: the dataclasses and FIELDS differ"
