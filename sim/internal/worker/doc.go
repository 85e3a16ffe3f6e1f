// Package worker is kvc-sim's simulated SGLang worker (prefill or decode): a real paged KV pool in
// shared memory registered with its real sidecar over the WorkerBridge (Unix-socket gRPC), the
// subset of SGLang's worker HTTP API the gateway uses (POST /generate, streaming or not), streaming
// sessions with a page allocator, capacity rejection and LRU eviction, and a timing model.
//
// What is real: every KV byte. The worker writes the known-bytes pattern of pkg/kvpool into its
// pages whenever it "computes" KV (prefill, append, decode), the sidecars move those bytes, and
// the receiving worker checks every received token with kvpool.CheckToken; a mismatch fails the
// request with kv_verify_failed. What is modeled: time (prefill throughput, decode time per
// token, transfer time of the model's real bytes per token over the configured link), applied as
// sleeps scaled by Timing.Scale. See docs/simulator.md.
package worker
