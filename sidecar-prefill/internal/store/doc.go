// Package store is the PrefillSnapshotStore's bookkeeping: a paged pool of N store pages (the
// memory itself is the sidecar's arena), snapshot entries {session, generation, seqlen, pages,
// source D, updated}, two-phase ingest (Reserve → the D sidecar writes → Commit advances seqlen;
// Abort frees), LRU eviction by bytes and pinning of entries that a reseed is reading.
package store
