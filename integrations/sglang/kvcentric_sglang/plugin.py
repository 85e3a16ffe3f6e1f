"""The SGLang plugin: ``install()`` is the ``sglang.srt.plugins`` entry point.

SGLang's ``load_plugins()`` calls ``install()`` (before CLI parsing in the launcher, and at the
top of every scheduler process), then ``HookRegistry.apply_hooks()``. ``install()``:

1. adds ``KVCENTRIC = "kvcentric"`` to the closed ``TransferBackend`` enum and the
   ``--disaggregation-transfer-backend`` choice, and AROUND-hooks ``get_kv_class`` to return
   the Kvc* classes (backend.py) for it;
2. AFTER-hooks ``PrefillBootstrapQueue.create_sender`` and
   ``DecodePreallocQueue._create_receiver_and_enqueue`` to carry the request's session id,
   transfer kind and token count (kv_hints "kvc" action) onto the sender / receiver;
3. hooks the streaming sessions (sessions.py): commit after ``try_cache_finished_req``,
   release around ``release_session``, the full-context continuity rule around
   ``Session.create_req``;
4. AROUND-hooks ``Scheduler._create_generation_req`` so session requests keep their kv_hints
   (SGLang passes kv_hints only on the non-session path) and the linker can map rid -> hint;
5. AFTER-hooks ``Scheduler.process_input_requests`` to run queued sidecar commands
   (watch.py) on the scheduler thread, the only thread that may free KV;
6. AFTER-hooks ``Scheduler.get_new_batch_prefill`` (colocated decode) and
   ``DecodePreallocQueue.pop_preallocated`` (P/D decode) to report the requests waiting for
   pages to the decode sidecar (demand.py, ReportDemand).

``apply_hooks`` logs and SKIPS a target that does not resolve. A silently missing hook is the
worst failure (a transfer without aux rows, a free before the sidecar let go of the pages), so
``install()`` first calls ``verify_hooks()``, which raises HookTargetMissing naming the target
and the SGLang version when any target is gone.
"""

from __future__ import annotations

import logging
import pkgutil
from typing import List, Tuple

from . import demand, metrics, runtime, sessions
from .payload import TRANSFER_SNAPSHOT, peer_for

logger = logging.getLogger(__name__)

SGLANG_VERSION_CHECKED = "0.5.23"
BACKEND_NAME = "kvcentric"

_P = "sglang.srt."
TARGETS: List[Tuple[str, str]] = [
    (_P + "disaggregation.utils.TransferBackend", "enum member KVCENTRIC"),
    (_P + "arg_groups.choices.add_disagg_transfer_backend_choices", "CLI choice kvcentric"),
    (_P + "disaggregation.utils.get_kv_class", "AROUND: Kvc* classes"),
    (_P + "disaggregation.prefill.PrefillBootstrapQueue.create_sender", "AFTER: session onto the sender"),
    (_P + "disaggregation.decode.DecodePreallocQueue._create_receiver_and_enqueue", "AFTER: session onto the receiver"),
    (_P + "session.streaming_session.StreamingSession.try_cache_finished_req", "AFTER: CommitSession"),
    (_P + "session.streaming_session.StreamingSession.release_session", "AROUND: ReleaseSession first"),
    (_P + "session.session_controller.Session.create_req", "AROUND: full-context continuity"),
    (_P + "managers.scheduler.Scheduler._create_generation_req", "AROUND: kv_hints on session requests"),
    (_P + "managers.scheduler.Scheduler.process_input_requests", "AFTER: sidecar commands"),
    (_P + "managers.scheduler.Scheduler.get_new_batch_prefill", "AFTER: ReportDemand (colocated decode)"),
    (_P + "disaggregation.decode.DecodePreallocQueue.pop_preallocated", "AFTER: ReportDemand (P/D decode)"),
    (_P + "mem_cache.unified_cache.unified_cache_linker.UnifiedCacheLinker", "base class of KvcLinker"),
]


class HookTargetMissing(RuntimeError):
    """A hook target does not exist in the installed SGLang."""


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # pragma: no cover
        return "unknown"


