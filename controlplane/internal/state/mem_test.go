package state

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// BenchmarkSessionMemory reports the heap cost of one session in the leader's table (record,
// map entry, residency indexes) for realistic records. Run with -benchtime 1x.
func BenchmarkSessionMemory(b *testing.B) {
	const n = 200_000
	for range b.N {
		st := New(Config{Log: zerolog.Nop()})
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		now := time.Now().UnixMilli()
		st.mu.Lock()
		for i := range n {
			id := fmt.Sprintf("agent-run-%08d-session-%06d", i/7, i)
			rec := st.recs.get() // as createLocked takes it
			proto.Merge(rec, &kvcv1.SessionRecord{
				SessionId: id, DecodeWorker: fmt.Sprintf("gpu-node-%02d-decode-%d", i%16, i%8),
				KvCommittedLen: 40_000, Turn: 12, LastSeenUnixMs: now, CreatedUnixMs: now, Epoch: 1234, Generation: 3,
				Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: fmt.Sprintf("gpu-node-%02d-prefill-0", i%16), Seqlen: 39_000,
					Generation: 3, UpdatedUnixMs: now, Bytes: 39_000 * 98_304},
			})
			st.sessions[id] = sessEntry{rec: rec}
			index(st.byDecode, rec.DecodeWorker, id)
			index(st.bySnap, rec.Snapshot.PrefillWorker, id)
		}
		st.mu.Unlock()
		runtime.GC()
		runtime.ReadMemStats(&after)
		per := float64(after.HeapAlloc-before.HeapAlloc) / n
		b.ReportMetric(per, "bytes/session")
		fmt.Printf("session-memory: %.0f bytes/session, 1M sessions ≈ %.2f GiB\n", per, per*1e6/(1<<30))
		runtime.KeepAlive(st)
	}
}
