package state

import (
	"fmt"
	"testing"
	"time"
	"unsafe"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// adjacent reports whether recs sit one after another in memory, as the elements of one
// array do (records allocated one by one break the run at least at every span's end).
func adjacent(recs []*kvcv1.SessionRecord) error {
	size := unsafe.Sizeof(kvcv1.SessionRecord{})
	for i := 1; i < len(recs); i++ {
		if d := uintptr(unsafe.Pointer(recs[i])) - uintptr(unsafe.Pointer(recs[i-1])); d != size {
			return fmt.Errorf("record %d is %d bytes after record %d, want %d (one chunk)", i, int64(d), i-1, size)
		}
	}
	return nil
}

// TestSessionRecordsInChunks: the records of created sessions come from recSlab's chunks,
// and a deleted session's record serves the next session created, reset (nothing of the old
// session shows in the new one).
func TestSessionRecordsInChunks(t *testing.T) {
	f := newFixture(t, Config{SessionTTL: time.Minute})
	st := f.st
	now := time.Now()
	old := now.Add(-2 * time.Minute).UnixMilli()
	for i := range recChunk {
		st.UpdateSession(fmt.Sprintf("s%03d", i), func(r *kvcv1.SessionRecord) {
			r.LastSeenUnixMs = now.UnixMilli()
			r.DecodeWorker = "d0"
		})
	}
	st.mu.Lock()
	recs := make([]*kvcv1.SessionRecord, recChunk)
	for i := range recs {
		recs[i] = st.sessions[fmt.Sprintf("s%03d", i)].rec
	}
	st.mu.Unlock()
	if err := adjacent(recs); err != nil {
		t.Fatal(err)
	}

	st.UpdateSession("gone", func(r *kvcv1.SessionRecord) {
		r.LastSeenUnixMs = old
		r.DecodeWorker = "d1"
		r.Turn = 7
		r.DRejects = map[string]int32{"d2": 1}
		r.ContentChain = []byte{1, 2, 3}
		r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p0", Seqlen: 10, Generation: 1}
	})
	st.mu.Lock()
	gone := st.sessions["gone"].rec
	st.mu.Unlock()
	if n := st.ExpireIdle(now); n != 1 {
		t.Fatalf("expired %d sessions, want 1", n)
	}
	st.UpdateSession("fresh", func(r *kvcv1.SessionRecord) {
		if want := (&kvcv1.SessionRecord{SessionId: "fresh", CreatedUnixMs: r.GetCreatedUnixMs()}); !proto.Equal(r, want) {
			t.Errorf("a new session's record starts as %v, want %v", r, want)
		}
		r.LastSeenUnixMs = now.UnixMilli()
	})
	st.mu.Lock()
	reused := st.sessions["fresh"].rec == gone
	st.mu.Unlock()
	if !reused {
		t.Error("the expired session's record was not reused for the next session created")
	}
	if recs, _ := st.ListSessions("", 10, "d1"); len(recs) != 0 {
		t.Errorf("the expired session's residency is still listed: %v", recs)
	}
	got, ok := st.Session("fresh")
	if !ok || got.GetSnapshot() != nil || got.GetTurn() != 0 || len(got.GetDRejects()) != 0 || got.GetDecodeWorker() != "" {
		t.Errorf("fresh = %v, %v; want a record with nothing of the expired session", got, ok)
	}
}
