// Package policy is kvcentric's routing policy: a pure, deterministic function from (request,
// session record, worker states, reservations, knobs) to one routing decision.
//
// # Overview
//
// Decide classifies the request (kv-centric disabled, resident on a usable D, lost residency,
// new session) and runs the matching profile. A profile is data, not an if-chain:
//
//   - Gates ([]Gate): named yes/no checks on the request and session (seed filters, pending
//     transfer). The first gate that blocks turns the decision into PD_FALLBACK with the gate's
//     reason.
//   - Filters ([]Filter): named predicates over decode candidates (routable, capacity after
//     reservations, per-D transfer budget, seed in-flight limit, not a recent rejecter). When
//     the candidate set empties, the reason is that of the deepest filter any candidate reached.
//   - Scorers ([]Scorer): weighted scores in [0, 1] (headroom after reservations, queue depth);
//     the highest total wins, ties go to the smallest worker id, so the result is deterministic.
//
// Adding a rule is one small named value appended to a profile's slice (see rules.go).
//
// # Outcomes and commands
//
// The rules after a decision are here too, as pure functions the router and the state carry
// out: what an outcome does to the session record and which commands follow (outcome.go:
// OutcomeEffect, Effect.Edit, ResidentCommands), and the one builder of the snapshot-target and
// agent-hints commands (target.go: TargetCommand, HintsCommand) for outcomes, drains and
// resyncs.
//
// # Knobs
//
// Every knob of the policy record (kvcv1.Policy) has a default (Defaults), a merge rule for
// partial updates (Merge) and a range check (Validate). Compile turns a validated record into
// the Knobs that Decide reads, so the hot path never touches optional proto fields.
//
// # Concurrency Model
//
// Decide itself is pure and safe for concurrent use. The caller (the router) must hold its
// reservation lock across Decide and the reservation it records, so that concurrent decisions
// cannot over-admit a decode worker.
package policy
