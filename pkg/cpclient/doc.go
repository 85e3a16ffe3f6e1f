// Package cpclient holds what every client of the control plane shares: the leader hint that a
// standby attaches to UNAVAILABLE errors, an endpoint list that follows the leader, and the
// transport credentials (DialCredentials: mutual TLS requiring a controlplane certificate).
package cpclient
