// Package hatest holds the control plane's process-level HA tests: real kvc-controlplane
// processes on one etcd (embedded through pkg/etcdtest, 1 or 3 members, or an external etcd
// named by KVC_TEST_ETCD_ENDPOINTS for the kill -9 case), a sidecar client speaking
// SidecarService and a gateway client speaking RouterService over real sockets.
//
// Scenarios (reliability research §8; pass criteria in docs/operations.md "HA failure
// scenarios"):
//   - TestFailover: SIGKILL of the leader; takeover, persisted sessions readable, the sidecar
//     re-homes through the leader hint and resyncs (1- and 3-member etcd).
//   - TestLeaderPause: SIGSTOP of the leader for 3×TTL with calls queued in its sockets; no
//     command, acked write or decision of the old epoch after the takeover; it ends a standby.
//   - TestLeaderCutOffFromEtcd: the leader's etcd link black-holed (pkg/netproxy); it demotes
//     itself within its renew deadline (< TTL); the standby leads, the sidecar re-homes; after
//     Heal the old leader is a standby.
//   - TestEtcdLeaderKilled: the etcd raft leader of 3 killed; at most one control-plane
//     failover, writes resume, sessions intact (measures the write stall).
//   - TestEtcdQuorumLoss: 2 of 3 etcd members stopped for 3×TTL; nobody leads and nothing is
//     acked meanwhile, no epoch claimed twice, one leader with sessions intact after restart.
//   - TestHalfOpenSidecarStream: a sidecar's link black-holed; server keepalive cuts it, the
//     worker is unroutable, and the sidecar resyncs after Heal.
//   - TestAgentRehomesFromCutOffLeader, TestAgentHalfOpen: scenarios 4 and 9 with the real
//     sidecar control-plane loop (pkg/sidecar) instead of the test's own stream client.
//
// The binary comes from $KVC_BIN_DIR/kvc-controlplane, or is built into a temporary
// directory when KVC_BIN_DIR is unset. Metrics are read from each process's /metrics.
package hatest
