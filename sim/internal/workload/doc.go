// Package workload describes what kvc-bench replays — sessions of turns with arrival times and
// think times — and generates the built-in agentic workload: multi-turn sessions with small
// appends on long, growing contexts and think times, shaped after the measured agent trace of
// DESIGN §1 (most turns append a few hundred tokens to a context of tens of thousands).
package workload
