// Package rdma is kvcentric's transfer engine: every KV byte (P→D seeds, D→P snapshots,
// snapshot→D′ reseeds) moves through it. It follows Mooncake's transfer-engine model — register
// local memory, open a peer segment by name (a handshake exchanges registered regions), allocate
// a batch, submit READ/WRITE requests {source, target segment, target address, length}, poll or
// wait for per-task status, free the batch — so the Mooncake backend is a thin binding and
// sidecars never care which backend runs.
//
// Backends are chosen by name and never substituted silently: "tcp" (pure Go, parallel
// connections), "cuda" (same-node GPU↔GPU via CUDA IPC, libcuda loaded at run time) and
// "mooncake" (Mooncake's C API loaded from libtransfer_engine.so at run time).
//
// The layout helpers describe a KV pool as SGLang registers it (per-layer K and V buffers, page
// size, bytes per page per buffer) and turn page maps or token ranges into the fewest requests.
//
// Registered memory is addressed by its numeric address and must stay mapped and in place while
// registered: use mmap'ed memory (pkg/kvpool's Create, Map, Arena), CUDA allocations or C memory,
// never Go heap memory. The owner of a target range bounds-checks every request against its own
// registered regions before touching a byte. docs/transfer-engine.md describes the tcp wire format,
// the Mooncake binding and the benchmark.
//
// Files by concern. tcp: tcp.go (engine, options, Close), tcp_regions.go (registered memory and
// its references), tcp_serve.go (owner side: handshake, WRITE_BATCH and READ serving into place),
// tcp_dial.go (segments: dial, handshake, close), tcp_conn.go (one connection's sender, writer
// and reader loops), tcp_batch.go (batches: Submit, Status, Wait, Cancel); wire.go is its wire
// format. cuda: cuda.go (engine, options, Close), cuda_device.go (per-device context, stream,
// kernel, descriptor buffers, allocations), cuda_regions.go (RegisterMemory and the advertised
// regions), cuda_peers.go (control socket: serving and opening segments, region snapshots),
// cuda_submit.go (sinks, sharded Submit, launch), cuda_batch.go (batch state, Status, Wait,
// Cancel), cuda_wire.go, cuda_shm.go, cuda_plan.go and cuda_ready.go.
package rdma
