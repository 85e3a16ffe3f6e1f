"""SGLang KV pool -> RegisterKVPool.

SGLang describes a pool for P/D transfer with ``pool.get_contiguous_buf_infos()``:
``(ptrs, lens, item_lens)`` in ``_pd_registerable_tensors()`` order, K0..K{L-1} then V0..V{L-1}
for an MHA pool (``MHATokenToKVPool``), one buffer per layer for an MLA pool
(``MLATokenToKVPool``). ``item_len`` is the bytes of one page of one buffer, and page ``i`` of a
buffer starts at ``ptr + i * item_len``. Page 0 is SGLang's padding page: it is never allocated
to a request, but it is part of every buffer, so ``page_count`` counts it.

kvcentric's RegisterKVPool wants the buffers layer-interleaved (K0, V0, K1, V1, ...) or, for
MLA, one KV_KIND_COMBINED buffer per layer, each as either a shared-memory file region (CPU
development: the file that backs the pointer, found in /proc/self/maps) or a CUDA IPC handle of
the whole allocation the pointer lies in plus the pointer's offset in it (GPU).

What the sidecars cannot move is refused with PoolUnsupported: state components (mamba, SWA,
DSA, ...), draft-model KV (speculative decoding), HND / vectorized layouts, unequal item lengths.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .bridge import KV_KIND_COMBINED, KV_KIND_K, KV_KIND_V, POOL_LAYOUT_MHA, POOL_LAYOUT_MLA, KVBuffer, WorkerBridge

LAYOUT_MHA, LAYOUT_MLA = "mha", "mla"


class PoolUnsupported(ValueError):
    """The pool has a shape kvcentric cannot transfer; the message says what and why."""


@dataclass
class PoolRegistration:
    """The arguments of one RegisterKVPool call."""

    page_size: int
    item_len: int
    page_count: int
    num_layers: int
    layout: int  # POOL_LAYOUT_MHA or POOL_LAYOUT_MLA
    buffers: List[KVBuffer]
    tp_rank: int = 0
    tp_size: int = 0
    aux_item_lens: List[int] = field(default_factory=list)
    model: str = ""

    def register(self, bridge: WorkerBridge) -> Tuple[int, str]:
        """RegisterKVPool on the sidecar; returns (kv_bytes_per_token, transfer_endpoint)."""
        return bridge.register_kv_pool(
            self.page_size,
            self.item_len,
            self.page_count,
            self.num_layers,
            self.buffers,
            model=self.model,
            layout=self.layout,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            aux_item_lens=self.aux_item_lens,
        )


# ---- memory -> SharedMemoryRef / CudaIpcRef -------------------------------------------------


@dataclass
class _Mapping:
    start: int
    end: int
    offset: int
    path: str


def _file_mappings(maps_path: str = "/proc/self/maps") -> List[_Mapping]:
    out = []
    with open(maps_path) as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            if not path.startswith("/") or path.endswith(" (deleted)"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append(_Mapping(lo, hi, int(parts[2], 16), path))
    return out


def shm_region(ptr: int, length: int, mappings: Optional[List[_Mapping]] = None) -> Tuple[str, int]:
    """The file and the offset in it that back [ptr, ptr+length) of this process, from
    /proc/self/maps. The region must lie in one shared file mapping (a /dev/shm file or any
    file mapped MAP_SHARED); anonymous memory (a plain torch CPU tensor) cannot be mapped by the
    sidecar and is refused."""
    for m in mappings if mappings is not None else _file_mappings():
        if m.start <= ptr and ptr + length <= m.end:
            return m.path, m.offset + (ptr - m.start)
    raise PoolUnsupported(
        "KV buffer at 0x%x (%d bytes) is not backed by a shared file mapping; on CPU the pool must live in "
        "/dev/shm (kvcentric_sglang.pool.place_pool_in_shm), on GPU pass device=<cuda index>" % (ptr, length)
    )


def cuda_ipc_region(ptr: int) -> Tuple[bytes, int, int]:
    """(cudaIpcMemHandle bytes of the whole allocation holding ptr, device ordinal, offset of ptr
    in that allocation), through the CUDA driver API (cuda-python, an SGLang dependency).

    The handle is legacy CUDA IPC: it refuses memory from the VMM allocator
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, --enable-memory-saver, custom memory
    pools); those are reported with that cause."""
    try:
        from cuda.bindings import driver as cu  # cuda-python >= 12.6
    except ImportError:  # pragma: no cover - older cuda-python
        from cuda import cuda as cu  # type: ignore

    def ok(res, what):
        if int(res[0]) != 0:
            raise PoolUnsupported("%s(0x%x) failed: %s" % (what, ptr, res[0]))
        return res[1:]

    ok(cu.cuInit(0), "cuInit")
    base, _size = ok(cu.cuMemGetAddressRange(cu.CUdeviceptr(ptr)), "cuMemGetAddressRange")
    base_i = int(base)
    (dev,) = ok(
        cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cu.CUdeviceptr(ptr)),
        "cuPointerGetAttribute",
    )
    res = cu.cuIpcGetMemHandle(cu.CUdeviceptr(base_i))
    if int(res[0]) != 0:
        raise PoolUnsupported(
            "cuIpcGetMemHandle of the allocation at 0x%x (holding KV buffer 0x%x) failed: %s; legacy CUDA IPC "
            "refuses VMM allocations: unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments, do not use "
            "--enable-memory-saver or SGLANG_MOONCAKE_CUSTOM_MEM_POOL" % (base_i, ptr, res[0])
        )
    raw = res[1].reserved
    handle = bytes(raw) if isinstance(raw, (bytes, bytearray)) else bytes((int(x) & 0xFF) for x in raw)
    if len(handle) != 64:
        raise PoolUnsupported("cudaIpcMemHandle of %d bytes, want 64" % len(handle))
    return handle, int(dev), ptr - base_i


def _memory(ptr: int, length: int, device, mappings) -> Dict:
    if device is None or device == "cpu":
        path, off = shm_region(ptr, length, mappings)
        return {"shm_path": path, "shm_offset": off}
    handle, dev, off = cuda_ipc_region(ptr)
    return {"cuda_ipc_handle": handle, "cuda_device": dev, "cuda_offset": off}


# ---- the conversion ------------------------------------------------------------------------------


def buf_infos_to_register(
    ptrs: Sequence[int],
    lens: Sequence[int],
    item_lens: Sequence[int],
    page_size: int,
    *,
    layout: str = LAYOUT_MHA,
    device=None,
    num_draft_entries: int = 0,
    state_types: Sequence = (),
    kv_layout: Optional[str] = None,
    tp_rank: int = 0,
    tp_size: int = 0,
    aux_item_lens: Sequence[int] = (),
    model: str = "",
    _mappings: Optional[List[_Mapping]] = None,
) -> PoolRegistration:
    """Turns SGLang's get_contiguous_buf_infos() (K0..K{L-1}, V0..V{L-1} for MHA; one buffer
    per layer for MLA) into a RegisterKVPool: buffers layer-interleaved, page_count including the
    reserved page 0, memory as shm file+offset (device None/"cpu") or CUDA IPC handle + offset
    (device = a CUDA index or "cuda:N"). Raises PoolUnsupported for what the sidecars cannot
    move."""
    ptrs, lens, item_lens = list(ptrs), list(lens), list(item_lens)
    if state_types:
        raise PoolUnsupported(
            "the pool has state components %s (mamba/SWA/DSA/...); kvcentric transfers only "
            "full-attention KV (MHA or MLA)" % sorted(str(getattr(s, "value", s)) for s in state_types)
        )
    if num_draft_entries:
        raise PoolUnsupported(
            "the pool carries %d draft-model KV buffers (speculative decoding); kvcentric does not "
            "transfer draft KV: run without speculative decoding" % num_draft_entries
        )
    if kv_layout not in (None, "", "nhd"):
        raise PoolUnsupported(
            "KV layout %r is not supported (kvcentric needs NHD slot rows; unset SGLANG_USE_HND_KVCACHE)" % kv_layout
        )
    if not (len(ptrs) == len(lens) == len(item_lens)) or not ptrs:
        raise PoolUnsupported(
            "buffer infos of unequal or zero length: %d ptrs, %d lens, %d item_lens"
            % (len(ptrs), len(lens), len(item_lens))
        )
    if page_size <= 0:
        raise PoolUnsupported("page_size %d must be positive" % page_size)
    item = item_lens[0]
    if any(x != item for x in item_lens):
        raise PoolUnsupported(
            "buffers of unequal item lengths %s (K and V of different head dims?); the "
            "sidecars need one bytes-per-page for every buffer" % sorted(set(item_lens))
        )
    if item <= 0 or any(n % item for n in lens):
        raise PoolUnsupported("buffer lengths %s are not whole pages of %d bytes" % (sorted(set(lens)), item))
    page_count = min(lens) // item
    if page_count < 2:
        raise PoolUnsupported("a pool of %d pages (page 0 is reserved) holds nothing" % page_count)
    if isinstance(device, str) and device.startswith("cuda"):
        device = int(device.split(":", 1)[1]) if ":" in device else 0
    size = page_count * item
    if _mappings is None and (device is None or device == "cpu"):
        _mappings = _file_mappings()
    bufs: List[KVBuffer] = []
    if layout == LAYOUT_MHA:
        if len(ptrs) % 2:
            raise PoolUnsupported("an MHA pool has K and V per layer; got %d buffers" % len(ptrs))
        nl = len(ptrs) // 2
        for layer in range(nl):
            for kind, p in ((KV_KIND_K, ptrs[layer]), (KV_KIND_V, ptrs[nl + layer])):
                bufs.append(KVBuffer(layer=layer, kind=kind, size_bytes=size, **_memory(p, size, device, _mappings)))
        pl = POOL_LAYOUT_MHA
    elif layout == LAYOUT_MLA:
        nl = len(ptrs)
        for layer, p in enumerate(ptrs):
            bufs.append(
                KVBuffer(layer=layer, kind=KV_KIND_COMBINED, size_bytes=size, **_memory(p, size, device, _mappings))
            )
        pl = POOL_LAYOUT_MLA
    else:
        raise PoolUnsupported("unknown layout %r (want %r or %r)" % (layout, LAYOUT_MHA, LAYOUT_MLA))
    return PoolRegistration(
        page_size=page_size,
        item_len=item,
        page_count=page_count,
        num_layers=nl,
        layout=pl,
        buffers=bufs,
        tp_rank=tp_rank,
        tp_size=tp_size,
        aux_item_lens=list(aux_item_lens),
        model=model,
    )


def from_pool(pool, **kw) -> PoolRegistration:
    """buf_infos_to_register for an SGLang KV pool object: MHATokenToKVPool (and its NHD
    subclasses) or MLATokenToKVPool. Other pools (hybrid linear, DSA, SWA, K-only ...) are
    refused by name."""
    name = type(pool).__name__
    mro = {c.__name__ for c in type(pool).__mro__}
    if (
        name
        in (
            "DSATokenToKVPool",
            "HybridLinearKVPool",
            "MHATokenToKOnlyPool",
            "MiniMaxSparseKVPool",
            "SWAKVPool",
            "NoOpMHATokenToKVPool",
        )
        or "HybridLinearKVPool" in mro
    ):
        raise PoolUnsupported(
            "SGLang pool %s is not supported by kvcentric (only MHATokenToKVPool and MLATokenToKVPool)" % name
        )
    if "MLATokenToKVPool" in mro:
        layout = LAYOUT_MLA
    elif "MHATokenToKVPool" in mro:
        layout = LAYOUT_MHA
        if getattr(pool, "use_hnd", False):
            kw.setdefault("kv_layout", "hnd")
        elif getattr(pool, "kv_cache_layout", None) not in (None, "nhd"):
            kw.setdefault("kv_layout", pool.kv_cache_layout)
    else:
        raise PoolUnsupported(
            "SGLang pool %s is not supported by kvcentric (only MHATokenToKVPool and MLATokenToKVPool)" % name
        )
    if kw.get("kv_layout") not in (None, "", "nhd"):
        return buf_infos_to_register([0], [0], [0], pool.page_size, layout=layout, **kw)  # raises
    ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
    dev = str(getattr(pool, "device", "cpu"))
    kw.setdefault("device", None if dev == "cpu" else dev)
    return buf_infos_to_register(ptrs, lens, item_lens, pool.page_size, layout=layout, **kw)


def from_kv_args(kv_args, is_mla: bool, **kw) -> PoolRegistration:
    """buf_infos_to_register for SGLang's KVArgs (what a transfer backend's manager gets)."""
    dev = kw.pop("device", "auto")
    if dev == "auto":
        dev = _device_of(kv_args.kv_data_ptrs[0]) if kv_args.kv_data_ptrs else None
    return buf_infos_to_register(
        kv_args.kv_data_ptrs,
        kv_args.kv_data_lens,
        kv_args.kv_item_lens,
        kv_args.page_size,
        layout=LAYOUT_MLA if is_mla else LAYOUT_MHA,
        device=dev,
        num_draft_entries=getattr(kv_args, "num_draft_entries", 0) or 0,
        state_types=list(getattr(kv_args, "state_types", None) or []),
        kv_layout=getattr(kv_args, "kv_layout", None),
        aux_item_lens=list(getattr(kv_args, "aux_item_lens", None) or []),
        **kw,
    )


def _device_of(ptr: int):
    """None for host memory, else the CUDA device ordinal holding ptr."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    try:
        from cuda.bindings import driver as cu
    except ImportError:  # pragma: no cover
        from cuda import cuda as cu  # type: ignore
    cu.cuInit(0)
    err, mtype = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cu.CUdeviceptr(ptr))
    if int(err) != 0 or int(mtype) != int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE):
        return None
    err, dev = cu.cuPointerGetAttribute(cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cu.CUdeviceptr(ptr))
    return int(dev)


