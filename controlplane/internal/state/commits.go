package state

// kv_committed_len has one writer: the decode sidecar's commit (COMMITTED, and a resync's
// report of what it holds). The router's outcome makes a session resident on a decode worker
// but never says how much it committed; a seed's COMMITTED may reach the control plane before
// that outcome, while the record still names the decode worker the session is leaving (or
// none), and is not the record's yet. The state keeps the latest such commit per session
// (commitsAway) and gives it to the record when an update makes that worker the session's
// decode worker (UpdateSession): until then, or without one, the new residency's committed
// length is 0, and its worker's next COMMITTED sets it.

// maxCommitsAway bounds commitsAway; past it one arbitrary entry makes room (its session's
// length then waits for its worker's next commit).
const maxCommitsAway = 1 << 16

// commitAway is a decode worker's commit of a session the record does not name it for.
type commitAway struct {
	worker string
	kvLen  int64
	gen    uint64
}

// dropCommitAwayLocked forgets session id's commit away: its record's decode worker committed.
func (s *State) dropCommitAwayLocked(id string) {
	if _, ok := s.commitsAway[id]; ok {
		delete(s.commitsAway, id)
		s.m.commitsAway.WithLabelValues("superseded").Inc()
	}
}

// noteCommitAwayLocked remembers w's commit of session id (kvLen tokens, generation gen).
func (s *State) noteCommitAwayLocked(id, w string, kvLen int64, gen uint64) {
	if _, ok := s.commitsAway[id]; !ok && len(s.commitsAway) >= maxCommitsAway {
		for k := range s.commitsAway {
			delete(s.commitsAway, k)
			s.m.commitsAway.WithLabelValues("evicted").Inc()
			break
		}
	}
	s.commitsAway[id] = commitAway{worker: w, kvLen: kvLen, gen: gen}
	s.m.commitsAway.WithLabelValues("kept").Inc()
}

// committedOnLocked is the committed length of session id on decode worker w, which an update
// just made its decode worker in generation gen: w's latest commit seen, unless that was of
// another generation (0: unknown, as a seed's first commit is, before its target names one).
func (s *State) committedOnLocked(id, w string, gen uint64) int64 {
	c, ok := s.commitsAway[id]
	if !ok {
		return 0
	}
	delete(s.commitsAway, id)
	if c.worker != w || (c.gen != 0 && c.gen != gen) {
		s.m.commitsAway.WithLabelValues("superseded").Inc()
		return 0
	}
	s.m.commitsAway.WithLabelValues("taken").Inc()
	return c.kvLen
}
