"""WorkerBridge client for SGLang workers running next to a kvcentric sidecar.

The sidecar (kvc-sidecar-decode / kvc-sidecar-prefill) serves kvc.v1.WorkerBridgeService on a
Unix socket. This package calls it with grpcio's generic API and a small protobuf wire codec for
the handful of messages involved, so it needs nothing but grpcio.
"""

from .bridge import (
    KV_KIND_K,
    KV_KIND_V,
    RELEASE_EVICTED,
    RELEASE_RELEASED,
    TRANSFER_SEED,
    TRANSFER_SNAPSHOT,
    BridgeError,
    KVBuffer,
    SnapshotStatus,
    TransferResult,
    WorkerBridge,
)

__all__ = [
    "BridgeError",
    "KVBuffer",
    "SnapshotStatus",
    "TransferResult",
    "WorkerBridge",
    "KV_KIND_K",
    "KV_KIND_V",
    "RELEASE_RELEASED",
    "RELEASE_EVICTED",
    "TRANSFER_SEED",
    "TRANSFER_SNAPSHOT",
]
