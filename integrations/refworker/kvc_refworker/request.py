"""Parsing and validating a /generate body: SGLang's GenerateReqInput subset plus kvcentric's
decision, the ExecutionPayload of SGLang's kv_hints envelope `{"kv_hints": {"protocol_version": 1,
"actions": [{"action_type": "kvc", "action_version": 2, "payload": {...}}]}}`, decoded by the one
Python codec of that payload (kvcentric_sglang.payload). The worker acts on the payload's fields;
the mode is a label. Every error is a bad_request (400) with a clear message, as kvc-sim answers."""

from dataclasses import dataclass, field
from typing import List, Optional

from kvcentric_sglang import payload as P

MAX_NEW_LIMIT = 1 << 20
DEFAULT_MAX_NEW = 128


class BadRequest(ValueError):
    pass


@dataclass
class Plan:
    rid: str = ""
    decision_id: str = ""
    mode: str = ""  # the decision's mode: a label for meta_info and logs only
    session_id: str = ""
    seed_key: str = ""
    input: int = 0
    cached: int = 0
    max_new: int = DEFAULT_MAX_NEW
    room: int = 0
    has_room: bool = False
    role: str = ""  # the serving worker's role
    peer: str = ""
    # how KV arrives on D (payload receive.kind; 0: nothing received) and the tokens it covers,
    # [receive_from, recv_tokens)
    recv_kind: int = 0
    recv_tokens: int = 0
    # P sends what it computes (payload send)
    sends: bool = False
    # this request makes the session resident here (open_session): a copy held is stale
    open: bool = False
    # D computes the prompt itself (local_prefill): a fail-open, a fallback without a prefill
    # worker (nothing kept) or a new session's first turn (open_session, kept)
    local: bool = False
    truncate_to: int = 0
    # prefill from the snapshot (load_prefix_tokens / load_generation): P loads [0, load_prefix)
    # of the session's snapshot from its sidecar's store and prefills the rest; D learns from it
    # that the KV it receives is not one full prefill's
    load_prefix: int = 0
    load_gen: int = 0
    # suffix-only receive (the receive's or the send's from_token): D keeps [0, receive_from),
    # P sends the rest
    receive_from: int = 0
    # a LoadSessionCommand's request (payload load, from the decode sidecar, no client): a
    # zero-output snapshot receive of the whole input that only makes the session resident
    load: bool = False
    keep: bool = False
    stream: bool = False
    ids: Optional[List[int]] = None  # the client's token ids; None: scripted (synthetic) tokens
    # SGLang's request priority (GenerateReqInput.priority; the gateway sends -prefill_priority on
    # P's half): kept on the plan and echoed in P's meta_info (this worker has no radix cache to
    # evict by it). 0 when absent, as SGLang's req.priority or 0.
    priority: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def transfers(self) -> bool:
        return bool(self.recv_kind) or self.sends


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
    try:
        k = P.from_envelope(body.get("kv_hints"))
    except P.PayloadError as e:
        raise BadRequest(str(e)) from None
    if k is None:
        raise BadRequest(
            "no kvcentric decision: kv_hints carries no kvc action (kvc-refworker serves only what kvc-gateway sends)"
        )
    p.decision_id, p.mode = k.decision_id, k.mode_name
    if k.role and k.role != {"prefill": P.ROLE_PREFILL, "decode": P.ROLE_DECODE}.get(role):
        raise BadRequest("the payload's role is %s but this is a %s worker" % (P.enum_name("WorkerRole", k.role), role))
    if k.session_id:
        if p.session_id and p.session_id != k.session_id:
            raise BadRequest("kvc.session_id %r differs from session_params.id %r" % (k.session_id, p.session_id))
        p.session_id = k.session_id
    if k.input_tokens < 0:
        raise BadRequest("kvc.input_tokens %d must be > 0" % k.input_tokens)
    p.input, p.cached, p.keep, p.open = k.input_tokens, k.cached_tokens, k.keep_session, k.open_session
    p.local, p.truncate_to = k.local_prefill, k.truncate_to
    p.load_prefix, p.load_gen = k.load_prefix_tokens, k.load_generation
    p.load = k.load

    def room_of(v: int) -> None:
        if not 0 <= v < 1 << 63:
            raise BadRequest("kvc room %d is not in [0, 2^63)" % v)
        if p.has_room and p.room != v:
            raise BadRequest("kvc room %d differs from bootstrap_room %d" % (v, p.room))
        p.room, p.has_room = v, True

    decode = role == "decode"
    if decode and k.send is not None:
        raise BadRequest("kvc.send is for a prefill worker; this is a decode worker")
    if not decode and k.receive is not None:
        raise BadRequest("kvc.receive is for a decode worker; this is a prefill worker")
    if not decode and k.send is None:
        raise BadRequest("a prefill worker needs kvc.send (where the KV it computes goes)")
    if k.receive is not None:
        r = k.receive
        if r.kind not in (P.TRANSFER_SEED, P.TRANSFER_SNAPSHOT):
            raise BadRequest("kvc.receive.kind must be TRANSFER_KIND_SEED or TRANSFER_KIND_SNAPSHOT")
        p.recv_kind, p.recv_tokens, p.receive_from = r.kind, r.tokens, r.from_token
        p.peer = r.peer_addr or (r.peer_addrs[0] if r.peer_addrs else "")
        room_of(r.room)
    if k.send is not None:
        if k.send.store_generation:
            raise BadRequest("kvc.send.store_generation: kvc-refworker does not seed through the prefill store")
        p.sends, p.receive_from = True, k.send.from_token
        room_of(k.send.room)
    # SGLang's contract: D keeps a session exactly when the request carries session_params (its
    # streaming session); P never gets session_params (it prefills the full context).
    has_params = sess is not None and bool(str(sess.get("id") or ""))
    if not decode and has_params:
        raise BadRequest("a prefill worker takes the full context without session_params")
    if decode and p.keep != has_params:
        raise BadRequest(
            "kv_hints keep_session %s but session_params %s: a decode worker keeps the session exactly "
            "when the request names it" % (p.keep, "given" if has_params else "missing")
        )
    if p.ids is not None:
        if p.input and p.input != len(p.ids):
            raise BadRequest("kvc.input_tokens %d differs from len(input_ids) %d" % (p.input, len(p.ids)))
        p.input = len(p.ids)
    if p.input == 0:
        if text:
            p.input = max(1, len(text) // 4)  # as kvc-sim: ~4 characters per token (scripted tokens)
        else:
            raise BadRequest("no input: give input_ids, kvc.input_tokens or text")
    if p.recv_kind == P.TRANSFER_SEED and p.recv_tokens == 0:
        p.recv_tokens = p.input  # a receive of the prefill's KV covers the prompt
    if p.session_id:
        _valid_id("session id", p.session_id)
    if not p.session_id and (p.keep or p.load_prefix or p.receive_from):
        raise BadRequest(
            "missing session id: a request without one is single-shot: it keeps nothing, and neither "
            "loads nor receives a suffix"
        )
    if p.open and not p.keep:
        raise BadRequest("kvc.open_session without keep_session: a session is opened to be kept")
    if p.input > capacity:
        raise BadRequest("input_tokens %d exceeds this worker's KV capacity of %d tokens" % (p.input, capacity))
    if p.cached < 0 or p.cached > p.input:
        raise BadRequest("cached_tokens %d out of range [0, input_tokens %d]" % (p.cached, p.input))
    if p.max_new < 0 or p.max_new > MAX_NEW_LIMIT:
        raise BadRequest("max_new_tokens %d out of range [0, %d]" % (p.max_new, MAX_NEW_LIMIT))
    if decode and p.input + p.max_new > capacity:
        raise BadRequest(
            "input_tokens %d + max_new_tokens %d exceed this worker's KV capacity of %d tokens"
            % (p.input, p.max_new, capacity)
        )
    if decode and not p.recv_kind and not p.local and not p.keep:
        raise BadRequest(
            "nothing to serve from: a decode worker without kvc.receive and without local_prefill "
            "serves the session it holds, which needs keep_session"
        )
    if p.local and (not decode or p.recv_kind or (p.keep and not p.open)):
        raise BadRequest(
            "kvc.local_prefill: only a decode worker prefills locally, receiving nothing, for a new "
            "session (open_session) or keeping nothing"
        )
    if p.truncate_to and (p.recv_kind or p.local or p.truncate_to != p.cached):
        raise BadRequest(
            "kvc.truncate_to %d: only a turn on the session held here truncates, to its cached_tokens "
            "(%d)" % (p.truncate_to, p.cached)
        )
    if p.recv_kind == P.TRANSFER_SEED and p.recv_tokens != p.input:
        raise BadRequest(
            "kvc.receive.tokens %d: a SEED receive covers the prompt (input_tokens %d)" % (p.recv_tokens, p.input)
        )
    if p.recv_kind == P.TRANSFER_SNAPSHOT and not (0 < p.recv_tokens <= p.input):
        raise BadRequest(
            "kvc.receive.tokens (the snapshot's length) %d out of range [1, input_tokens %d]" % (p.recv_tokens, p.input)
        )
    if p.load_prefix and not 0 < p.load_prefix < p.input:
        raise BadRequest(
            "kvc.load_prefix_tokens %d: only a session's prefill loads from its store, fewer tokens than "
            "input_tokens %d" % (p.load_prefix, p.input)
        )
    if p.receive_from and (
        not 0 < p.receive_from < p.input or decode and (p.recv_kind != P.TRANSFER_SEED or p.open or not p.keep)
    ):
        raise BadRequest(
            "kvc from_token %d: only a large append (a SEED receive extending the session held here) "
            "receives a suffix, from below input_tokens %d" % (p.receive_from, p.input)
        )
    if p.load and not (
        decode and p.recv_kind == P.TRANSFER_SNAPSHOT and p.keep and p.max_new == 0 and p.recv_tokens == p.input
    ):
        raise BadRequest(
            "kvc.load is a decode worker's zero-output snapshot receive of the whole input that keeps the "
            "session (receive.tokens = input_tokens, max_new_tokens 0, keep_session)"
        )
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
