package state

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Policy defaults (docs/architecture.md lists them).
const (
	DefaultDirectMaxUncachedTokens   = 8192
	DefaultMigrationRejectThreshold  = 3
	DefaultSeedMinTurn               = 0
	DefaultMaxConcurrentTransfers    = 4
	DefaultDCapacityHeadroom         = 0.05
	DefaultReservationTimeoutMs      = 30000
	DefaultBackpressureTransferQueue = 8
	DefaultBackpressurePreallocQueue = 8
	DefaultBackpressurePauseMs       = 50
	DefaultSnapshotDeltaTokens       = 1024
	DefaultTailToleranceTokens       = 2048
	DefaultSnapshotMaxStalenessMs    = 0
	DefaultSessionTTL                = 24 * time.Hour
	DefaultUnreachableGrace          = 30 * time.Second
)

// DefaultPolicy returns the policy with every knob at its default; sessionTTL and grace
// (from --session-ttl and --unreachable-grace) replace the built-in defaults when > 0.
func DefaultPolicy(sessionTTL, grace time.Duration) *kvcv1.Policy {
	if sessionTTL <= 0 {
		sessionTTL = DefaultSessionTTL
	}
	if grace <= 0 {
		grace = DefaultUnreachableGrace
	}
	return &kvcv1.Policy{
		DirectMaxUncachedTokens:   proto.Int64(DefaultDirectMaxUncachedTokens),
		MigrationRejectThreshold:  proto.Int32(DefaultMigrationRejectThreshold),
		SeedMinTurn:               proto.Int32(DefaultSeedMinTurn),
		SeedMaxResidentTokens:     proto.Int64(0),
		SeedMaxOutputTokens:       proto.Int64(0),
		SeedOnlyMultiturn:         proto.Bool(false),
		SeedMaxInflightDecode:     proto.Int32(0),
		MaxConcurrentTransfers:    proto.Int32(DefaultMaxConcurrentTransfers),
		DCapacityHeadroom:         proto.Float64(DefaultDCapacityHeadroom),
		ReservationTimeoutMs:      proto.Int64(DefaultReservationTimeoutMs),
		BackpressureTransferQueue: proto.Int32(DefaultBackpressureTransferQueue),
		BackpressurePreallocQueue: proto.Int32(DefaultBackpressurePreallocQueue),
		BackpressurePauseMs:       proto.Int64(DefaultBackpressurePauseMs),
		PrefillBackupPolicy:       kvcv1.PrefillBackupPolicy_PREFILL_BACKUP_POLICY_RELEASE_AFTER_TRANSFER.Enum(),
		SnapshotDeltaTokens:       proto.Int64(DefaultSnapshotDeltaTokens),
		TailToleranceTokens:       proto.Int64(DefaultTailToleranceTokens),
		SnapshotMaxStalenessMs:    proto.Int64(DefaultSnapshotMaxStalenessMs),
		SessionTtlMs:              proto.Int64(sessionTTL.Milliseconds()),
		SnapshotsEnabled:          proto.Bool(true),
		KvCentricEnabled:          proto.Bool(true),
		UnreachableGraceMs:        proto.Int64(grace.Milliseconds()),
	}
}

// FillPolicy returns defaults overlaid with the set fields of stored (the operator's
// overrides); version is stored's. Neither argument is modified.
func FillPolicy(defaults, stored *kvcv1.Policy) *kvcv1.Policy {
	out := proto.Clone(defaults).(*kvcv1.Policy)
	if stored != nil {
		proto.Merge(out, stored)
		out.Version = stored.GetVersion()
	}
	return out
}

// MergePolicyUpdate returns stored with the set fields of update applied (update's version is
// ignored; a negative per-worker transfer budget removes that worker's override).
func MergePolicyUpdate(stored, update *kvcv1.Policy) *kvcv1.Policy {
	out := &kvcv1.Policy{}
	if stored != nil {
		out = proto.Clone(stored).(*kvcv1.Policy)
	}
	u := proto.Clone(update).(*kvcv1.Policy)
	u.Version = 0
	per := u.MaxConcurrentTransfersPerWorker
	u.MaxConcurrentTransfersPerWorker = nil
	proto.Merge(out, u)
	for id, v := range per {
		if out.MaxConcurrentTransfersPerWorker == nil {
			out.MaxConcurrentTransfersPerWorker = map[string]int32{}
		}
		if v < 0 {
			delete(out.MaxConcurrentTransfersPerWorker, id)
			continue
		}
		out.MaxConcurrentTransfersPerWorker[id] = v
	}
	return out
}

