// Package pagehash gives KV pages content addresses: a chained 64-bit hash per page of token
// ids, identical in Go (here) and Python (integrations/sglang/kvcentric_sglang/pagehash.py).
//
// Definition (version 1). For a page size P ≥ 1, a key K (a uint64 cluster secret, 0 when
// none is configured) and token ids t_0 … t_{n-1} (each a uint32):
//
//	h_root = XXH64(LE64(P), seed = K)
//	h_i    = XXH64(LE32(t_{iP}) ‖ LE32(t_{iP+1}) ‖ … ‖ LE32(t_{iP+P-1}), seed = h_{i-1})   (h_{-1} = h_root)
//
// XXH64 is xxHash64 (github.com/cespare/xxhash/v2; Python's `xxhash.xxh64_intdigest`), LE32 and
// LE64 little-endian encodings, ‖ concatenation. Chain returns h_0 … h_{⌊n/P⌋-1}: one hash per
// full page. PrefixHash(ids, n) hashes the first n tokens with the same recurrence, the last
// page being partial (fewer than P ids) when P does not divide n; for n a multiple of P it is
// the chain's entry ⌊n/P⌋-1, and for n = 0 it is h_root.
//
// Because every h_i commits to all tokens before it, two chains agree at page i exactly when
// the first i+1 pages agree (up to a 2^-64 collision chance), so the longest common prefix of
// two chains is found by binary search (CommonPages), and "is the resident KV a prefix of this
// prompt" is one comparison: the prompt's hash at the session's length against the session's
// last hash. Compact keeps only the hashes that make such a search possible for a session:
// see Sparse for the trade-off.
//
// The hash is not cryptographic. With K = 0 anyone can compute addresses; with a secret K a
// client cannot predict them, which matters once pages are shared across sessions (content
// placement): a crafted collision would otherwise let a prompt reuse another tenant's KV.
package pagehash
