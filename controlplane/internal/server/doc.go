// Package server implements the control plane's gRPC surface apart from routing:
// kvc.v1.AdminService (every replica; reads from memory on the leader, from etcd on a
// standby), kvc.v1.SidecarService (the leader's Connect streams) and the leader gate, an
// interceptor that answers leader-only calls on a standby with UNAVAILABLE plus a LeaderHint
// and cancels leader streams when leadership ends.
//
// # Concurrency Model
//
// Each Connect stream has one goroutine receiving (it only forwards messages), the handler
// goroutine applying them to the state, and one send loop draining the stream's command queue;
// only the handler (for the welcome) and then the send loop ever call Send.
package server
