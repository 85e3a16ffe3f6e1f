package state

import (
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// The policy record's defaults, merging and validation live in package policy (one source for
// the router and the state); these wrappers add what the state knows from its flags.

// DefaultPolicy returns the policy with every knob at its default; sessionTTL and grace
// (from --session-ttl and --unreachable-grace) replace the built-in defaults when > 0.
func DefaultPolicy(sessionTTL, grace time.Duration) *kvcv1.Policy {
	p := policy.Defaults()
	if sessionTTL > 0 {
		p.SessionTtlMs = proto.Int64(sessionTTL.Milliseconds())
	}
	if grace > 0 {
		p.UnreachableGraceMs = proto.Int64(grace.Milliseconds())
	}
	return p
}

// FillPolicy returns defaults overlaid with the set fields of stored (the operator's
// overrides); version is stored's. Neither argument is modified.
func FillPolicy(defaults, stored *kvcv1.Policy) *kvcv1.Policy {
	out := policy.Merge(defaults, stored)
	out.Version = stored.GetVersion()
	return out
}

// MergePolicyUpdate returns stored with the set fields of update applied (update's version is
// ignored; a negative per-worker transfer budget removes that worker's override).
func MergePolicyUpdate(stored, update *kvcv1.Policy) *kvcv1.Policy {
	return policy.Merge(stored, update)
}

// ValidatePolicy checks the ranges of every set knob (call it on a filled policy to check
// everything). All problems are reported, each naming its field.
func ValidatePolicy(p *kvcv1.Policy) error { return policy.Validate(p) }
