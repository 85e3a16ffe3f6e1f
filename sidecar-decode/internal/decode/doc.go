// Package decode is kvc-sidecar-decode's core: the WorkerBridge of the decode worker (pool
// registration, session commits and releases — the residency truth —, PrepareReceive /
// WaitReceive for seed and reseed transfers), the D-sender snapshot thread (per-session target,
// last pushed length, generation; delta-triggered, latest-wins queue, small worker pool,
// incremental pushes with retry and a full push on base mismatch, pinning against release), the
// TransferDone side of the peer service, the control-plane handler and, when the runtime judges
// the worker process dead (sidecar.WorkerHealth), the drop of every session it held.
package decode
