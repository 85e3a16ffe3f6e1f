"""kvc-refworker: a reference inference worker for kvcentric.

A real causal LM (transformers' Qwen3, weights from a fixed seed), a paged KV pool with SGLang's
geometry (SGLang's own MHATokenToKVPool when importable), the kvc-sim/SGLang worker HTTP
contract, and the WorkerBridge to its kvcentric sidecar: real attention KV moves P->D, D->P and
snapshot->D' through the real sidecars, and every request can be recomputed from scratch and
compared (--verify-recompute)."""

__version__ = "0.1.0"
