// Package hatest holds the control plane's process-level HA tests: two kvc-controlplane
// processes on one etcd (embedded through pkg/etcdtest, 1 or 3 members, or an external etcd
// named by KVC_TEST_ETCD_ENDPOINTS), one leader, SIGKILL of the leader, takeover by the
// standby, sessions persisted before the kill readable from the new leader, and a sidecar
// stream re-homing through the leader hint and resyncing.
//
// The binary comes from $KVC_BIN_DIR/kvc-controlplane, or is built into a temporary
// directory when KVC_BIN_DIR is unset.
package hatest
