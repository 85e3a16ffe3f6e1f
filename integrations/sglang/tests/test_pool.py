"""Pool registration from SGLang's real pools, against the real sidecars."""

import grpc
import pytest

import kvctest
from kvcentric_sglang import pool as kvpool
from kvcentric_sglang.bridge import (
    KV_KIND_COMBINED,
    KV_KIND_K,
    KV_KIND_V,
    POOL_LAYOUT_MHA,
    POOL_LAYOUT_MLA,
    BridgeError,
    WorkerBridge,
)
from kvctest import HEAD_DIM, HEADS, LAYERS, PAGE, POOL_TOKENS


@pytest.fixture
def sidecars(bins, tmp):
    d = kvctest.Sidecar(bins["decode"], "d0", tmp)
    p = kvctest.Sidecar(bins["prefill"], "p0", tmp)
    yield d, p
    d.stop()
    p.stop()


def test_mha_pool_registers_layer_interleaved(sglang_installed, sidecars, tmp):
    pool = kvctest.mha_pool(tmp, "mha")
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    reg = kvpool.from_pool(pool)
    item = PAGE * HEADS * HEAD_DIM * 2
    assert (reg.page_size, reg.item_len, reg.num_layers, reg.layout) == (PAGE, item, LAYERS, POOL_LAYOUT_MHA)
    assert reg.page_count == (POOL_TOKENS + PAGE) // PAGE  # page 0 (SGLang's padding page) included
    assert [(b.layer, b.kind) for b in reg.buffers] == [(l, k) for l in range(LAYERS) for k in (KV_KIND_K, KV_KIND_V)]
    path = kvctest.shm_path(tmp, "mha")
    # SGLang's K..K,V..V reordered: buffer 2l is K_l, 2l+1 is V_l, each at its pointer's file offset
    base = pool.k_buffer[0].data_ptr()
    for l in range(LAYERS):
        for j, t in ((2 * l, pool.k_buffer[l]), (2 * l + 1, pool.v_buffer[l])):
            assert reg.buffers[j].shm_path == path
            assert reg.buffers[j].shm_offset == t.data_ptr() - base
            assert reg.buffers[j].size_bytes == reg.page_count * item
    for sc in sidecars:
        with WorkerBridge(sc.sock) as b:
            bpt, endpoint = reg.register(b)
        assert bpt == LAYERS * 2 * HEADS * HEAD_DIM * 2
        assert endpoint == sc.ready["transfer_endpoint"]


def test_mla_pool_registers_combined_buffers(sglang_installed, sidecars, tmp):
    pool = kvctest.mla_pool(tmp, "mla")
    reg = kvpool.from_pool(pool)
    assert reg.layout == POOL_LAYOUT_MLA and reg.num_layers == LAYERS
    assert [(b.layer, b.kind) for b in reg.buffers] == [(l, KV_KIND_COMBINED) for l in range(LAYERS)]
    assert reg.item_len == PAGE * (32 + 8) * 2
    for sc in sidecars:
        with WorkerBridge(sc.sock) as b:
            bpt, _ = reg.register(b)
        assert bpt == LAYERS * (32 + 8) * 2


def test_unsupported_pools_are_refused(sglang_installed, tmp):
    import torch
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = kvctest.mha_pool(tmp, "refuse")
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    cases = [
        (dict(state_types=[StateType.MAMBA]), "state components"),
        (dict(num_draft_entries=6), "draft-model KV"),
        (dict(kv_layout="hnd"), "SGLANG_USE_HND_KVCACHE"),
    ]
    for kw, want in cases:
        with pytest.raises(kvpool.PoolUnsupported, match=want):
            kvpool.buf_infos_to_register(ptrs, lens, items, PAGE, **kw)
    with pytest.raises(kvpool.PoolUnsupported, match="unequal item lengths"):
        kvpool.buf_infos_to_register(ptrs, lens, items[:-1] + [items[-1] * 2], PAGE)
    # a CPU pool SGLang allocated itself is anonymous memory: the sidecar cannot map it
    anon = MHATokenToKVPool(
        size=64,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    with pytest.raises(kvpool.PoolUnsupported, match="not backed by a shared file mapping"):
        kvpool.from_pool(anon)
    # a pool class kvcentric does not know is refused by name
    from sglang.srt.mem_cache.memory_pool import MHATokenToKOnlyPool

    konly = MHATokenToKOnlyPool.__new__(MHATokenToKOnlyPool)
    with pytest.raises(kvpool.PoolUnsupported, match="MHATokenToKOnlyPool is not supported"):
        kvpool.from_pool(konly)


def test_sidecar_refuses_geometry_it_cannot_serve(sglang_installed, sidecars, tmp):
    """A registration the sidecar refuses surfaces as a BridgeError with a stable code."""
    pool = kvctest.mha_pool(tmp, "bad")
    reg = kvpool.from_pool(pool)
    reg.buffers = reg.buffers[:-1]  # one buffer short of 2 * layers
    with WorkerBridge(sidecars[0].sock) as b:
        with pytest.raises(BridgeError) as e:
            reg.register(b)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
