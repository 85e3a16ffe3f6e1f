// Package router implements kvc.v1.RouterService: the Route stream on which gateways ask for
// routing decisions and report outcomes.
//
// # Overview
//
// A query is validated, the policy (package policy) decides under the reservation lock, the
// reservation is recorded in the ledger, and the decision's effects go to the Cluster (session
// turn and last-seen, a PushSnapshotCommand to the prefill sidecar for RESEED_SNAPSHOT). An
// outcome releases its reservation and carries out the effects the policy gives it
// (policy.OutcomeEffect, Effect.Edit, policy.ResidentCommands): residency, rejection counters,
// the snapshot target, the release of a copy left behind, the agent hints (outcome.go).
// Reservations without an outcome expire after reservation_timeout_ms (Run).
//
// # Concurrency Model
//
// One mutex guards the ledger (per-worker reserved tokens, in-flight transfers, seeds and
// prefills; pending decisions; sessions with a transfer in flight). The policy runs while it
// is held, so two concurrent decisions can never both take a decode worker's last tokens or
// last transfer slot. Cluster calls are made outside the lock (a decision takes it inside
// Cluster.UpdateSession's callback). Each Route stream is served by one loop (a goroutine
// receives, the loop handles and sends), so its answers are in request order, except a turn of
// a session being re-homed, which waits off the loop and is answered once the re-home ends
// (rehome.go).
package router
