// Package cpclient holds what every client of the control plane shares: the leader hint that a
// standby attaches to UNAVAILABLE errors, and an endpoint list that follows the leader.
package cpclient
