// Package server is kvc-gateway's HTTP front door: it parses client requests (package api), asks
// the control plane for a decision over the Route stream (package routeclient) or fails open to
// plain P/D round robin (package workers), carries the decision out against SGLang-compatible
// workers the way SGLang's P/D router does (bootstrap host/port/room to P and D together), streams
// tokens back measuring TTFT at the gateway, and reports each outcome.
package server
