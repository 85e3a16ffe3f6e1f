package state

import (
	"fmt"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
)

// Generation claims. A sidecar's report carries KV generations: a decode worker's resync and
// commits say which generation of a session it holds, a prefill worker's resync and ingests
// which generation a snapshot is. The record follows a newer generation, so an unchecked claim
// could make any sidecar win any session (issue 23 item 2): a claim of 2^60 put every later
// generation past the 2^53 the docs promise, 2^64-1 wrapped the durable generation term, and a
// sidecar of one worker made another release its real copy. Every generation a report carries
// is therefore checked, before anything of the report is applied, against what this leader
// issued:
//
//   - no claim may be above claimBound: every generation of an earlier term (below this term's
//     first, term << GenerationTermBits: an earlier leader may have issued it and etcd lost it),
//     and this term's up to the highest one issued (IssueGeneration);
//   - a decode worker's claim of a generation of this term is refused on a session this leader
//     never gave it: this leader makes every such generation together with the worker it names
//     (router outcome), and never lowers a session's generation, so an honest claim is of the
//     worker the record names or of no newer generation than the record's (a stale copy,
//     released as before).
//
// A claim of an earlier term's generation cannot be checked further: this leader cannot know
// what a predecessor gave out and etcd lost (that is what the stale-copy rule is for).
// Generation 0 (unknown: a restarted sidecar) is never refused.

// Reasons of a refused claim (ClaimError.Reason, the metric's label).
const (
	claimAboveIssued = "above_issued"
	claimNotGiven    = "not_given"
)

// ClaimError is a sidecar report refused for a generation the control plane never issued.
type ClaimError struct {
	Reason     string // "above_issued" or "not_given"
	Worker     string
	Session    string
	Generation uint64
	Bound      uint64 // above_issued: the highest generation a claim may carry now
}

func (e *ClaimError) Error() string {
	if e.Reason == claimAboveIssued {
		return fmt.Sprintf("worker %s claims session %s at generation %d, above the highest generation issued (%d)",
			e.Worker, e.Session, e.Generation, e.Bound)
	}
	return fmt.Sprintf("worker %s claims session %s at generation %d of this leader's term, which it was never given",
		e.Worker, e.Session, e.Generation)
}

// AboveIssued reports whether the claim was above the highest generation issued (else it was
// of a session the worker was never given).
func (e *ClaimError) AboveIssued() bool { return e.Reason == claimAboveIssued }

// IssueGeneration records g as issued in this term: a decision that names the generation its
// outcome will make before it is made (a seed through the prefill store, whose snapshot may be
// reported first). UpdateSession records the generations the router sets.
func (s *State) IssueGeneration(g uint64) {
	for {
		cur := s.issued.Load()
		if g <= cur || s.issued.CompareAndSwap(cur, g) {
			return
		}
	}
}

// claimBound is the highest generation a report may carry now (package comment above).
func (s *State) claimBound() uint64 {
	b := s.issued.Load()
	if first := s.genTerm.Load() << policy.GenerationTermBits; first > 0 {
		b = max(b, first-1)
	}
	return min(b, policy.MaxGeneration)
}

// checkClaimLocked checks worker w's claim of session id at generation g (0: never refused);
// residency is set for a decode worker's claim (its resync or commit), which is also checked
// against the workers the session was given to.
func (s *State) checkClaimLocked(w, id string, g uint64, residency bool) error {
	term := s.genTerm.Load()
	if g == 0 || term == 0 {
		return nil // term 0: generations counted g+1, no ranges (policy.NextGeneration)
	}
	if b := s.claimBound(); g > b {
		return s.refuseClaimLocked(&ClaimError{Reason: claimAboveIssued, Worker: w, Session: id, Generation: g, Bound: b})
	}
	if !residency || g < term<<policy.GenerationTermBits {
		return nil
	}
	if e, ok := s.sessions[id]; ok && (e.rec.GetDecodeWorker() == w || g <= e.rec.GetGeneration()) {
		return nil
	}
	return s.refuseClaimLocked(&ClaimError{Reason: claimNotGiven, Worker: w, Session: id, Generation: g})
}

func (s *State) refuseClaimLocked(e *ClaimError) error {
	s.m.claimsRefused.WithLabelValues(e.Reason).Inc()
	s.log.Error().Str("worker", e.Worker).Str("session", e.Session).Uint64("generation", e.Generation).
		Uint64("bound", e.Bound).Str("reason", e.Reason).Msg("sidecar report refused: " + e.Error())
	return e
}
