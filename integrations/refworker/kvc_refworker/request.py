"""Parsing and validating a /generate body: SGLang's GenerateReqInput subset plus kvcentric's
per-request block, either the legacy top-level `kvc` object or SGLang's kv_hints envelope
`{"kv_hints": {"protocol_version": 1, "actions": [{"action_type": "kvc", "payload": {...}}]}}`.
Every error is a bad_request (400) with a clear message, as kvc-sim answers."""

from dataclasses import dataclass, field
from typing import List, Optional

MODES = ("DIRECT_TO_D", "SEED", "RESEED_SNAPSHOT", "RESEED_PREFILL", "PD_FALLBACK")
MAX_NEW_LIMIT = 1 << 20
DEFAULT_MAX_NEW = 128


class BadRequest(ValueError):
    pass


def parse_mode(s: str) -> str:
    u = str(s).strip().upper()
    if u.startswith("ROUTE_MODE_"):
        u = u[len("ROUTE_MODE_"):]
    if u not in MODES:
        raise BadRequest("unknown kvc.mode %r (want DIRECT_TO_D, SEED, RESEED_SNAPSHOT, RESEED_PREFILL or "
                         "PD_FALLBACK)" % s)
    return u


@dataclass
class Plan:
    rid: str = ""
    decision_id: str = ""
    mode: str = "PD_FALLBACK"
    session_id: str = ""
    seed_key: str = ""
    input: int = 0
    cached: int = 0
    max_new: int = DEFAULT_MAX_NEW
    room: int = 0
    has_room: bool = False
    role: str = ""  # the serving worker's role
    peer: str = ""
    seqlen: int = 0
    # prefill from the snapshot (kv_hints load_prefix_tokens / load_generation): P loads
    # [0, load_prefix) of the session's snapshot from its sidecar's store and prefills the rest;
    # D learns from it that the KV it receives is not one full prefill's
    load_prefix: int = 0
    load_gen: int = 0
    # suffix-only receive (kv_hints receive_from): D keeps [0, receive_from), P sends the rest
    receive_from: int = 0
    keep: bool = False
    stream: bool = False
    ids: Optional[List[int]] = None  # the client's token ids; None: scripted (synthetic) tokens
    hints: str = ""  # "kvc" or "kv_hints" or ""
    # SGLang's request priority (GenerateReqInput.priority; the gateway sends -prefill_priority on
    # P's half): kept on the plan and echoed in P's meta_info (this worker has no radix cache to
    # evict by it). 0 when absent, as SGLang's req.priority or 0.
    priority: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def transfers(self) -> bool:
        return self.mode != "DIRECT_TO_D" and not self.local

    @property
    def local(self) -> bool:
        """A PD_FALLBACK without a room: the gateway failed open to this decode worker alone
        (no usable decision or no prefill worker), which serves it as a colocated SGLang worker
        does: a full prefill here."""
        return self.mode == "PD_FALLBACK" and not self.has_room and self.role == "decode"


def _int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, str) and v.strip().lstrip("-").isdigit():
            return int(v)
        raise BadRequest("%s must be an integer" % what)
    return v


def _room(v, what: str):
    if v is None:
        return 0, False
    r = _int(v, what)
    if r < 0 or r >= 1 << 63:
        raise BadRequest("%s %r is not an integer in [0, 2^63)" % (what, v))
    return r, True


def _valid_id(what: str, s: str) -> None:
    if len(s) > 256 or any(ord(c) < 0x21 or ord(c) == 0x7F for c in s):
        raise BadRequest("%s %r must be 1-256 printable characters without spaces" % (what, s))


def kvc_block(body: dict) -> (dict, str):
    """The kvcentric per-request block: kv_hints' kvc action payload, else the `kvc` object."""
    kh = body.get("kv_hints")
    if kh is not None:
        if not isinstance(kh, dict):
            raise BadRequest("kv_hints must be an object")
        actions = kh.get("actions") or []
        if not isinstance(actions, list):
            raise BadRequest("kv_hints.actions must be a list")
        for a in actions:
            if isinstance(a, dict) and a.get("action_type") == "kvc":
                p = a.get("payload")
                if not isinstance(p, dict):
                    raise BadRequest("kv_hints action kvc needs an object payload")
                return p, "kv_hints"
    k = body.get("kvc")
    if k is None:
        return {}, ""
    if not isinstance(k, dict):
        raise BadRequest("kvc must be an object")
    return k, "kvc"


