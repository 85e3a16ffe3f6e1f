"""Suffix-only receive on a real SGLang P/D decode worker (kv_hints receive_from, a large append
into the session's own D): P's create_sender hook skips the pages the control plane says D
keeps; D's receiver takes SGLang's own decode prefix (decode_prefix_len, the streaming session's
or radix cache's match, with send_metadata given only the pages past it) and prepares the room
over [0, tokens) with its own pages for the kept prefix. The KV D holds is never overwritten,
only the suffix's bytes cross, and a receive_from beyond what D holds is refused."""

import numpy as np
import pytest
import torch

import kvctest
from kvctest import PAGE
from test_backend import pd  # noqa: F401  (fixture)

PER_TOKEN = kvctest.LAYERS * 2 * kvctest.HEADS * kvctest.HEAD_DIM * 2


def append(pd, *, room, n, held, receive_from, ppages, dpages):  # noqa: F811
    """One large append: P prefilled the whole context into ppages; D holds [0, held) of it in
    dpages (its decode prefix) and pre-allocated the rest. Drives SGLang's hooked create_sender /
    _create_receiver_and_enqueue, send_metadata with decode_prefix_len, and P's chunks."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pd.dq.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
    hints = kvctest.kvc_hints(
        mode="PD_FALLBACK",
        session_id="s-la",
        room=room,
        prefill_peer_addr=pd.p.peer_addr,
        keep_session=True,
        receive_from=receive_from,
    )
    ids = list(range(1000, 1000 + n))
    rp = kvctest.req("r-%d" % room, ids, room=room, host=pd.host, port=pd.port, hints=hints)
    rd = kvctest.req("r-%d" % room, ids, room=room, host=pd.host, port=pd.port, hints=hints)
    kvctest.fill_random(pd.ppool, ppages, seed=room)
    kvctest.fill_random(pd.dpool, dpages, seed=room + 1)  # D's own KV of the prefix (and stale bytes after it)
    held_bytes = kvctest.token_bytes(pd.dpool, dpages, held)
    assert pd.pq.create_sender(rp, num_kv_heads=kvctest.HEADS)
    tx = rp.disagg_kv_sender
    assert tx.skip_pages == receive_from // PAGE  # the hook, from kv_hints receive_from
    tx.init(len(ppages), 2)
    rx = pd.dq._create_receiver_and_enqueue(rd).kv_receiver
    assert rx.receive_from == receive_from and rx.req is rd and rx.req_to_token is not None
    rx.init(0)
    # SGLang's _pre_alloc: the request's row holds D's prefix slots and the new ones
    pd.dq.req_to_token_pool.alloc([rd])
    slots = torch.tensor([pg * PAGE + i for pg in dpages for i in range(PAGE)], dtype=torch.int32)
    pd.dq.req_to_token_pool.write((rd.kv.req_pool_idx, slice(0, len(slots))), slots)
    suffix = slots[held:n].numpy()  # what SGLang gives send_metadata: the slots past the prefix
    rx.send_metadata(suffix[::PAGE] // PAGE, 5, None, decode_prefix_len=held)
    if rx.poll() == KVPoll.Failed:
        return tx, rx, None, held_bytes
    tx.send(np.array(ppages[:2], dtype=np.int32), None, num_kv_tokens=2 * PAGE)
    tx.send(np.array(ppages[2:], dtype=np.int32), None, num_kv_tokens=n - 2 * PAGE)
    st, _ = kvctest.wait_poll(tx, KVPoll.Success)
    sr, _ = kvctest.wait_poll(rx, KVPoll.Success)
    assert st == KVPoll.Success and sr == KVPoll.Success, (tx._error, rx._error, pd.p.tail(), pd.d.tail())
    return tx, rx, sr, held_bytes


def test_receive_from_equals_the_decode_prefix(pd):  # noqa: F811
    """D holds [0, 32) of a 77-token context and the control plane says so: only tokens 32..76
    cross, D's two pages stay as they were, the rest are P's."""
    n, ppages, dpages = 77, [3, 7, 8, 12, 20], [30, 5, 9, 17, 2]
    tx, rx, _, held_bytes = append(pd, room=931, n=n, held=32, receive_from=32, ppages=ppages, dpages=dpages)
    assert rx.result.bytes == (n - 32) * PER_TOKEN
    assert kvctest.token_bytes(pd.dpool, dpages, 32) == held_bytes
    assert kvctest.token_bytes(pd.dpool, dpages[2:], n - 32) == kvctest.token_bytes(pd.ppool, ppages[2:], n - 32)


def test_decode_prefix_beyond_receive_from_is_not_overwritten(pd):  # noqa: F811
    """D holds more than the control plane knew (48 tokens, receive_from 16, or none at all: a
    radix hit on a shared prefix): P sends from receive_from, the pages D holds past it land in
    SGLang's padded page 0, and D's own KV of [0, 48) is untouched."""
    n, ppages, dpages = 77, [3, 7, 8, 12, 20], [30, 5, 9, 17, 2]
    for room, rf in ((932, 16), (933, 0)):
        tx, rx, _, held_bytes = append(pd, room=room, n=n, held=48, receive_from=rf, ppages=ppages, dpages=dpages)
        assert rx.result.bytes == (n - rf) * PER_TOKEN, rf
        assert kvctest.token_bytes(pd.dpool, dpages, 48) == held_bytes, rf
        assert kvctest.token_bytes(pd.dpool, dpages[3:], n - 48) == kvctest.token_bytes(pd.ppool, ppages[3:], n - 48)


def test_receive_from_beyond_the_decode_prefix_is_refused(pd):  # noqa: F811
    """The control plane says D keeps 48 tokens but SGLang matched only 16 (or none: a decode
    worker without its radix cache): P would skip KV D lacks, so the room fails at once, naming
    what to run."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvcentric_sglang.backend import KvcTransferError

    n, ppages, dpages = 77, [3, 7, 8, 12, 20], [30, 5, 9, 17, 2]
    for room, held in ((934, 16), (935, 0)):
        _, rx, sr, _ = append(pd, room=room, n=n, held=held, receive_from=48, ppages=ppages, dpages=dpages)
        assert sr is None and rx.poll() == KVPoll.Failed, held
        with pytest.raises(KvcTransferError, match="receive_from.*disaggregation-decode-enable-radix-cache"):
            rx.failure_exception()
