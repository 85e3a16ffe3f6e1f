package policy

import (
	"fmt"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Agent hints (issue 13 item 5): a session may be pinned on its decode worker for a bounded
// time while its agent waits on a tool (not released for capacity, not migrated after
// rejections) and marked low priority (released first, prefills hinted low).

// Pinned reports whether rec's agent pin holds at nowMs.
func Pinned(rec *kvcv1.SessionRecord, nowMs int64) bool {
	return rec != nil && rec.GetPinnedUntilUnixMs() > nowMs
}

// Results of a pin request (metric label and log field).
const (
	PinGranted         = "granted"
	PinClamped         = "clamped"          // longer than max_pin_ms: granted for max_pin_ms
	PinRefusedDisabled = "refused_disabled" // max_pin_ms is 0: pins are off
	PinRefusedShare    = "refused_share"    // the worker's pinned tokens would pass max_pinned_share
	PinRefusedCapacity = "refused_capacity" // the worker reports no KV capacity
)

// PinGrant is the control plane's answer to a pin request.
type PinGrant struct {
	// UntilMs is the pin's end (unix ms); 0 when refused.
	UntilMs int64
	// Result is one of the Pin* results; Detail says why, for the log.
	Result string
	Detail string
}

// GrantPin bounds a pin of pinMs asked at nowMs for a session holding tokens KV tokens on a
// decode worker of capacity tokens where the other pinned sessions hold pinnedOthers: a pin
// longer than max_pin_ms is clamped to it; one that would take the worker's pinned tokens past
// max_pinned_share of its capacity is refused (the turn is still served, unpinned), as is
// every pin while max_pin_ms is 0.
func GrantPin(k *Knobs, pinMs, nowMs, tokens, pinnedOthers, capacity int64) PinGrant {
	switch {
	case pinMs <= 0:
		return PinGrant{}
	case k.MaxPinMs <= 0:
		return PinGrant{Result: PinRefusedDisabled, Detail: "pins are off (max_pin_ms 0)"}
	case capacity <= 0:
		return PinGrant{Result: PinRefusedCapacity, Detail: "the decode worker reports no KV capacity"}
	}
	limit := int64(k.MaxPinnedShare * float64(capacity))
	if pinnedOthers+tokens > limit {
		return PinGrant{Result: PinRefusedShare, Detail: fmt.Sprintf("pinned tokens %d + %d would pass max_pinned_share %.2f of %d (%d)",
			pinnedOthers, tokens, k.MaxPinnedShare, capacity, limit)}
	}
	if pinMs > k.MaxPinMs {
		return PinGrant{UntilMs: nowMs + k.MaxPinMs, Result: PinClamped, Detail: fmt.Sprintf("pin %d ms clamped to max_pin_ms %d", pinMs, k.MaxPinMs)}
	}
	return PinGrant{UntilMs: nowMs + pinMs, Result: PinGranted}
}
