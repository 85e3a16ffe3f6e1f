package sidecar

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests when a goroutine they started is still running at the end.
// lumberjack v2 starts one mill goroutine per rotating Logger that nothing can stop (Close only
// closes the file: natefinch/lumberjack#56, open since 2017); the event log's rotation tests make
// such Loggers on purpose.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("gopkg.in/natefinch/lumberjack%2ev2.(*Logger).millRun"))
}
