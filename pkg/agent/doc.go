// Package agent is the runtime shared by the per-GPU sidecars (kvc-sidecar-decode and
// kvc-sidecar-prefill): the control-plane connection loop (leader following, hello, full
// residency resync, load heartbeats, at-most-once epoch-fenced command dispatch with acks), the
// WorkerBridge Unix socket, the mapping of a worker's KV pool from RegisterKVPool, the transfer
// plans that turn page maps and token ranges into engine requests, synchronous transfers over an
// rdma.Engine, the peer (TransferPeerService) client cache, the JSON-lines event log with its
// Prometheus metrics, and the flags every sidecar shares.
package agent
