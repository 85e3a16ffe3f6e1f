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
// # Leadership
//
// LeadTerm takes the leadership's context (the election's Term, done when the term ends and
// at the renew deadline, checked on every Err call). It is the state's only leadership check
// (Term.acting): every mutation from outside (UpdateSession, SendCommand, Attach, Drain,
// ForgetWorker, UpdatePolicy) and Epoch/Leading read it, so a replica past its renew deadline
// refuses before EndTerm has run. The term's goroutines (idle sweeper, journal flusher, drain
// movers) derive from it; the write-behind batcher deliberately does not: EndTerm flushes what
// is pending while the fence still holds, then stops it.
//
// # Drain
//
// Drain(id, true) marks a worker draining (not routable for new sessions) and starts its
// mover (drain.go), a goroutine of the term: each session resident on the worker is released
// (ReleaseSession to its sidecar, residency cleared here, so its next turn reseeds on another
// decode worker) once its snapshot can reseed it, or Config.DrainSnapshotWait after the mover
// first saw it without one. Snapshot ingests, commits, resyncs and attaches wake the mover.
// DrainStatus reports progress; a new leader restarts the drain of every worker loaded with
// the draining flag. ForgetWorker removes a worker and its residency from memory and etcd.
//
// # Concurrency Model
//
// One mutex (State.mu, "the routing lock") guards sessions, workers, the residency indexes,
// the drains and the journal. Workers() is lock-free: an immutable slice of immutable Worker
// messages is swapped (atomic.Pointer) on every change. Policy(), Epoch() and Leading() are
// lock-free the same way. Session() returns a clone. Commands are queued on a stream's bounded
// channel and sent by that stream's own send loop. ListSessions never sorts under the lock:
// it cuts pages from a sorted snapshot of the session ids (copied under the lock, sorted
// outside it, reused by the continuing pages of a listing) and holds the lock to clone a page.
//
// # Lock order
//
// A goroutine holding a lock may take only locks further down this list, never one above:
//
//  1. State.policyMu (UpdatePolicy only; held across its etcd write, never inside State.mu)
//  2. State.mu, the routing lock
//  3. router.Service.mu, the reservation ledger: taken inside UpdateSession's fn, which
//     runs under State.mu (the router decides on the live record); router code must not call
//     State while holding it; router.contentStore.mu (the content index) is a leaf beside
//     it, taken alone or inside UpdateSession's fn, never with router.Service.mu held
//  4. Stream.mu (a stream's pending acks; sendLocked under State.mu, Ack alone)
//  5. kvstore.Batcher's mutex (writes queued under State.mu)
//
// server.Gate.mu and the election's state are never held while any of these is taken (the
// election is atomics only). No lock is held across an etcd call except policyMu, and no lock
// is held while blocking on a channel (command queues are non-blocking sends; the drain mover
// waits with State.mu released).
package state