# ---- CPU development: put a pool's buffers into a /dev/shm file -------------------------------------


def place_pool_in_shm(pool, path: str):
    """Moves an SGLang CPU KV pool's buffers into one shared-memory file (created at path), so a
    sidecar can map them: MHA layer l gets [K_l | V_l] as the two halves of one region (as
    SGLang's own fused allocation), MLA one region per layer. The buffers keep their shapes,
    strides and contents; the pool's pointer tables are rebuilt. Returns the mmap (keep it alive
    as long as the pool). CPU development and tests only: on GPU the pool is registered in place."""
    import mmap

    import torch

    if str(getattr(pool, "device", "cpu")) != "cpu":
        raise ValueError("place_pool_in_shm is for CPU pools; a GPU pool is registered with CUDA IPC")
    page = mmap.PAGESIZE
    if hasattr(pool, "kv_buffer"):
        groups = [[b] for b in pool.kv_buffer]
    else:
        groups = [[k, v] for k, v in zip(pool.k_buffer, pool.v_buffer)]
    spans = [sum(_align(t.numel() * t.element_size(), page) for t in g) for g in groups]
    total = sum(spans)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, total)
        mem = mmap.mmap(fd, total)
    finally:
        os.close(fd)
    base = torch.frombuffer(mem, dtype=torch.uint8)
    off = 0
    new_groups = []
    for g in groups:
        ng = []
        for t in g:
            n = t.numel() * t.element_size()
            dst = base[off : off + n].view(t.dtype).view(t.shape)
            dst.copy_(t)
            ng.append(dst)
            off += _align(n, page)
        new_groups.append(ng)
    if hasattr(pool, "kv_buffer"):
        pool.kv_buffer = [g[0] for g in new_groups]
        pool.data_ptrs = torch.tensor([x.data_ptr() for x in pool.kv_buffer], dtype=torch.uint64)
    else:
        pool.k_buffer = [g[0] for g in new_groups]
        pool.v_buffer = [g[1] for g in new_groups]
        if hasattr(pool, "_init_data_ptrs_and_strides"):
            pool._init_data_ptrs_and_strides()
    return mem


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ---- aux rows (SGLang's MetadataBuffers, host memory) ---------------------------------------------


def read_aux_rows(ptrs: Sequence[int], item_lens: Sequence[int], index: int) -> List[bytes]:
    """Row `index` of every aux buffer (SGLang's MetadataBuffers are host tensors: output ids,
    cached tokens, logprobs, ..., bootstrap room)."""
    return [ctypes.string_at(p + n * index, n) for p, n in zip(ptrs, item_lens)]


def write_aux_rows(ptrs: Sequence[int], item_lens: Sequence[int], index: int, rows: Sequence[bytes]) -> None:
    """Writes rows into row `index` of every aux buffer; a row count or size that differs from
    the local buffers is refused (P and D must run the same model and options)."""
    if len(rows) != len(ptrs):
        raise ValueError(
            "%d aux rows for %d aux buffers (P and D differ in metadata buffers: same model, "
            "same speculative/logprob options needed)" % (len(rows), len(ptrs))
        )
    for i, (n, r) in enumerate(zip(item_lens, rows)):
        if len(r) != n:
            raise ValueError("aux row %d has %d bytes, the local buffer %d" % (i, len(r), n))
    for p, n, r in zip(ptrs, item_lens, rows):
        ctypes.memmove(p + n * index, r, n)
