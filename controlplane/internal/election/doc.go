// Package election runs the control plane's leader election on etcd (concurrency.Session +
// Election) and observes who leads.
//
// # Overview
//
// Run loops: create a session with the election TTL, campaign under a context that ends with
// the session, confirm after winning (a Txn checking that our key still has the create
// revision we won with), then call the lead function with a context that is cancelled when the
// session is lost, when StepDown is called, or when Run's context ends. After lead returns,
// the replica resigns (so a standby takes over at once) and campaigns again.
//
// The leader's value is JSON {"node_id", "addr"}; its key's create revision is the epoch and,
// with the key, the fence for every write (pkg/kvstore).
//
// # Concurrency Model
//
// Run and Observe each run in their own goroutine; Current and IsLeader are lock-free reads.
package election