// Bounds beyond which a knob is certainly a mistake.
const (
	maxTokens = 100_000_000
	maxMs     = 365 * 24 * 3600 * 1000
)

// ValidatePolicy checks the ranges of every set knob (call it on a filled policy to check
// everything). All problems are reported, each naming its field.
func ValidatePolicy(p *kvcv1.Policy) error {
	if p == nil {
		return errors.New("policy is required")
	}
	var errs []error
	i64 := func(name string, v *int64, lo, hi int64) {
		if v != nil && (*v < lo || *v > hi) {
			errs = append(errs, fmt.Errorf("%s = %d out of range [%d, %d]", name, *v, lo, hi))
		}
	}
	i32 := func(name string, v *int32, lo, hi int32) {
		if v != nil && (*v < lo || *v > hi) {
			errs = append(errs, fmt.Errorf("%s = %d out of range [%d, %d]", name, *v, lo, hi))
		}
	}
	i64("direct_max_uncached_tokens", p.DirectMaxUncachedTokens, 0, maxTokens)
	i32("migration_reject_threshold", p.MigrationRejectThreshold, 1, 1_000_000)
	i32("seed_min_turn", p.SeedMinTurn, 0, 1_000_000_000)
	i64("seed_max_resident_tokens", p.SeedMaxResidentTokens, 0, maxTokens)
	i64("seed_max_output_tokens", p.SeedMaxOutputTokens, 0, maxTokens)
	i32("seed_max_inflight_decode", p.SeedMaxInflightDecode, 0, 1_000_000)
	i32("max_concurrent_transfers", p.MaxConcurrentTransfers, 0, 1_000_000)
	if h := p.DCapacityHeadroom; h != nil && (math.IsNaN(*h) || *h < 0 || *h >= 1) {
		errs = append(errs, fmt.Errorf("d_capacity_headroom = %v out of range [0, 1)", *h))
	}
	i64("reservation_timeout_ms", p.ReservationTimeoutMs, 1, maxMs)
	i32("backpressure_transfer_queue", p.BackpressureTransferQueue, 0, 1_000_000)
	i32("backpressure_prealloc_queue", p.BackpressurePreallocQueue, 0, 1_000_000)
	i64("backpressure_pause_ms", p.BackpressurePauseMs, 0, 3_600_000)
	if b := p.PrefillBackupPolicy; b != nil {
		if _, ok := kvcv1.PrefillBackupPolicy_name[int32(*b)]; !ok || *b == kvcv1.PrefillBackupPolicy_PREFILL_BACKUP_POLICY_UNSPECIFIED {
			errs = append(errs, fmt.Errorf("prefill_backup_policy %d is not a known policy", int32(*b)))
		}
	}
	i64("snapshot_delta_tokens", p.SnapshotDeltaTokens, 1, maxTokens)
	i64("tail_tolerance_tokens", p.TailToleranceTokens, 0, maxTokens)
	i64("snapshot_max_staleness_ms", p.SnapshotMaxStalenessMs, 0, maxMs)
	i64("session_ttl_ms", p.SessionTtlMs, 1000, maxMs)
	i64("unreachable_grace_ms", p.UnreachableGraceMs, 0, 24*3600*1000)
	ids := make([]string, 0, len(p.MaxConcurrentTransfersPerWorker))
	for id := range p.MaxConcurrentTransfersPerWorker {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		if err := kvcv1.ValidateID("max_concurrent_transfers_per_worker key", id); err != nil {
			errs = append(errs, err)
			continue
		}
		if v := p.MaxConcurrentTransfersPerWorker[id]; v < 0 || v > 1_000_000 {
			errs = append(errs, fmt.Errorf("max_concurrent_transfers_per_worker[%s] = %d out of range [0, 1000000]", id, v))
		}
	}
	if p.Version < 0 {
		errs = append(errs, fmt.Errorf("version = %d is negative", p.Version))
	}
	return errors.Join(errs...)
}
