package server

import "testing"

// TestMemoryReturnAfterLargeRequests (issue 23 item 3): a request of LargeRequestBytes or more
// gives the heap back to the OS when it ends; small ones do not, and requests ending together
// share one forced collection.
func TestMemoryReturnAfterLargeRequests(t *testing.T) {
	calls := make(chan struct{}, 4)
	m := &memReturner{free: func() { calls <- struct{}{} }}
	m.after(LargeRequestBytes - 1)
	m.after(LargeRequestBytes)
	<-calls
	m.mu.Lock()
	for m.pending { // the call returned; wait for its bookkeeping
		m.mu.Unlock()
		m.mu.Lock()
	}
	m.mu.Unlock()
	if len(calls) != 0 {
		t.Fatalf("%d more collections", len(calls))
	}
	if m.last.IsZero() {
		t.Fatal("no collection recorded")
	}
}

func TestMemoryLimit(t *testing.T) {
	got := MemoryLimit(AdmissionLimits{MaxInflightBodyBytes: 64 << 20}, TokenizeLimits{MaxInflightBytes: 8 << 20})
	if want := int64(128<<20 + 256<<20 + 512<<20); got != want {
		t.Fatalf("MemoryLimit = %d, want %d", got, want)
	}
}
