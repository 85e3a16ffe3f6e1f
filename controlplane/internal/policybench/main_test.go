package policybench

import (
	"context"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/obs"
)

// TestMain installs the tracer provider kvc-controlplane runs with when it exports no traces
// (obs.SetupTracing without an endpoint), so the decisions' spans cost what they cost there,
// and fails the package's tests when a goroutine they started is still running at the end
// (with time for the stopped etcd members' connections to close).
func TestMain(m *testing.M) {
	if _, err := obs.SetupTracing(context.Background(), obs.Tracing{Service: "kvc-controlplane"}); err != nil {
		panic(err)
	}
	etcdtest.VerifyTestMain(m, nil)
}
