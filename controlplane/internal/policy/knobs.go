package policy

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/proto"
)

// Default knob values: the same as the control plane's state fills in (state.DefaultPolicy,
// docs/architecture.md); the router only falls back to these when a field is unset.
const (
	DefaultDirectMaxUncachedTokens  = 8192
	DefaultMigrationRejectThreshold = 3
	DefaultMaxConcurrentTransfers   = 4
	DefaultDCapacityHeadroom        = 0.05
	DefaultReservationTimeoutMs     = 30_000
	DefaultBackpressurePauseMs      = 50
	DefaultBackpressureQueue        = 8
	DefaultSnapshotDeltaTokens      = 64
	DefaultTailToleranceTokens      = 2048
	DefaultSessionTTLMs             = 24 * 3600 * 1000
	DefaultUnreachableGraceMs       = 30_000

	// DefaultLocalAppendMaxTokens: two of SGLang's 8,192-token prefill chunks (the workload's
	// large appends are 9-16K tokens).
	DefaultLocalAppendMaxTokens = 16384
	// DefaultLocalAppendStallTokensPerOutput: the decode-side prefill rate × the TPOT slack per
	// output token, 20,000 tokens/s × (50 − 5.6) ms ≈ 888 on one H200 (Qwen3-30B-A3B, kvc-sim's
	// default timing, the bench's 50 ms TPOT SLO), rounded down.
	DefaultLocalAppendStallTokensPerOutput = 800

	// Agent hints: the longest pin (10 min) and the share of a decode worker's capacity that
	// pinned sessions may hold (half).
	DefaultMaxPinMs       = 600_000
	DefaultMaxPinnedShare = 0.5
	MaxPinMsLimit         = 24 * 3600 * 1000
)

// Prefill priority hints (lower is more important, as in SGLang's priority scheduling).
const (
	PrefillPriorityNormal int32 = 0
	// PrefillPriorityLow marks prefills of sessions predicted to go direct-to-D next: P's radix
	// cache should evict them first.
	PrefillPriorityLow int32 = 100
)

// Request bounds (also checked by the router on every query).
const (
	MaxInputTokens  = 10_000_000
	MaxOutputTokens = 1_000_000
)

// Defaults returns a policy record with every knob set to its default.
func Defaults() *kvcv1.Policy {
	return &kvcv1.Policy{
		DirectMaxUncachedTokens:   proto.Int64(DefaultDirectMaxUncachedTokens),
		MigrationRejectThreshold:  proto.Int32(DefaultMigrationRejectThreshold),
		SeedMinTurn:               proto.Int32(0),
		SeedMaxResidentTokens:     proto.Int64(0),
		SeedMaxOutputTokens:       proto.Int64(0),
		SeedOnlyMultiturn:         proto.Bool(false),
		SeedMaxInflightDecode:     proto.Int32(0),
		MaxConcurrentTransfers:    proto.Int32(DefaultMaxConcurrentTransfers),
		DCapacityHeadroom:         proto.Float64(DefaultDCapacityHeadroom),
		ReservationTimeoutMs:      proto.Int64(DefaultReservationTimeoutMs),
		BackpressureTransferQueue: proto.Int32(DefaultBackpressureQueue),
		BackpressurePreallocQueue: proto.Int32(DefaultBackpressureQueue),
		BackpressurePauseMs:       proto.Int64(DefaultBackpressurePauseMs),
		SnapshotDeltaTokens:       proto.Int64(DefaultSnapshotDeltaTokens),
		TailToleranceTokens:       proto.Int64(DefaultTailToleranceTokens),
		SnapshotMaxStalenessMs:    proto.Int64(0),
		SessionTtlMs:              proto.Int64(DefaultSessionTTLMs),
		SnapshotsEnabled:          proto.Bool(true),
		KvCentricEnabled:          proto.Bool(true),
		UnreachableGraceMs:        proto.Int64(DefaultUnreachableGraceMs),
		MaxPinMs:                  proto.Int64(DefaultMaxPinMs),
		MaxPinnedShare:            proto.Float64(DefaultMaxPinnedShare),

		LocalAppendMaxTokens:            proto.Int64(DefaultLocalAppendMaxTokens),
		LocalAppendStallTokensPerOutput: proto.Int64(DefaultLocalAppendStallTokensPerOutput),
	}
}

// Merge returns a copy of base with every field set in update applied (proto3 optional
// presence: unset fields keep base's value). Entries of max_concurrent_transfers_per_worker
// are merged per worker; a negative value removes that worker's override. version is kept
// from base. Neither argument is modified; either may be nil.
func Merge(base, update *kvcv1.Policy) *kvcv1.Policy {
	out := &kvcv1.Policy{}
	if base != nil {
		out = proto.Clone(base).(*kvcv1.Policy)
	}
	if update == nil {
		return out
	}
	u := proto.Clone(update).(*kvcv1.Policy)
	perWorker := u.MaxConcurrentTransfersPerWorker
	u.MaxConcurrentTransfersPerWorker = nil
	version := out.Version
	proto.Merge(out, u) // scalar optional fields: set fields overwrite
	out.Version = version
	if len(perWorker) > 0 {
		if out.MaxConcurrentTransfersPerWorker == nil {
			out.MaxConcurrentTransfersPerWorker = make(map[string]int32, len(perWorker))
		}
		for id, v := range perWorker {
			if v < 0 {
				delete(out.MaxConcurrentTransfersPerWorker, id)
				continue
			}
			out.MaxConcurrentTransfersPerWorker[id] = v
		}
	}
	return out
}

