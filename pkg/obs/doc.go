// Package obs holds the observability plumbing every binary shares: a zerolog logger set up from
// flags, and the HTTP server for /metrics (Prometheus), /healthz and /readyz.
package obs
