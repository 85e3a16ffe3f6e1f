package policy

import (
	"math"
	"strings"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/proto"
)

func TestValidate(t *testing.T) {
	cases := []struct {
		name    string
		p       *kvcv1.Policy
		wantErr string
	}{
		{"nil", nil, "required"},
		{"empty is fine", &kvcv1.Policy{}, ""},
		{"defaults are valid", Defaults(), ""},
		{"negative direct limit", &kvcv1.Policy{DirectMaxUncachedTokens: proto.Int64(-1)}, "direct_max_uncached_tokens"},
		{"absurd direct limit", &kvcv1.Policy{DirectMaxUncachedTokens: proto.Int64(1 << 40)}, "direct_max_uncached_tokens"},
		{"threshold 0", &kvcv1.Policy{MigrationRejectThreshold: proto.Int32(0)}, "migration_reject_threshold"},
		{"negative seed_min_turn", &kvcv1.Policy{SeedMinTurn: proto.Int32(-2)}, "seed_min_turn"},
		{"negative budget", &kvcv1.Policy{MaxConcurrentTransfers: proto.Int32(-1)}, "max_concurrent_transfers"},
		{"headroom NaN", &kvcv1.Policy{DCapacityHeadroom: proto.Float64(math.NaN())}, "d_capacity_headroom"},
		{"headroom 1", &kvcv1.Policy{DCapacityHeadroom: proto.Float64(1)}, "d_capacity_headroom"},
		{"reservation timeout too short", &kvcv1.Policy{ReservationTimeoutMs: proto.Int64(5)}, "reservation_timeout_ms"},
		{"delta 0", &kvcv1.Policy{SnapshotDeltaTokens: proto.Int64(0)}, "snapshot_delta_tokens"},
		{"per-worker bad id", &kvcv1.Policy{MaxConcurrentTransfersPerWorker: map[string]int32{"a/b": 1}}, "forbidden"},
		{"per-worker negative", &kvcv1.Policy{MaxConcurrentTransfersPerWorker: map[string]int32{"d1": -1}}, "d1"},
		{"two errors both named", &kvcv1.Policy{SeedMinTurn: proto.Int32(-1), TailToleranceTokens: proto.Int64(-1)}, "tail_tolerance_tokens"},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			err := Validate(tt.p)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error %v, want it to mention %q", err, tt.wantErr)
			}
		})
	}
}

func TestMerge(t *testing.T) {
	base := Defaults()
	base.Version = 7
	base.MaxConcurrentTransfersPerWorker = map[string]int32{"d1": 2, "d2": 3}
	upd := &kvcv1.Policy{
		DirectMaxUncachedTokens:         proto.Int64(2048),
		SnapshotsEnabled:                proto.Bool(false),
		MaxConcurrentTransfersPerWorker: map[string]int32{"d1": -1, "d3": 9},
		Version:                         99,
	}
	got := Merge(base, upd)
	if got.GetDirectMaxUncachedTokens() != 2048 || got.GetSnapshotsEnabled() {
		t.Errorf("set fields not applied: %v", got)
	}
	if got.GetMigrationRejectThreshold() != DefaultMigrationRejectThreshold || !got.GetKvCentricEnabled() {
		t.Errorf("unset fields changed: %v", got)
	}
	if got.Version != 7 {
		t.Errorf("version %d, want base's 7", got.Version)
	}
	w := got.MaxConcurrentTransfersPerWorker
	if _, ok := w["d1"]; ok || w["d2"] != 3 || w["d3"] != 9 {
		t.Errorf("per-worker merge: %v", w)
	}
	if base.GetDirectMaxUncachedTokens() != DefaultDirectMaxUncachedTokens || base.MaxConcurrentTransfersPerWorker["d1"] != 2 {
		t.Error("Merge modified its base")
	}
	if err := Validate(got); err != nil {
		t.Errorf("merged policy invalid: %v", err)
	}
	// false is a value, not "unset".
	off := Merge(Defaults(), &kvcv1.Policy{KvCentricEnabled: proto.Bool(false)})
	if off.GetKvCentricEnabled() {
		t.Error("explicit false ignored")
	}
}

func TestCompileDefaults(t *testing.T) {
	k := Compile(nil)
	if k.DirectMaxUncachedTokens != 8192 || k.MigrationRejectThreshold != 3 || k.MaxConcurrentTransfers != DefaultMaxConcurrentTransfers ||
		k.DCapacityHeadroom != 0.05 || k.ReservationTimeout != DefaultReservationTimeoutMs*time.Millisecond ||
		!k.SnapshotsEnabled || !k.KVCentricEnabled || k.TailToleranceTokens != DefaultTailToleranceTokens {
		t.Errorf("defaults: %+v", k)
	}
	k = Compile(&kvcv1.Policy{MaxConcurrentTransfers: proto.Int32(2), MaxConcurrentTransfersPerWorker: map[string]int32{"d9": 7}})
	if k.TransferBudget("d1") != 2 || k.TransferBudget("d9") != 7 {
		t.Errorf("budget: %d %d", k.TransferBudget("d1"), k.TransferBudget("d9"))
	}
}