def parse(body, role: str, capacity: int, vocab: int) -> Plan:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object (batch requests are not supported)")
    p = Plan(stream=bool(body.get("stream", False)), role=role)
    rid = body.get("rid")
    if rid is not None:
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string (batch requests are not supported)")
        if rid:
            _valid_id("rid", rid)
        p.rid = rid
    ids = body.get("input_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
            raise BadRequest("input_ids must be a list of integers (batch requests are not supported)")
        if any(x < 0 or x >= vocab for x in ids):
            raise BadRequest("input_ids must be in [0, %d) (the model's vocabulary)" % vocab)
        p.ids = ids if ids else None
    text = body.get("text")
    if text is not None and not isinstance(text, str):
        raise BadRequest("text must be a string (batch requests are not supported)")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    if sp.get("max_new_tokens") is not None:
        p.max_new = _int(sp["max_new_tokens"], "sampling_params.max_new_tokens")
    p.room, p.has_room = _room(body.get("bootstrap_room"), "bootstrap_room")
    if body.get("priority") is not None:
        pr = body["priority"]
        if isinstance(pr, bool) or not isinstance(pr, int) or not -(1 << 63) <= pr < (1 << 63):
            raise BadRequest("priority must be a signed 64-bit integer (SGLang's request priority)")
        p.priority = pr
    sess = body.get("session_params")
    if sess is not None:
        if not isinstance(sess, dict):
            raise BadRequest("session_params must be an object")
        p.session_id = str(sess.get("id") or "")
    k, p.hints = kvc_block(body)
    keep_set = False
    if k:
        p.decision_id = str(k.get("decision_id") or "")
        if k.get("mode"):
            p.mode = parse_mode(k["mode"])
        r = str(k.get("role") or "").lower()
        if r not in ("", "prefill", "decode"):
            raise BadRequest("unknown kvc.role %r (want prefill or decode)" % k.get("role"))
        if r and r != role:
            raise BadRequest("kvc.role is %s but this is a %s worker" % (r, role))
        sid = str(k.get("session_id") or "")
        if sid:
            if p.session_id and p.session_id != sid:
                raise BadRequest("kvc.session_id %r differs from session_params.id %r" % (sid, p.session_id))
            p.session_id = sid
        if k.get("input_tokens") is not None:
            p.input = _int(k["input_tokens"], "kvc.input_tokens")
            if p.input <= 0:
                raise BadRequest("kvc.input_tokens %d must be > 0" % p.input)
        if k.get("cached_tokens") is not None:
            p.cached = _int(k["cached_tokens"], "kvc.cached_tokens")
        kr, khas = _room(k.get("room"), "kvc.room")
        if khas:
            if p.has_room and p.room != kr:
                raise BadRequest("kvc.room %d differs from bootstrap_room %d" % (kr, p.room))
            p.room, p.has_room = kr, True
        p.peer = str(k.get("prefill_peer_addr") or "")
        if k.get("snapshot_seqlen") is not None:
            p.seqlen = _int(k["snapshot_seqlen"], "kvc.snapshot_seqlen")
        if k.get("keep_session") is not None:
            p.keep, keep_set = bool(k["keep_session"]), True
        if k.get("load_prefix_tokens") is not None:
            p.load_prefix = _int(k["load_prefix_tokens"], "kvc.load_prefix_tokens")
            p.load_gen = _int(k.get("load_generation") or 0, "kvc.load_generation")
        if k.get("receive_from") is not None:
            p.receive_from = _int(k["receive_from"], "kvc.receive_from")
    if not keep_set:
        p.keep = p.mode != "PD_FALLBACK"
    if p.ids is not None:
        if p.input and p.input != len(p.ids):
            raise BadRequest("kvc.input_tokens %d differs from len(input_ids) %d" % (p.input, len(p.ids)))
        p.input = len(p.ids)
    if p.input == 0:
        if text:
            p.input = max(1, len(text) // 4)  # as kvc-sim: ~4 characters per token (scripted tokens)
        else:
            raise BadRequest("no input: give input_ids, kvc.input_tokens or text")
    if p.session_id:
        _valid_id("session id", p.session_id)
    if not p.session_id and (p.mode != "PD_FALLBACK" or p.keep):
        raise BadRequest("missing session id: a request without one is single-shot and may only run as "
                         "PD_FALLBACK without keep_session (mode %s)" % p.mode)
    if p.input > capacity:
        raise BadRequest("input_tokens %d exceeds this worker's KV capacity of %d tokens" % (p.input, capacity))
    if p.cached < 0 or p.cached > p.input:
        raise BadRequest("cached_tokens %d out of range [0, input_tokens %d]" % (p.cached, p.input))
    if p.max_new < 0 or p.max_new > MAX_NEW_LIMIT:
        raise BadRequest("max_new_tokens %d out of range [0, %d]" % (p.max_new, MAX_NEW_LIMIT))
    if role == "decode" and p.input + p.max_new > capacity:
        raise BadRequest("input_tokens %d + max_new_tokens %d exceed this worker's KV capacity of %d tokens" % (
            p.input, p.max_new, capacity))
    if role == "prefill" and p.mode in ("DIRECT_TO_D", "RESEED_SNAPSHOT"):
        raise BadRequest("mode %s has no prefill half" % p.mode)
    if p.transfers and not p.has_room:
        raise BadRequest("mode %s moves KV and needs a room (kvc.room or bootstrap_room)" % p.mode)
    if p.mode == "RESEED_SNAPSHOT" and not (0 < p.seqlen <= p.input):
        raise BadRequest("kvc.snapshot_seqlen %d out of range [1, input_tokens %d]" % (p.seqlen, p.input))
    if p.load_prefix and (not p.session_id or not 0 < p.load_prefix < p.input):
        raise BadRequest("kvc.load_prefix_tokens %d: only a session's prefill loads from its store, fewer tokens than "
                         "input_tokens %d" % (p.load_prefix, p.input))
    if p.receive_from and (p.mode != "PD_FALLBACK" or not p.session_id or not 0 < p.receive_from < p.input):
        raise BadRequest("kvc.receive_from %d: only a large append (PD_FALLBACK of a session) receives a suffix, "
                         "from below input_tokens %d" % (p.receive_from, p.input))
    p.seed_key = p.session_id or p.rid or "room-%d" % p.room
    return p


def scripted_tokens(key: str, start: int, end: int, vocab: int) -> List[int]:
    """The deterministic token of each position [start, end) of a conversation keyed by key, for
    requests that carry only a token count (kvc.input_tokens): every worker derives the same
    context, so a recompute anywhere is comparable. splitmix64 over (fnv1a(key), position)."""
    h = 0xCBF29CE484222325
    for b in key.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    out = []
    for i in range(start, end):
        z = (h + (i + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
        out.append(z % vocab)
    return out
