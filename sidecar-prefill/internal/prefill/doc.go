// Package prefill is kvc-sidecar-prefill's core: the WorkerBridge of the prefill worker
// (RegisterKVPool, SendKV for seed transfers, SnapshotStatus), the TransferPeerService that decode
// sidecars call (OfferReceive, ReserveSnapshot, CommitSnapshot, AbortSnapshot), the
// PrefillSnapshotStore's memory and ingest, reseed via snapshot (PushSnapshotCommand + the decode
// side's offer → the store's pages are written into D′'s pages) and the snapshot HTTP API.
package prefill
