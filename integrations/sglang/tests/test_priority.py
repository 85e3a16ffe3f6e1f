"""P-side priority eviction (issue 20 item 4): the gateway sends a decision's low prefill priority
as SGLang's request priority -100; on a prefill worker run with --radix-eviction-policy priority,
SGLang 0.5.23's own radix cache evicts those pages first, and the plugin's request hook keeps the
priority on the request."""

from array import array
from types import SimpleNamespace

import pytest

import kvctest

PAGE = kvctest.PAGE


def radix(tmp, policy, tokens):
    """SGLang's RadixCache as a prefill scheduler builds it, on a real paged allocator."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE))
    kv = kvctest.mha_pool(tmp, "prio-%s" % policy, size=tokens)
    alloc = PagedTokenToKVPoolAllocator(
        size=tokens, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=kv, need_sort=False
    )
    rtp = ReqToTokenPool(size=4, max_context_len=1024, device="cpu", enable_memory_saver=False)
    params = CacheInitParams(
        req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=PAGE, disable=False, eviction_policy=policy
    )
    return RadixCache(params=params), alloc


def insert(cache, alloc, ids, priority):
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    value = alloc.alloc(len(ids))
    assert value is not None
    res = cache.insert(InsertParams(key=RadixKey(array("q", ids)), value=value, priority=priority))
    if res.prefix_len:  # already held: SGLang frees the duplicate slots
        alloc.free(value[: res.prefix_len])


def held(cache, ids):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids)))).device_prefix_len


NORMAL = list(range(1000, 1000 + 3 * PAGE))  # a session P will prefill again (priority 0)
DIRECT = list(range(5000, 5000 + 3 * PAGE))  # a session bound direct-to-D (SGLang's -100)
SHARED = NORMAL[: 2 * PAGE] + list(range(9000, 9000 + PAGE))  # NORMAL's first two pages, then its own


# A radix leaf holds a whole request's tail, so an eviction of 2 pages takes a whole session.
@pytest.mark.parametrize(
    "policy, inserts, normal, direct",
    [
        # LRU: the older session goes, priorities ignored
        ("lru", [(NORMAL, 0), (DIRECT, -100)], 0, 3 * PAGE),
        # priority: the low (direct-to-D) session goes although it is newer
        ("priority", [(NORMAL, 0), (DIRECT, -100)], 3 * PAGE, 0),
        # equal priorities: LRU
        ("priority", [(NORMAL, -100), (DIRECT, -100)], 0, 3 * PAGE),
        # higher values stay (SGLang's sign: kvcentric's 0 is kept over its 100, sent as -100)
        ("priority", [(NORMAL, 5), (DIRECT, 0)], 3 * PAGE, 0),
        # a prefix shared with a normal request keeps priority 0 (TreeNode.priority = max): the low
        # requests' own tails go, the normal session stays whole
        ("priority", [(NORMAL, 0), (SHARED, -100), (DIRECT, -100)], 3 * PAGE, 0),
    ],
)
def test_sglang_priority_eviction_drops_low_values_first(sglang_installed, tmp_path, policy, inserts, normal, direct):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache, alloc = radix(str(tmp_path), policy, 16 * PAGE)
    for ids, prio in inserts:
        insert(cache, alloc, ids, prio)
    cache.evict(EvictParams(num_tokens=2 * PAGE))  # what an allocation under pressure asks for
    assert (held(cache, NORMAL), held(cache, DIRECT)) == (normal, direct)


def test_request_hook_keeps_the_priority(sglang_installed):
    """The plugin's AROUND hook on _create_generation_req (kv_hints on session requests) keeps
    the priority SGLang's scheduler passes to Req, on P's seed and on a request without hints."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.sampling.sampling_params import SamplingParams

    hints = kvctest.kvc_hints(mode="SEED", session_id="s-p", room=5, role="prefill")
    for rid, recv in [("p-seed", SimpleNamespace(kv_hints=hints)), ("p-plain", SimpleNamespace(kv_hints=None))]:
        r = Scheduler._create_generation_req(
            SimpleNamespace(page_size=PAGE),
            recv,
            rid,
            None,
            array("q", [1, 2, 3]),
            SamplingParams(max_new_tokens=1),
            vocab_size=1000,
            priority=-100,
        )
        assert r.priority == -100 and r.to_finish is None, rid
