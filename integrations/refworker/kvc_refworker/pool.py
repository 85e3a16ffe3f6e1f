"""The paged KV pool, with SGLang's exact geometry.

Per layer a K and a V buffer of shape (size + page_size, kv_heads, head_dim) (NHD), K_l and V_l
the two halves of one allocation per layer, page 0 reserved (SGLang's padded page: it is never
allocated), token slot = page * page_size + offset. When sglang is importable this *is* SGLang's
own MHATokenToKVPool (its buffers rebound to a /dev/shm file on CPU, so that the sidecar can map
them); otherwise an equivalent pool with the same layout. On CPU the buffers live in one
/dev/shm file (registered as shared-memory regions); on CUDA each layer is one allocation
registered by CUDA IPC handle.
"""

import mmap
import os
import random
import threading
from typing import List, Optional, Sequence

import torch

try:  # the plugin's client (integrations/sglang); the refworker speaks to its sidecar through it
    from kvcentric_sglang.bridge import KV_KIND_K, KV_KIND_V, KVBuffer
except ImportError:  # pragma: no cover - the package is a hard dependency
    raise


def pages_for(tokens: int, page_size: int) -> int:
    return (tokens + page_size - 1) // page_size


def _try_sglang_pool(size, page_size, dtype, heads, head_dim, layers):
    try:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    except Exception:  # noqa: BLE001 - sglang absent or not importable here (GPU machine)
        return None
    return MHATokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=dtype,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )


