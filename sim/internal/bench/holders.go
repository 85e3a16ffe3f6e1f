package bench

import "sync"

// KillMost is the --kill-decode value that takes, at the kill time, the decode worker holding
// the most sessions (Holders) instead of a fixed one.
const KillMost = "most"

// Holders tracks where each session lives as the client sees it: the decode worker of its latest
// request the gateway routed (X-KVC-Decode-Worker of a 200 answer, set when the headers arrive,
// so a request in flight counts). That worker holds the session's KV (SGL's radix copy, LLMD's
// host tier, kvcentric's residency) or its request, and its death touches the session: the
// report's affected sessions. The same rule in every arm, so a kill of the worker holding the
// most sessions is a kill of the same weight whatever an arm keeps where. Safe for concurrent
// use; the zero value is not: use NewHolders.
type Holders struct {
	mu sync.Mutex
	at map[string]string // session → decode worker
}

// NewHolders returns an empty tracker.
func NewHolders() *Holders { return &Holders{at: map[string]string{}} }

// Set records that session's latest routed request went to worker ("" is ignored).
func (h *Holders) Set(session, worker string) {
	if h == nil || worker == "" {
		return
	}
	h.mu.Lock()
	h.at[session] = worker
	h.mu.Unlock()
}

// Count is the number of sessions worker holds now.
func (h *Holders) Count(worker string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, w := range h.at {
		if w == worker {
			n++
		}
	}
	return n
}

// Most returns the worker among candidates that holds the most sessions, and how many. A tie
// goes to the candidate with more resident sessions in its pool (resident; absent: 0), then to
// the earlier one in candidates; "" when there are no candidates.
func (h *Holders) Most(candidates []string, resident map[string]int) (string, int) {
	h.mu.Lock()
	count := map[string]int{}
	for _, w := range h.at {
		count[w]++
	}
	h.mu.Unlock()
	best, bestN := "", -1
	for _, c := range candidates {
		n := count[c]
		if n > bestN || (n == bestN && resident[c] > resident[best]) {
			best, bestN = c, n
		}
	}
	return best, max(bestN, 0)
}
