package etcdtest

import "testing"

// TestMain fails the package's tests when a goroutine they started is still running at the end.
func TestMain(m *testing.M) { VerifyTestMain(m, nil) }
