package etcdtest

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// LeakGrace is how long FindLeaks lets the goroutines of stopped etcd members end: a member's
// peer connections close only when etcd's 5 s peer read timeout runs out (its timeoutConn
// re-arms the read deadline net/http sets to abort a pending read), so for a few seconds after
// a cluster of several members stops, a client and a server goroutine per connection remain.
const LeakGrace = 15 * time.Second

// FindLeaks is goleak.Find retried for up to LeakGrace: nil once no unexpected goroutine is
// left, else goleak's error naming those still running at the deadline.
func FindLeaks(opts ...goleak.Option) error {
	deadline := time.Now().Add(LeakGrace)
	for {
		err := goleak.Find(opts...) // itself retries for about a second before it reports
		if err == nil || time.Now().After(deadline) {
			return err
		}
	}
}

// VerifyTestMain is goleak.VerifyTestMain for a package whose tests run etcd: it runs the
// tests, fails them (exit 1) when FindLeaks reports a goroutine still running, then calls
// cleanup (when not nil) and exits.
func VerifyTestMain(m *testing.M, cleanup func(), opts ...goleak.Option) {
	code := m.Run()
	if code == 0 {
		if err := FindLeaks(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: errors on successful test run: %v\n", err)
			code = 1
		}
	}
	if cleanup != nil {
		cleanup()
	}
	os.Exit(code)
}

// IgnoreKilledMembers is the goleak option for a package whose tests kill etcd members
// (Member.Kill: raft halts at once, the backend is left as it was): a request that
// etcd's own HTTP server was answering at that moment (its /version handler reading the storage
// version) stays blocked on the killed member's backend lock for the rest of the process. It is
// etcd's goroutine, not the tests', and killing members is what such tests are for.
func IgnoreKilledMembers() goleak.Option {
	return goleak.IgnoreAnyFunction("go.etcd.io/etcd/server/v3/etcdserver/api/etcdhttp.versionHandler.func1")
}
