"""Content addresses of KV pages: the chained page hash of kvcentric's Go package pkg/pagehash.

Definition (version 1). For a page size P >= 1, a key K (uint64 cluster secret, 0 when none)
and token ids t_0 .. t_{n-1} (each a uint32)::

    h_root = XXH64(LE64(P), seed=K)
    h_i    = XXH64(LE32(t_{iP}) || ... || LE32(t_{iP+P-1}), seed=h_{i-1})   (h_{-1} = h_root)

chain() returns h_0 .. h_{floor(n/P)-1}, one hash per full page; prefix_hash(ids, n) hashes
exactly the first n ids, the last page partial when P does not divide n. Because each h_i
commits to every earlier token, two chains agree at page i exactly when their first i+1 pages
agree, so common_pages() is a binary search.

XXH64 comes from the `xxhash` package when it is installed (C speed); otherwise a pure-Python
XXH64 below is used (same values, ~100x slower: fine for tests, slow for 32K-token prompts).
The test vectors in pkg/pagehash/testdata/vectors.json are checked by both implementations.
"""

import struct
from typing import List, Sequence

try:  # pragma: no cover - depends on the environment
    import xxhash as _xxhash
except ImportError:  # pragma: no cover
    _xxhash = None

__all__ = [
    "VERSION",
    "xxh64",
    "root",
    "next_hash",
    "chain",
    "append_chain",
    "extend",
    "prefix_hash",
    "common_pages",
    "is_prefix",
    "backend",
]

VERSION = 1
_M = (1 << 64) - 1
_P1 = 11400714785074694791
_P2 = 14029467366897019727
_P3 = 1609587929392839161
_P4 = 9650029242287828579
_P5 = 2870177450012600261


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M


def _round(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _M
    return (_rotl(acc, 31) * _P1) & _M


def _merge(acc: int, val: int) -> int:
    acc ^= _round(0, val)
    return (acc * _P1 + _P4) & _M


def xxh64_pure(data: bytes, seed: int = 0) -> int:
    """XXH64 of data with a 64-bit seed, in pure Python."""
    n = len(data)
    i = 0
    seed &= _M
    if n >= 32:
        v1 = (seed + _P1 + _P2) & _M
        v2 = (seed + _P2) & _M
        v3 = seed
        v4 = (seed - _P1) & _M
        while i + 32 <= n:
            a, b, c, d = struct.unpack_from("<4Q", data, i)
            v1, v2, v3, v4 = _round(v1, a), _round(v2, b), _round(v3, c), _round(v4, d)
            i += 32
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & _M
        for v in (v1, v2, v3, v4):
            h = _merge(h, v)
    else:
        h = (seed + _P5) & _M
    h = (h + n) & _M
    while i + 8 <= n:
        (k,) = struct.unpack_from("<Q", data, i)
        h ^= _round(0, k)
        h = (_rotl(h, 27) * _P1 + _P4) & _M
        i += 8
    if i + 4 <= n:
        (k,) = struct.unpack_from("<I", data, i)
        h ^= (k * _P1) & _M
        h = (_rotl(h, 23) * _P2 + _P3) & _M
        i += 4
    while i < n:
        h ^= (data[i] * _P5) & _M
        h = (_rotl(h, 11) * _P1) & _M
        i += 1
    h ^= h >> 33
    h = (h * _P2) & _M
    h ^= h >> 29
    h = (h * _P3) & _M
    h ^= h >> 32
    return h


def xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 of data: the xxhash package when installed, else the pure-Python version."""
    if _xxhash is not None:
        return _xxhash.xxh64_intdigest(data, seed & _M)
    return xxh64_pure(data, seed)


def backend() -> str:
    return "xxhash" if _xxhash is not None else "pure-python"


def _check_page_size(page_size: int) -> None:
    if not 1 <= page_size <= 1 << 16:
        raise ValueError(f"pagehash: page size out of range: {page_size}")


def root(page_size: int, key: int = 0) -> int:
    """h_root: the previous hash of page 0."""
    _check_page_size(page_size)
    return xxh64(struct.pack("<Q", page_size), key)


def next_hash(prev: int, page: Sequence[int]) -> int:
    """One step of the chain: the hash of a page (up to page_size ids) after prev."""
    return xxh64(struct.pack(f"<{len(page)}I", *page), prev)


def append_chain(prev: int, ids: Sequence[int], page_size: int) -> List[int]:
    """Continue a chain whose last hash is prev over ids (starting at a page boundary):
    one hash per full page; a partial last page is left out."""
    _check_page_size(page_size)
    out = []
    ids = list(ids)
    for start in range(0, len(ids) - page_size + 1, page_size):
        prev = next_hash(prev, ids[start : start + page_size])
        out.append(prev)
    return out


def chain(ids: Sequence[int], page_size: int, key: int = 0) -> List[int]:
    """One hash per full page of ids."""
    return append_chain(root(page_size, key), ids, page_size)


def extend(prev: int, ids: Sequence[int], page_size: int) -> int:
    """Continue from prev over ids, the last page possibly partial; the final hash."""
    _check_page_size(page_size)
    ids = list(ids)
    for start in range(0, len(ids), page_size):
        prev = next_hash(prev, ids[start : start + page_size])
    return prev


def prefix_hash(ids: Sequence[int], n: int, page_size: int, key: int = 0) -> int:
    """The hash of exactly the first n ids."""
    if n < 0 or n > len(ids):
        raise ValueError(f"pagehash: prefix of {n} tokens out of {len(ids)}")
    return extend(root(page_size, key), list(ids)[:n], page_size)


def common_pages(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading pages two chains share (binary search, relying on the chaining)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


def is_prefix(prefix: Sequence[int], full: Sequence[int]) -> bool:
    """Whether chain prefix is a prefix of chain full (one comparison)."""
    if not prefix:
        return True
    k = len(prefix) - 1
    return k < len(full) and full[k] == prefix[k]
