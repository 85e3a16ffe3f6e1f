package state

import (
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestAgentHintsAreDurable: a granted pin or a priority change is written as the whole record
// (the volatile journal does not carry them), so a new leader loads them; a plain volatile
// change after it still goes to the journal.
func TestAgentHintsAreDurable(t *testing.T) {
	f := newFixture(t, Config{NodeID: "cp-1", FlushDelay: 5 * time.Millisecond, VolatileFlush: time.Hour})
	st, ctx := f.st, t.Context()
	st.UpdateSession("a", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0"; r.Turn = 1 })
	must(t, st.Flush(ctx))
	st.UpdateSession("a", func(r *kvcv1.SessionRecord) { r.PinnedUntilUnixMs = 1_700_000_030_000; r.Turn = 2 })
	must(t, st.Flush(ctx))
	rec, _, err := f.store.GetSession(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	if rec.GetPinnedUntilUnixMs() != 1_700_000_030_000 || rec.GetTurn() != 2 {
		t.Fatalf("stored %v: the pin was not written in full", rec)
	}
	st.UpdateSession("a", func(r *kvcv1.SessionRecord) { r.LowPriority = true })
	must(t, st.Flush(ctx))
	if rec, _, _ = f.store.GetSession(ctx, "a"); !rec.GetLowPriority() {
		t.Fatalf("stored %v: the priority was not written in full", rec)
	}
	st.UpdateSession("a", func(r *kvcv1.SessionRecord) { r.Turn = 3 })
	must(t, st.Flush(ctx))
	if rec, _, _ = f.store.GetSession(ctx, "a"); rec.GetTurn() != 2 {
		t.Fatalf("stored %v: a volatile change rewrote the record", rec)
	}
	if view := loadedView(t, f.store)["a"]; view.GetTurn() != 3 || view.GetPinnedUntilUnixMs() != 1_700_000_030_000 || !view.GetLowPriority() {
		t.Fatalf("a new leader loads %v", view)
	}
}
