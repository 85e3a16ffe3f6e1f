package server

import (
	"testing"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
)

// TestMain fails the package's tests when a goroutine they started is still running at the end
// (with time for the stopped etcd members' connections to close).
func TestMain(m *testing.M) { etcdtest.VerifyTestMain(m, nil) }
