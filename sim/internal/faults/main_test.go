package faults

import (
	"testing"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
)

// TestMain fails the package's tests when a goroutine they started is still running at the end
// (after the grace stopped etcd members need; the etcd-restart and etcd-quorum-loss scenarios
// kill members, whose in-flight /version answers etcd leaves blocked: IgnoreKilledMembers).
func TestMain(m *testing.M) { etcdtest.VerifyTestMain(m, nil, etcdtest.IgnoreKilledMembers()) }
