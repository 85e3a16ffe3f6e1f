// Package kvstore is the etcd-backed store of the control plane: workers, sessions and the
// routing policy, as protobuf values under a configurable prefix (default /kvc/v1/).
//
// # Keyspace
//
//	<prefix>leader//<lease>  election keys (concurrency.Election adds a "/" to ElectionPrefix)
//	<prefix>workers/<id>     kvc.v1.Worker
//	<prefix>sessions/<id>    kvc.v1.SessionRecord
//	<prefix>volatile/<seq>   kvc.v1.VolatileBatch: the leader's volatile journal (seq: 16 hex digits);
//	                         LoadAll returns it, applying it over the sessions is the reader's job
//	<prefix>policy           kvc.v1.Policy (the operator's overrides; defaults are filled by readers)
//	<prefix>generation-term  the generation term, decimal: advanced by every new leader before it
//	                         serves (NextGenerationTerm); KV generations are numbered in its range
//
// # Fencing
//
// Every write by the leader goes through a Fence: one Txn guarded by
// CreateRevision(leaderKey) == leaderRev, so once a leader has been deposed (its election key
// deleted or replaced), its writes fail atomically with ErrFenced. Session records are plain
// keys, never bound to the leader's lease, so they survive lease loss.
//
// # Write-behind
//
// A Batcher coalesces writes per key (the latest value wins) and flushes within a bounded delay
// (MaxDelay, default 50 ms) in Txns of at most MaxOps (128) operations and MaxBytes (1.5 MiB,
// etcd's default request limit, including a margin for the Txn's own encoding).
//
// # Bounds
//
// Every single etcd call (a Get, a page of a scan, a Txn) is bounded by the call timeout
// (WithCallTimeout, default 2 s) even when the caller's context has no deadline; a call ended
// by that bound returns an error wrapping ErrUnavailable. Apply refuses a Txn over
// DefaultMaxBytes before sending it (ErrTooLarge); etcd's own "request is too large" and
// "database space exceeded" (quota) come back wrapped in ErrTooLarge and ErrNoSpace: permanent
// errors, not retryable ones.
//
// # Concurrency Model
//
// Store is stateless apart from its client and safe for concurrent use. A Batcher accepts
// writes from any goroutine; one goroutine (Run) sends Txns, one at a time, in the order the
// flushes were cut.
package kvstore
