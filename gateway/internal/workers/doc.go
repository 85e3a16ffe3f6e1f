// Package workers holds the gateway's fail-open worker lists: prefill and decode workers served
// round robin when no control plane answers. The lists start from the command line and are
// refreshed from AdminService/ListWorkers whenever a control plane replica is reachable (the last
// good answer is kept while none is).
package workers
