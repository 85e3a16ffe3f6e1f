package state

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestDurableSameMatchesComparison checks durable.same, read in place, against the comparison
// of two durableOf snapshots it replaced, for a change of every durable field and of the
// volatile ones (which must not count).
func TestDurableSameMatchesComparison(t *testing.T) {
	snap := &kvcv1.SnapshotInfo{PrefillWorker: "p0", Seqlen: 10}
	base := func() *kvcv1.SessionRecord {
		return &kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d0", PreviousDecodeWorker: "d1", Snapshot: snap,
			Generation: 3, Migrations: 1, CreatedUnixMs: 5, PinnedUntilUnixMs: 7, LowPriority: true,
			Turn: 2, LastSeenUnixMs: 9, KvCommittedLen: 100}
	}
	for _, tc := range []struct {
		name    string
		edit    func(r *kvcv1.SessionRecord)
		durable bool
	}{
		{"nothing", func(*kvcv1.SessionRecord) {}, false},
		{"decode worker", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d2" }, true},
		{"decode worker, same bytes", func(r *kvcv1.SessionRecord) { r.DecodeWorker = string([]byte("d0")) }, false},
		{"previous decode worker", func(r *kvcv1.SessionRecord) { r.PreviousDecodeWorker = "" }, true},
		{"snapshot replaced", func(r *kvcv1.SessionRecord) { r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p0", Seqlen: 10} }, true},
		{"snapshot dropped", func(r *kvcv1.SessionRecord) { r.Snapshot = nil }, true},
		{"generation", func(r *kvcv1.SessionRecord) { r.Generation++ }, true},
		{"migrations", func(r *kvcv1.SessionRecord) { r.Migrations++ }, true},
		{"created", func(r *kvcv1.SessionRecord) { r.CreatedUnixMs = 6 }, true},
		{"pinned until", func(r *kvcv1.SessionRecord) { r.PinnedUntilUnixMs = 8 }, true},
		{"low priority", func(r *kvcv1.SessionRecord) { r.LowPriority = false }, true},
		{"volatile fields", func(r *kvcv1.SessionRecord) {
			r.Turn, r.LastSeenUnixMs, r.KvCommittedLen, r.Epoch = 3, 10, 200, 4
			r.DRejects = map[string]int32{"d0": 1}
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := base()
			before := durableOf(r)
			tc.edit(r)
			if got, want := !before.same(r), durableOf(r) != before; got != want || got != tc.durable {
				t.Fatalf("same says changed=%v, durableOf comparison %v, want %v", got, want, tc.durable)
			}
		})
	}
}
