// Package router implements kvc.v1.RouterService: the Route stream on which gateways ask for
// routing decisions and report outcomes.
//
// # Overview
//
// A query is validated, the policy (package policy) decides under the reservation lock, the
// reservation is recorded in the ledger, and the decision's effects go to the Cluster (session
// turn and last-seen, a PushSnapshotCommand to the prefill sidecar for RESEED_SNAPSHOT). An
// outcome releases its reservation and updates residency, rejection counters and snapshot
// targets. Reservations without an outcome expire after reservation_timeout_ms (Run).
//
// # Concurrency Model
//
// One mutex guards the ledger (per-worker reserved tokens, in-flight transfers, seeds and
// prefills; pending decisions; sessions with a transfer in flight). The policy runs while it
// is held, so two concurrent decisions can never both take a decode worker's last tokens or
// last transfer slot. Cluster calls are made outside the lock. Each Route stream is served by
// one goroutine (Recv, handle, Send), so its answers are in request order.
package router
