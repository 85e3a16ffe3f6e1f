// Package seede2e runs the real kvc-sidecar-prefill and kvc-sidecar-decode binaries to test the
// SEED of a colocated decode worker through the prefill store (SendKV with to_store): the
// prefill worker's pool → the prefill sidecar's own store → the decode worker's pool, as the
// SGLang plugin's KvcLinker loads it (docs/sglang.md).
package seede2e
