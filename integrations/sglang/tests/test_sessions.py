"""Session hooks through SGLang's real StreamingSession / UnifiedRadixCache and the real decode
sidecar: commit, release before free, the full-context continuity rule."""

import pytest

import kvctest
from kvctest import PAGE


def test_commit_then_release_before_free(dside):
    d, w = dside
    r = w.first_turn(kvctest.streaming_session("s-9"), list(range(1, 41)), [7] * 8)
    assert w.streaming.try_cache_finished_req(r)  # hooked: CommitSession
    slot = w.streaming.slots["s-9"]
    got = kvctest.sessions_of(d)["s-9"]
    assert got["committed_len"] == 48 == slot.kv.kv_committed_len
    # the pages are the slot's own row, page by page
    row = w.rtp.req_to_token[slot.kv.req_pool_idx, :48].tolist()
    assert w.slot_pages("s-9", 48) == [row[i] // PAGE for i in range(0, 48, PAGE)]

    seen_at_free = []
    orig_free = w.cache.free_kv_row

    def free_kv_row(kv, ranges):
        seen_at_free.append(("s-9" in kvctest.sessions_of(d), list(ranges)))
        return orig_free(kv, ranges)

    w.cache.free_kv_row = free_kv_row
    free_before = w.alloc.available_size()
    w.streaming.release_session("s-9")  # hooked: ReleaseSession first, then SGLang frees
    assert seen_at_free == [(False, [(slot.kv.cache_protected_len, 48)])]
    assert "s-9" not in kvctest.sessions_of(d)
    assert w.alloc.available_size() > free_before
    w.streaming.release_session("s-9")  # already gone: no call, no error


def test_aborted_turn_commits_nothing(dside):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    d, w = dside
    r = w.first_turn(kvctest.streaming_session("s-ab"), list(range(1, 33)), [5] * 4)
    r.finished_reason = FINISH_ABORT("client went away")
    assert not w.streaming.try_cache_finished_req(r)
    assert "s-ab" not in kvctest.sessions_of(d)


def test_continuity_strips_history_or_refuses(dside):
    """D gets the full context: an exact-prefix history is stripped (SGLang prepends it again),
    a different history refuses the turn."""
    d, w = dside
    s = kvctest.streaming_session("s-c")
    prompt, out = list(range(1, 41)), [7] * 8
    r0 = w.first_turn(s, prompt, out)
    assert w.streaming.try_cache_finished_req(r0)  # -> session.finish_req(r0)
    assert s.req_nodes, "the first turn is the session's last request"

    full = prompt + out + [900, 901, 902]
    # a turn whose history differs (an edited earlier token) is refused, never appended
    bad = list(full)
    bad[3] = 4242
    t1 = kvctest.turn_input("t1", bad, "s-c", max_new_tokens=4)
    nr = s.create_req(t1, None, vocab_size=1000)  # hooked: continuity
    assert nr.to_finish is not None  # SGLang's abort, as create_req's own refusals
    msg = str(nr.to_finish.message)
    assert "not a prefix" in msg and "first difference at token 3" in msg, msg
    assert not s._inflight
    # the exact-prefix turn: history stripped, SGLang prepends it again -> the full context
    t2 = kvctest.turn_input("t2", full, "s-c", max_new_tokens=4)
    nr = s.create_req(t2, None, vocab_size=1000)
    assert nr.to_finish is None and nr.finished_reason is None, nr.to_finish
    assert list(nr.origin_input_ids) == full
    assert s._inflight


def test_truncate_frees_the_tail_and_commits_the_prefix(dside):
    """A WatchCommands truncate (the sidecar's PREFIX_MISMATCH), worker side: keep [0, keep) of
    the session's KV, free the rest through SGLang's own slot code."""
    from kvcentric_sglang import sessions

    d, w = dside
    w.committed_session("s-t", list(range(1, 57)), [7] * 8)  # 64 tokens
    slot = w.streaming.slots["s-t"]
    keep_pages = w.slot_pages("s-t", 64)[:2]
    free_before = w.alloc.available_size()
    with pytest.raises(ValueError, match="page boundary"):
        sessions.truncate(w.streaming, "s-t", 40)
    protected, slot.kv.cache_protected_len = slot.kv.cache_protected_len, 48  # as if the tree owned 48
    with pytest.raises(ValueError, match="tree-owned prefix"):
        sessions.truncate(w.streaming, "s-t", 32)
    slot.kv.cache_protected_len = protected
    with pytest.raises(KeyError):
        sessions.truncate(w.streaming, "s-none", 32)
    keep = 32
    freed = sessions.truncate(w.streaming, "s-t", keep)
    assert freed == 64 - keep and w.alloc.available_size() == free_before + freed
    assert slot.kv.kv_committed_len == keep and w.slot_pages("s-t", keep) == keep_pages[: keep // PAGE]
    # The shorter CommitSession follows; today's decode sidecar sends no truncate command yet and
    # refuses a shrinking commit outside one (FAILED_PRECONDITION, logged): the worker side only.
