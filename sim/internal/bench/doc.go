// Package bench replays a workload against a gateway URL: one goroutine per session sends its
// turns in order (SGLang /generate, streaming, X-Session-ID), honouring arrival times and think
// times scaled by the time scale, and records one Record per request (execution mode, reason,
// TTFT, latency, uncached tokens, snapshot use, bytes moved and verified, error kind). Failed
// requests are recorded and the replay goes on. Arms (E1/E3/E4) run a fresh local cluster each.
package bench