def verify_hooks(targets=None) -> None:
    """Every target must resolve in the installed SGLang; raises HookTargetMissing naming the
    missing ones and the SGLang version (this plugin was checked against 0.5.23)."""
    missing = []
    for target, why in targets if targets is not None else TARGETS:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as e:
            missing.append("%s (%s): %s" % (target, why, e))
    if missing:
        raise HookTargetMissing(
            "kvcentric-sglang: %d hook target(s) missing in SGLang %s (checked against %s): %s"
            % (len(missing), sglang_version(), SGLANG_VERSION_CHECKED, "; ".join(missing))
        )


# ---- the transfer backend ------------------------------------------------------------------------


def add_enum_member(enum_cls, name: str, value: str):
    """Adds a member to a closed Enum (TransferBackend has no registration API)."""
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    m = object.__new__(enum_cls)
    m._name_, m._value_ = name, value
    m.__objclass__ = enum_cls
    if hasattr(m, "_sort_order_"):
        m._sort_order_ = len(enum_cls._member_names_)
    enum_cls._member_map_[name] = m
    enum_cls._value2member_map_[value] = m
    enum_cls._member_names_.append(name)
    type.__setattr__(enum_cls, name, m)
    return m


def get_kv_class_around(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", transfer_backend) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    from . import backend

    return {
        KVClassType.KVARGS: _kvargs(),
        KVClassType.MANAGER: backend.KvcKVManager,
        KVClassType.SENDER: backend.KvcKVSender,
        KVClassType.RECEIVER: backend.KvcKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: backend.KvcKVBootstrapServer,
    }.get(class_type)


def _kvargs():
    from sglang.srt.disaggregation.base import KVArgs

    return KVArgs


def _carry(obj, req):
    """Session id, transfer kind and token count of req onto a Kvc sender / receiver."""
    from . import backend

    if not isinstance(obj, (backend.KvcKVSender, backend.KvcKVReceiver)):
        return
    try:
        hint = runtime.hint_of_req(req)
    except ValueError as e:
        obj.refuse("malformed kv_hints: %s" % e)
        return
    obj.session_id = runtime.session_id_of_req(req) or ("room-%d" % obj.bootstrap_room)
    if isinstance(obj, backend.KvcKVReceiver) and hint is not None and hint.receive_kind == TRANSFER_SNAPSHOT:
        obj.refuse(
            "a snapshot receive needs a colocated decode worker (a P/D decode worker gets no first token "
            "from a snapshot): route it to one, docs/routing.md section 12"
        )
        return
    send = hint.send if hint is not None else None
    if isinstance(obj, backend.KvcKVSender) and send is not None and send.store_generation:
        # SEED into a colocated D through the prefill store: the whole prompt's KV, as the
        # session's snapshot of the payload's generation (the session's next one).
        obj.to_store, obj.generation, obj.tokens = True, send.store_generation, len(req.origin_input_ids)
        metrics.turn("send_store")
        return
    # The from_token of a large append (the control plane says D keeps [0, from_token) of the
    # session): P's send skips the pages before it; D's receiver checks that its own decode
    # prefix (SGLang's decode_prefix_len: the streaming session's or the radix cache's match)
    # covers them before it prepares the room (KvcKVReceiver.send_metadata).
    if isinstance(obj, backend.KvcKVSender):
        rf = max(0, int(send.from_token)) if send is not None else 0
        obj.skip_pages = rf // obj.kv_mgr.registration.page_size
        if send is not None:
            metrics.turn("send")
        return
    if isinstance(obj, backend.KvcKVReceiver):
        obj.tokens = len(req.origin_input_ids)
        obj.req = req  # its row of req_to_token names the pages of a decode prefix
        if hint is not None and hint.receive is not None:
            obj.kind = hint.receive.kind
            obj.receive_from = max(0, int(hint.receive.from_token))
            # With tensor parallelism, the prefill rank of this rank's index (rank r pairs with r).
            reg = getattr(obj.kv_mgr, "registration", None)
            try:
                peer = peer_for(hint.receive, getattr(reg, "tp_rank", 0), getattr(reg, "tp_size", 0))
            except ValueError as e:
                obj.refuse(str(e))
                return
            if peer:
                obj.bootstrap_addr = peer
            metrics.turn("receive")


def create_sender_after(result, queue, req, *args, **kwargs):
    if result:
        _carry(getattr(req, "disagg_kv_sender", None), req)
    return result


def create_receiver_after(decode_req, queue, req, *args, **kwargs):
    rx = decode_req.kv_receiver
    _carry(rx, req)
    pool = getattr(queue, "req_to_token_pool", None)
    if pool is not None and hasattr(rx, "req_to_token"):
        rx.req_to_token = pool.req_to_token
    return decode_req


# ---- kv_hints on session requests ------------------------------------------------------------------


def create_generation_req_around(original, scheduler, recv_req, *args, **kwargs):
    req = original(scheduler, recv_req, *args, **kwargs)
    hints = getattr(recv_req, "kv_hints", None)
    if hints is not None and getattr(req, "kv_hints", None) is None:
        req.kv_hints = hints
    if hints is not None:
        from . import linker

        try:
            hint = runtime.parse_hint(hints)
        except ValueError as e:  # refuse this request, never the scheduler
            req.set_finish_with_abort("kvcentric: %s" % e)
            return req
        page = int(getattr(scheduler, "page_size", 0) or runtime.state.page_size or 1)
        linker.remember_hint(req.rid, hint, linker.first_page_key(req, page))
        if hint is not None:
            # what SGLang does itself for the turn (the receive, send and load parts are counted
            # where the plugin carries them out)
            if hint.open_session:
                metrics.turn("open")
            if hint.local_prefill:
                metrics.turn("local_prefill")
    return req


def process_input_requests_after(result, scheduler, *args, **kwargs):
    w = runtime.state.watch
    if w is not None:
        w.run_pending(scheduler)  # watch.start_for_process: its streaming sessions, its requests
    return result


# ---- install ------------------------------------------------------------------------------------


_installed = False


def install() -> None:
    """The sglang.srt.plugins entry point. Idempotent."""
    global _installed
    if _installed:
        return
    verify_hooks()
    from sglang.srt.arg_groups import choices
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    add_enum_member(dutils.TransferBackend, "KVCENTRIC", BACKEND_NAME)
    if BACKEND_NAME not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.add_disagg_transfer_backend_choices([BACKEND_NAME])
    reg = HookRegistry.register
    reg(_P + "disaggregation.utils.get_kv_class", get_kv_class_around, HookType.AROUND)
    reg(_P + "disaggregation.prefill.PrefillBootstrapQueue.create_sender", create_sender_after, HookType.AFTER)
    reg(
        _P + "disaggregation.decode.DecodePreallocQueue._create_receiver_and_enqueue",
        create_receiver_after,
        HookType.AFTER,
    )
    reg(_P + "session.streaming_session.StreamingSession.try_cache_finished_req", sessions.commit_after, HookType.AFTER)
    reg(_P + "session.streaming_session.StreamingSession.release_session", sessions.release_around, HookType.AROUND)
    reg(_P + "session.session_controller.Session.create_req", sessions.continuity_around, HookType.AROUND)
    reg(_P + "managers.scheduler.Scheduler._create_generation_req", create_generation_req_around, HookType.AROUND)
    reg(_P + "managers.scheduler.Scheduler.process_input_requests", process_input_requests_after, HookType.AFTER)
    reg(_P + "managers.scheduler.Scheduler.get_new_batch_prefill", demand.after_prefill_schedule, HookType.AFTER)
    reg(
        _P + "disaggregation.decode.DecodePreallocQueue.pop_preallocated", demand.after_pop_preallocated, HookType.AFTER
    )
    _installed = True
    logger.info(
        "kvcentric-sglang installed on SGLang %s (checked against %s)", sglang_version(), SGLANG_VERSION_CHECKED
    )


def verify_applied() -> None:
    """Raises HookTargetMissing when install() ran but a hook of it was not applied (SGLang's
    apply_hooks() only logs a target it cannot patch). Called by the KV manager and the linker
    when they start, i.e. after load_plugins() finished."""
    if not _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = [t for t in installed_hooks() if t not in HookRegistry._patched]
    if missing:
        raise HookTargetMissing(
            "kvcentric-sglang: hooks registered but not applied in SGLang %s: %s"
            % (sglang_version(), ", ".join(missing))
        )


def installed_hooks() -> List[str]:
    """The hook targets this plugin registers (for tests and diagnostics)."""
    return [t for t, why in TARGETS if why.split(":")[0] in ("AROUND", "AFTER")]
