// Package state holds the control plane leader's in-memory tables: workers (with their live
// load and sidecar streams), session records and the policy. It implements the router's
// Cluster interface (docs/interfaces.md) and persists every change through pkg/kvstore's
// fenced write-behind batcher.
//
// # Overview
//
// A replica that wins the election calls Lead: it loads every record from etcd at one
// revision, marks every loaded worker UNREACHABLE (no stream on this leader yet; its
// residency is dropped after the unreachable grace unless it reconnects and resyncs), starts
// the batcher and the idle-session sweeper, and only then returns. When leadership ends, the
// Term is stopped: the batcher flushes what is pending (while the fence still holds), and the
// tables are cleared; a standby keeps nothing in memory except the watched policy.
//
// The tables are a cache of the truth held by the sidecars: a decode sidecar's full sync
// decides which sessions are resident on its worker; a prefill sidecar's decides which
// snapshots it holds.
//
// # Concurrency Model
//
// One mutex guards sessions, workers and the residency indexes. Workers() is lock-free: an
// immutable slice of immutable Worker messages is swapped (atomic.Pointer) on every change.
// Policy() is lock-free the same way. Session() returns a clone. Commands are queued on a
// stream's bounded channel and sent by that stream's own send loop.
package state
