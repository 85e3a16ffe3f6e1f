package server

import (
	"runtime/debug"
	"sync"
	"time"
)

// LargeRequestBytes: a request whose body reached this size gives its memory
// back to the OS when it ends (at most once per returnEvery, in the background): the Go
// runtime would otherwise keep the heap it grew for a flood of large bodies until a later
// collection, and the gateway's RSS would stay at its peak (issue 23 item 3).
const LargeRequestBytes = 1 << 20

const returnEvery = 2 * time.Second

// memReturner runs debug.FreeOSMemory after large requests, rate-limited.
type memReturner struct {
	mu      sync.Mutex
	last    time.Time
	pending bool
	free    func() // debug.FreeOSMemory; tests count calls
}

var memReturn = &memReturner{free: debug.FreeOSMemory}

// after is called when a request of n bytes ends.
func (m *memReturner) after(n int64) {
	if n < LargeRequestBytes {
		return
	}
	m.mu.Lock()
	if m.pending {
		m.mu.Unlock()
		return
	}
	m.pending = true
	wait := returnEvery - time.Since(m.last)
	m.mu.Unlock()
	go func() {
		if wait > 0 {
			time.Sleep(wait) // rate limit: at most one forced collection per returnEvery
		}
		m.free()
		m.mu.Lock()
		m.last, m.pending = time.Now(), false
		m.mu.Unlock()
	}()
}

// MemoryLimit is the soft memory limit the gateway sets for the Go runtime (debug.SetMemoryLimit)
// from its admission bounds, unless GOMEMLIMIT is set: 128 MiB of base plus four times the
// request bodies in flight (a body, its parsed strings, the worker call's and the collector's
// slack) plus 64 bytes per byte being tokenized. The runtime collects harder near it, so a
// flood of large bodies does not double the heap in garbage.
func MemoryLimit(lim AdmissionLimits, tok TokenizeLimits) int64 {
	return 128<<20 + 4*lim.MaxInflightBodyBytes + 64*tok.MaxInflightBytes
}
