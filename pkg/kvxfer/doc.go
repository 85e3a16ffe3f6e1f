// Package kvxfer moves KV bytes between paged pools: a worker's pool mapped from
// RegisterKVPool (shared memory or CUDA IPC) or an arena, the page maps and token plans that
// turn token ranges into rdma requests, transfers over an rdma.Engine, the segment and peer
// (TransferPeerService) client caches, the tensor-parallel checks between peers and the typed
// peer errors.
package kvxfer
