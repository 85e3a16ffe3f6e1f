package decode

import (
	"fmt"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// hints are a session's agent hints (SetSessionHintsCommand): the capacity release never picks
// it before untilMs, and picks a low-priority session before any other (release.go). They are
// the session's, apart from its snapshot target: a new target (a drain's, a resync's) leaves
// them as they are.
type hints struct {
	untilMs int64
	low     bool
}

// setHints carries out a SetSessionHintsCommand.
func (s *Sidecar) setHints(c *kvcv1.SetSessionHintsCommand) error {
	if err := kvcv1.ValidateID("session_id", c.GetSessionId()); err != nil {
		return err
	}
	if c.GetPinnedUntilUnixMs() < 0 {
		return fmt.Errorf("set_session_hints for %s: pinned_until_unix_ms %d is negative", c.GetSessionId(), c.GetPinnedUntilUnixMs())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.setHintsLocked(c.GetSessionId(), hints{untilMs: c.GetPinnedUntilUnixMs(), low: c.GetLowPriority()})
}

// setHintsLocked sets session id's hints; those of a session not committed yet wait for its
// first commit (as a target does).
func (s *Sidecar) setHintsLocked(id string, h hints) error {
	if ss, ok := s.sessions[id]; ok {
		ss.hints = h
		return nil
	}
	if _, ok := s.hints[id]; !ok && len(s.hints) >= maxPendingTargets {
		return fmt.Errorf("too many hints for sessions not committed yet")
	}
	s.hints[id] = h
	return nil
}