// WithDefaults is Merge(Defaults(), p): every unset knob gets its default.
func WithDefaults(p *kvcv1.Policy) *kvcv1.Policy {
	out := Merge(Defaults(), p)
	if p != nil {
		out.Version = p.Version
	}
	return out
}

type rangeI64 struct {
	name     string
	v        *int64
	min, max int64
}

// Validate checks every set knob's range (unset knobs are fine: they take defaults). All
// problems are reported, joined, each naming its field.
func Validate(p *kvcv1.Policy) error {
	if p == nil {
		return errors.New("policy is required")
	}
	var errs []error
	i64 := []rangeI64{
		{"direct_max_uncached_tokens", p.DirectMaxUncachedTokens, 0, MaxInputTokens},
		{"seed_max_resident_tokens", p.SeedMaxResidentTokens, 0, MaxInputTokens + MaxOutputTokens},
		{"seed_max_output_tokens", p.SeedMaxOutputTokens, 0, MaxOutputTokens},
		{"reservation_timeout_ms", p.ReservationTimeoutMs, 100, 3_600_000},
		{"backpressure_pause_ms", p.BackpressurePauseMs, 0, 60_000},
		{"snapshot_delta_tokens", p.SnapshotDeltaTokens, 1, MaxInputTokens},
		{"tail_tolerance_tokens", p.TailToleranceTokens, 0, MaxInputTokens},
		{"snapshot_max_staleness_ms", p.SnapshotMaxStalenessMs, 0, 30 * 24 * 3600 * 1000},
		{"session_ttl_ms", p.SessionTtlMs, 1000, 365 * 24 * 3600 * 1000},
		{"unreachable_grace_ms", p.UnreachableGraceMs, 0, 3_600_000},
		{"max_pin_ms", p.MaxPinMs, 0, MaxPinMsLimit},
		{"local_append_max_tokens", p.LocalAppendMaxTokens, 0, MaxInputTokens},
		{"local_append_stall_tokens_per_output", p.LocalAppendStallTokensPerOutput, 0, MaxInputTokens},
	}
	for _, r := range i64 {
		if r.v != nil && (*r.v < r.min || *r.v > r.max) {
			errs = append(errs, fmt.Errorf("%s = %d out of range [%d, %d]", r.name, *r.v, r.min, r.max))
		}
	}
	i32 := []struct {
		name     string
		v        *int32
		min, max int32
	}{
		{"migration_reject_threshold", p.MigrationRejectThreshold, 1, 1000},
		{"seed_min_turn", p.SeedMinTurn, 0, 1_000_000},
		{"seed_max_inflight_decode", p.SeedMaxInflightDecode, 0, 10_000},
		{"max_concurrent_transfers", p.MaxConcurrentTransfers, 0, 10_000},
		{"backpressure_transfer_queue", p.BackpressureTransferQueue, 0, 1_000_000},
		{"backpressure_prealloc_queue", p.BackpressurePreallocQueue, 0, 1_000_000},
	}
	for _, r := range i32 {
		if r.v != nil && (*r.v < r.min || *r.v > r.max) {
			errs = append(errs, fmt.Errorf("%s = %d out of range [%d, %d]", r.name, *r.v, r.min, r.max))
		}
	}
	if h := p.DCapacityHeadroom; h != nil && (math.IsNaN(*h) || *h < 0 || *h > 0.9) {
		errs = append(errs, fmt.Errorf("d_capacity_headroom = %v out of range [0, 0.9]", *h))
	}
	if h := p.MaxPinnedShare; h != nil && (math.IsNaN(*h) || *h < 0 || *h > 1) {
		errs = append(errs, fmt.Errorf("max_pinned_share = %v out of range [0, 1]", *h))
	}
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
		if v := p.MaxConcurrentTransfersPerWorker[id]; v < 0 || v > 10_000 {
			errs = append(errs, fmt.Errorf("max_concurrent_transfers_per_worker[%s] = %d out of range [0, 10000]", id, v))
		}
	}
	if p.Version < 0 {
		errs = append(errs, fmt.Errorf("version = %d is negative", p.Version))
	}
	return errors.Join(errs...)
}