def ipc_handle_bytes(h: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t from torch's shared handle: torch >= 2.2 serializes it as
    version byte, type byte ('c': cudaMalloc'd block), then the handle; older torch gives the
    bare 64 bytes. Expandable segments ('e') cannot be opened by cudaIpcOpenMemHandle."""
    if len(h) == 64:
        return h
    if len(h) == 66 and h[1:2] == b"c":
        return h[2:]
    if len(h) >= 2 and h[1:2] == b"e":
        raise RuntimeError(
            "the KV pool is in an expandable segment "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): its CUDA IPC handle cannot be "
            "opened by the sidecar; unset it"
        )
    raise RuntimeError("unknown CUDA IPC handle format (%d bytes)" % len(h))


class KVPool:
    """Paged KV pool plus a page allocator (pages 1..num_pages; page 0 reserved)."""

    def __init__(
        self,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        capacity_tokens: int,
        page_size: int,
        device: str,
        shm_dir: str = "/dev/shm",
        name: str = "kvc-refworker",
        use_sglang: bool = True,
        seed: int = 0,
    ):
        if page_size <= 0 or capacity_tokens < page_size:
            raise ValueError("capacity %d tokens must hold at least one page of %d" % (capacity_tokens, page_size))
        self.layers, self.heads, self.head_dim, self.dtype = layers, heads, head_dim, dtype
        self.page_size = page_size
        self.num_pages = capacity_tokens // page_size  # usable pages, numbered 1..num_pages
        self.size = self.num_pages * page_size  # SGLang's `size`: usable token slots
        self.rows = self.size + page_size
        self.device = torch.device(device)
        self.elsize = torch.empty((), dtype=dtype).element_size()
        self.item_len = page_size * heads * head_dim * self.elsize  # bytes per page per buffer
        self.buffer_bytes = self.rows * heads * head_dim * self.elsize
        self.shm_path = ""
        self._mm = None
        self.sglang_pool = None
        self.k_buffer: List[torch.Tensor] = []
        self.v_buffer: List[torch.Tensor] = []
        self._layer_allocs: List[torch.Tensor] = []
        if self.device.type == "cpu":
            self._make_shm(shm_dir, name)
            if use_sglang:
                self.sglang_pool = _try_sglang_pool(self.size, page_size, dtype, heads, head_dim, layers)
                if self.sglang_pool is not None:
                    self._rebind_sglang()
        else:
            for _ in range(layers):
                a = torch.zeros((2, self.rows, heads, head_dim), dtype=dtype, device=self.device)
                self._layer_allocs.append(a)
                self.k_buffer.append(a[0])
                self.v_buffer.append(a[1])
        self.source = "sglang.MHATokenToKVPool" if self.sglang_pool is not None else "builtin"
        # Allocator: a free list of shuffled runs of 1-8 contiguous pages, used LIFO, so page
        # lists are fragmented the way a real allocator's are after churn.
        rng = random.Random(seed)
        runs, p = [], 1
        while p <= self.num_pages:
            n = min(rng.randint(1, 8), self.num_pages - p + 1)
            runs.append(list(range(p, p + n)))
            p += n
        rng.shuffle(runs)
        self._free = [pg for run in reversed(runs) for pg in reversed(run)]
        self._lock = threading.Lock()

    # -- memory ---------------------------------------------------------------------------------

    def _make_shm(self, shm_dir: str, name: str) -> None:
        total = 2 * self.layers * self.buffer_bytes
        os.makedirs(shm_dir, exist_ok=True)
        self.shm_path = os.path.join(shm_dir, "%s-%d.kvpool" % (name, os.getpid()))
        fd = os.open(self.shm_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, total)
            self._mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._shm_base = raw.data_ptr()
        for l in range(self.layers):
            # One allocation per layer, K then V (SGLang's _create_buffers_normal).
            a = raw[2 * l * self.buffer_bytes : (2 * l + 2) * self.buffer_bytes].view(self.dtype)
            a = a.view(2, self.rows, self.heads, self.head_dim)
            self._layer_allocs.append(a)
            self.k_buffer.append(a[0])
            self.v_buffer.append(a[1])

    def _rebind_sglang(self) -> None:
        sp = self.sglang_pool
        if len(sp.k_buffer) != self.layers or tuple(sp.k_buffer[0].shape) != (self.rows, self.heads, self.head_dim):
            raise RuntimeError(
                "SGLang pool geometry %s differs from the expected %s"
                % (tuple(sp.k_buffer[0].shape), (self.rows, self.heads, self.head_dim))
            )
        sp.k_buffer = list(self.k_buffer)
        sp.v_buffer = list(self.v_buffer)
        if hasattr(sp, "_init_data_ptrs_and_strides"):
            sp._init_data_ptrs_and_strides()
        # Our views are now SGLang's buffers: read them back through SGLang's own accessors.
        self.k_buffer = [sp.get_key_buffer(l) for l in range(self.layers)]
        self.v_buffer = [sp.get_value_buffer(l) for l in range(self.layers)]

    def buf_infos(self):
        """(ptrs, lens, item_lens) in SGLang's get_contiguous_buf_infos order: K_0..K_{L-1},
        V_0..V_{L-1} (SGLang's own method when the pool is SGLang's)."""
        if self.sglang_pool is not None:
            return self.sglang_pool.get_contiguous_buf_infos()
        ts = self.k_buffer + self.v_buffer
        return [t.data_ptr() for t in ts], [self.buffer_bytes] * len(ts), [self.item_len] * len(ts)

    def bridge_buffers(self) -> List[KVBuffer]:
        """The pool as RegisterKVPool wants it: layer-interleaved K_0, V_0, K_1, ... (reordered
        from SGLang's K..K,V..V), shared-memory regions on CPU, CUDA IPC handles on GPU."""
        ptrs, lens, item_lens = self.buf_infos()
        if any(il != self.item_len for il in item_lens):
            raise RuntimeError("pool item lengths %s differ from %d" % (sorted(set(item_lens)), self.item_len))
        L = self.layers
        out = []
        for l in range(L):
            for kind, idx in ((KV_KIND_K, l), (KV_KIND_V, L + l)):
                if self.device.type == "cpu":
                    out.append(
                        KVBuffer(
                            layer=l,
                            kind=kind,
                            size_bytes=lens[idx],
                            shm_path=self.shm_path,
                            shm_offset=ptrs[idx] - self._shm_base,
                        )
                    )
                else:
                    t = self.k_buffer[l] if kind == KV_KIND_K else self.v_buffer[l]
                    out.append(self._cuda_ref(t, l, kind, lens[idx]))
        return out

    def _cuda_ref(self, t: torch.Tensor, layer: int, kind: int, size: int) -> KVBuffer:
        st = t.untyped_storage()
        info = st._share_cuda_()  # (device, ipc handle of the allocation, size, offset in it, ...)
        dev, handle, off = info[0], ipc_handle_bytes(bytes(info[1])), info[3]
        return KVBuffer(
            layer=layer,
            kind=kind,
            size_bytes=size,
            cuda_ipc_handle=handle,
            cuda_device=int(dev),
            cuda_offset=int(off) + t.storage_offset() * self.elsize,
        )

    def close(self) -> None:
        self.k_buffer, self.v_buffer, self._layer_allocs = [], [], []
        self.sglang_pool = None
        if self.shm_path:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass

    # -- pages ----------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> Optional[List[int]]:
        with self._lock:
            if n > len(self._free):
                return None
            out = self._free[-n:][::-1] if n else []
            del self._free[len(self._free) - n :]
            return out

    def alloc_contiguous(self, n: int) -> Optional[List[int]]:
        """n pages with consecutive numbers when the free pages hold such a run (the lowest
        one), else as alloc. A prefill worker frees its pages after each transfer, so its pool is
        mostly free and a request's pages are one run: a load from the store is then one copy
        per buffer and a gather a slice (SGLang's paged allocator, sorting its free pages,
        hands a mostly idle prefill worker consecutive pages too)."""
        with self._lock:
            if n > len(self._free):
                return None
            if n > 0:
                free = sorted(self._free)
                run = 1
                for i in range(1, len(free) + 1):
                    if run >= n:
                        out = free[i - n : i]
                        taken = set(out)
                        self._free = [pg for pg in self._free if pg not in taken]
                        return out
                    if i < len(free) and free[i] == free[i - 1] + 1:
                        run += 1
                    else:
                        run = 1
        return self.alloc(n)

    def free(self, pages: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(reversed(list(pages)))

    # -- KV -------------------------------------------------------------------------------------

    def locs(self, pages: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Token slots of tokens [start, end) held in pages (token order)."""
        ps = self.page_size
        pos = torch.arange(start, end, dtype=torch.long)
        pg = torch.as_tensor(list(pages), dtype=torch.long)
        if end > start and (end - 1) // ps >= len(pg):
            raise ValueError("tokens up to %d need %d pages, have %d" % (end, pages_for(end, ps), len(pg)))
        return (pg[pos // ps] * ps + pos % ps).to(self.device)

    def contiguous_slots(self, pages: Sequence[int], start: int, end: int) -> Optional[int]:
        """The first token slot of [start, end) when those tokens' pages are consecutive (their
        slots one range), else None."""
        ps = self.page_size
        if end <= start:
            return None
        a, b = start // ps, (end - 1) // ps
        if b >= len(pages):
            return None
        first = pages[a]
        for i in range(a + 1, b + 1):
            if pages[i] != first + (i - a):
                return None
        return first * ps + start % ps

    def gather(self, pages: Sequence[int], start: int, end: int, layer: Optional[int] = None):
        """Per-layer K and V of tokens [start, end): lists of (tokens, heads, head_dim) tensors
        (views of the pool when the pages are consecutive, else copies; callers do not write
        them); with layer, that layer's K and V only."""
        ks = self.k_buffer if layer is None else [self.k_buffer[layer]]
        vs = self.v_buffer if layer is None else [self.v_buffer[layer]]
        s0 = self.contiguous_slots(pages, start, end)
        if s0 is not None:
            n = end - start
            return [k[s0 : s0 + n] for k in ks], [v[s0 : s0 + n] for v in vs]
        idx = self.locs(pages, start, end)
        return [k.index_select(0, idx) for k in ks], [v.index_select(0, idx) for v in vs]

    def scatter(self, pages: Sequence[int], start: int, ks, vs) -> None:
        """Writes per-layer K and V of tokens [start, start + n) into their slots."""
        n = ks[0].shape[0]
        if n == 0:
            return
        s0 = self.contiguous_slots(pages, start, start + n)
        if s0 is not None:  # consecutive pages: one slice per buffer
            for l in range(self.layers):
                self.k_buffer[l][s0 : s0 + n].copy_(ks[l])
                self.v_buffer[l][s0 : s0 + n].copy_(vs[l])
            return
        idx = self.locs(pages, start, start + n)
        for l in range(self.layers):
            self.k_buffer[l].index_copy_(0, idx, ks[l].to(self.dtype))
            self.v_buffer[l].index_copy_(0, idx, vs[l].to(self.dtype))
