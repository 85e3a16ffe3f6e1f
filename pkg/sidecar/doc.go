// Package sidecar is the runtime shared by the per-GPU sidecars (kvc-sidecar-decode and
// kvc-sidecar-prefill): start-up and serving (Start, Serve), the control-plane connection loop
// (leader following, hello, full residency resync, load heartbeats, at-most-once epoch-fenced
// command dispatch with acks), the WorkerBridge attach and its Unix socket, worker health, the
// JSON-lines event log with its Prometheus metrics, command traces and the flags every sidecar
// shares. Moving KV bytes is package kvxfer's.
package sidecar