// Knobs is a compiled policy: plain values read by Decide.
type Knobs struct {
	DirectMaxUncachedTokens  int64
	MigrationRejectThreshold int32
	SeedMinTurn              int32
	SeedMaxResidentTokens    int64 // 0 = no limit
	SeedMaxOutputTokens      int64 // 0 = no limit
	SeedOnlyMultiturn        bool
	SeedMaxInflightDecode    int32 // 0 = no limit
	MaxConcurrentTransfers   int32 // 0 = no limit
	TransfersPerWorker       map[string]int32
	DCapacityHeadroom        float64
	ReservationTimeout       time.Duration
	BackpressureTransferQ    int32 // 0 = off
	BackpressurePreallocQ    int32 // 0 = off
	BackpressurePauseMs      int64
	TailToleranceTokens      int64
	SnapshotMaxStalenessMs   int64 // 0 = never stale
	SnapshotsEnabled         bool
	KVCentricEnabled         bool
	// SeedThroughStore: decode workers are colocated SGLang servers; seeds go through the
	// prefill store (Execution.StoreGeneration).
	SeedThroughStore bool
	// SeedThroughStoreWhenShort: decode workers take both (kvc-sim's hybrids); a seed goes
	// through the prefill store only while its decode worker is short of pages (shortOfPages).
	SeedThroughStoreWhenShort bool
	// Agent hints: the longest pin (0 refuses pins) and the share of a decode worker's KV
	// capacity pinned sessions may hold (pin.go).
	MaxPinMs       int64
	MaxPinnedShare float64
	// NewSessionShare bounds the reservations of new sessions on a decode worker beyond its
	// free room to this share of its kv_capacity_tokens (newsession.go); 0 = no bound. Not a
	// field of the policy record: kvc-controlplane --new-session-share (the router sets it).
	NewSessionShare float64
	Version         int64

	// LocalAppendMaxTokens: the largest append over DirectMaxUncachedTokens that the session's
	// own decode worker may prefill itself (LOCAL_LARGE_APPEND, localAppend); 0 = never.
	LocalAppendMaxTokens int64
	// LocalAppendStallTokensPerOutput: the prefill tokens a co-running request's decode may
	// wait for per output token it asked for and keep its TPOT within the SLO (localAppend).
	LocalAppendStallTokensPerOutput int64
}

// Compile fills defaults into p and returns its Knobs. p is not modified.
func Compile(p *kvcv1.Policy) *Knobs {
	f := WithDefaults(p)
	k := &Knobs{
		DirectMaxUncachedTokens:   f.GetDirectMaxUncachedTokens(),
		MigrationRejectThreshold:  f.GetMigrationRejectThreshold(),
		SeedMinTurn:               f.GetSeedMinTurn(),
		SeedMaxResidentTokens:     f.GetSeedMaxResidentTokens(),
		SeedMaxOutputTokens:       f.GetSeedMaxOutputTokens(),
		SeedOnlyMultiturn:         f.GetSeedOnlyMultiturn(),
		SeedMaxInflightDecode:     f.GetSeedMaxInflightDecode(),
		MaxConcurrentTransfers:    f.GetMaxConcurrentTransfers(),
		TransfersPerWorker:        f.GetMaxConcurrentTransfersPerWorker(),
		DCapacityHeadroom:         f.GetDCapacityHeadroom(),
		ReservationTimeout:        time.Duration(f.GetReservationTimeoutMs()) * time.Millisecond,
		BackpressureTransferQ:     f.GetBackpressureTransferQueue(),
		BackpressurePreallocQ:     f.GetBackpressurePreallocQueue(),
		BackpressurePauseMs:       f.GetBackpressurePauseMs(),
		TailToleranceTokens:       f.GetTailToleranceTokens(),
		SnapshotMaxStalenessMs:    f.GetSnapshotMaxStalenessMs(),
		SnapshotsEnabled:          f.GetSnapshotsEnabled(),
		KVCentricEnabled:          f.GetKvCentricEnabled(),
		SeedThroughStore:          f.GetSeedThroughStore(),
		SeedThroughStoreWhenShort: f.GetSeedThroughStoreWhenShort(),
		MaxPinMs:                  f.GetMaxPinMs(),
		MaxPinnedShare:            f.GetMaxPinnedShare(),
		NewSessionShare:           DefaultNewSessionShare,
		Version:                   f.GetVersion(),

		LocalAppendMaxTokens:            f.GetLocalAppendMaxTokens(),
		LocalAppendStallTokensPerOutput: f.GetLocalAppendStallTokensPerOutput(),
	}
	if k.MigrationRejectThreshold < 1 {
		k.MigrationRejectThreshold = 1
	}
	if k.ReservationTimeout <= 0 {
		k.ReservationTimeout = DefaultReservationTimeoutMs * time.Millisecond
	}
	return k
}

// TransferBudget is the per-D budget of concurrent seeds/reseeds (0 = no limit).
func (k *Knobs) TransferBudget(workerID string) int32 {
	if v, ok := k.TransfersPerWorker[workerID]; ok {
		return v
	}
	return k.MaxConcurrentTransfers
}
