// Package app wires kvc-gateway together: logger, metrics, the Route stream client, the
// fail-open worker pool and its refresher, and the HTTP server (client APIs plus /metrics,
// /healthz, /readyz on the same address), then runs them until the context ends.
package app
