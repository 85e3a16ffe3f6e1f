// Package cpclient holds what every client of the control plane shares: the leader hint that a
// standby attaches to UNAVAILABLE errors, an endpoint list that follows the leader, the one
// leader-following loop (Follow) the sidecars and the gateway run their streams under, the
// liveness watch of a stream's connection, and the transport credentials (DialCredentials:
// mutual TLS requiring a controlplane certificate).
package cpclient
