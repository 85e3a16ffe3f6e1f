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
// # Renew deadline
//
// Besides the session's own keepalive, a renew loop sends a lease keepalive every
// RenewInterval and records the send time of each one etcd answered. The replica may act as
// leader only until that send time plus RenewDeadline (< TTL) on its monotonic clock: etcd
// cannot have expired the lease before then, since the renewal reached it no earlier than it
// was sent. IsLeader checks the deadline on every call (so a process resumed after SIGSTOP or
// a long stall answers false before any of its goroutines runs), and a watchdog timer ends
// the term at the deadline (reason renew_deadline). A leader cut off from etcd therefore
// steps down on its own clock at most RenewDeadline after its last renewal, before the server
// expires it and a standby takes over.
//
// # Without etcd
//
// Observe re-reads the election key every TTL/2 besides its watch; Current names another
// replica only while such a read succeeded within the last TTL (a leader that cannot reach
// etcd has stepped down by then). A campaign cancelled by the stop is abandoned after one
// second: etcd's Campaign cleans up with the client's own, unbounded, context, which kept a
// standby alive after SIGTERM while etcd was unreachable.
//
// The leader's value is JSON {"node_id", "addr"}; its key's create revision is the epoch and,
// with the key, the fence for every write (pkg/kvstore).
//
// # Concurrency Model
//
// Run and Observe each run in their own goroutine; Current and IsLeader are lock-free reads.
package election
