package router

import (
	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Agent hints (issue 13 item 5; policy/pin.go). A turn's pin (RouteQuery.pin_ms) is granted
// when its outcome leaves the session resident on its decode worker: from then on (after the
// answer: the agent's tool call) the session is pinned until pinned_until_unix_ms — policy does
// not migrate it after rejections, and the decode sidecar's capacity release neither picks it
// nor counts it evictable (SetSessionHintsCommand carries the pin). The low-priority hint is
// the session's from the turn that sets it (a turn without it clears it).

// pinEntry is a granted pin: the tokens it holds on a decode worker until untilMs.
type pinEntry struct {
	worker  string
	tokens  int64
	untilMs int64
}

// pinnedOnLocked is the KV tokens the live pins of sessions other than session hold on worker
// at nowMs (expired pins are dropped). Caller holds mu. The table is the leader's memory: a
// new leader starts empty (its records still carry their pins) and counts pins again as turns
// grant them.
func (s *Service) pinnedOnLocked(worker, session string, nowMs int64) int64 {
	var n int64
	for id, p := range s.pins {
		if p.untilMs <= nowMs {
			delete(s.pins, id)
			continue
		}
		if p.worker == worker && id != session {
			n += p.tokens
		}
	}
	return n
}

// hintsCtx is one outcome's hint effect inside Cluster.UpdateSession.
type hintsCtx struct {
	s        *Service
	r        *reservation
	nowMs    int64
	capacity int64
	k        *policy.Knobs
	// results
	grant   policy.PinGrant
	here    bool // the session is still on r.decode
	until   int64
	low     bool
	changed bool // the pin or the priority changed: the decode sidecar is told
}

func (h *hintsCtx) apply(rec *kvcv1.SessionRecord) {
	r := h.r
	if rec.DecodeWorker != r.decode {
		return
	}
	h.here = true
	if r.pinMs > 0 {
		h.s.mu.Lock()
		others := h.s.pinnedOnLocked(r.decode, r.session, h.nowMs)
		h.grant = policy.GrantPin(h.k, r.pinMs, h.nowMs, rec.KvCommittedLen, others, h.capacity)
		if h.grant.UntilMs > 0 {
			h.s.pins[r.session] = pinEntry{worker: r.decode, tokens: rec.KvCommittedLen, untilMs: h.grant.UntilMs}
			rec.PinnedUntilUnixMs = h.grant.UntilMs
			h.changed = true
		}
		h.s.mu.Unlock()
	}
	h.changed = h.changed || r.lowChanged
	h.until, h.low = rec.PinnedUntilUnixMs, rec.LowPriority
}

// noHints is grantHints' answer for a turn without hints (read-only).
var noHints hintsCtx

// grantHints applies a successful outcome's hints to the session resident on r.decode and
// returns what the decode sidecar must know (the pin's end, the priority) and whether they
// changed. The pin is clamped or refused by the policy's knobs (policy.GrantPin), with the
// reason logged and counted (kvc_router_pins_total).
func (s *Service) grantHints(r *reservation, nowMs int64) *hintsCtx {
	if r.pinMs <= 0 && !r.lowChanged {
		return &noHints // no hint: nothing to apply or tell (most turns)
	}
	h := &hintsCtx{s: s, r: r, nowMs: nowMs, k: s.policyKnobs()}
	for _, w := range s.c.Workers() {
		if w.GetWorkerId() == r.decode {
			h.capacity = w.GetKvCapacityTokens()
			break
		}
	}
	s.c.UpdateSession(r.session, h.apply)
	if r.pinMs > 0 && h.here {
		s.m.pins.WithLabelValues(h.grant.Result).Inc()
		if h.grant.Result != policy.PinGranted {
			s.log.Info().Str("session", r.session).Str("worker", r.decode).Int64("pin_ms", r.pinMs).
				Str("result", h.grant.Result).Str("why", h.grant.Detail).Msg("agent pin bounded by policy")
		}
	}
	return h
}

// sendHints tells r.decode's sidecar the session's new pin and priority (an extended turn:
// the session stays where it is) on their own command (policy.HintsCommand), which leaves its
// snapshot target as it is. With snapshots off the sidecar releases nothing, and nothing is
// sent.
func (s *Service) sendHints(r *reservation, h *hintsCtx) {
	if !h.here || !h.changed || !s.policyKnobs().SnapshotsEnabled {
		return
	}
	c := policy.HintsCommand(r.session, h.until, h.low, h.nowMs, true)
	cmd := &kvcv1.Command{Action: &kvcv1.Command_SetSessionHints{SetSessionHints: c}, Traceparent: r.trace}
	if err := s.send(r.decode, "set_session_hints", cmd); err != nil {
		s.log.Debug().Err(err).Str("session", r.session).Str("worker", r.decode).Msg("agent hints not sent")
	}
}
