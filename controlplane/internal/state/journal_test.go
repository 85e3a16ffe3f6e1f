package state

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// journalBatches reads the journal keys from etcd, in seq order.
func journalBatches(t *testing.T, store *kvstore.Store) (batches []*kvcv1.VolatileBatch, bytes int) {
	t.Helper()
	r, err := store.Client().Get(t.Context(), store.VolatilePrefix(), clientv3.WithPrefix(),
		clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		t.Fatal(err)
	}
	for _, kv := range r.Kvs {
		b := &kvcv1.VolatileBatch{}
		if err := proto.Unmarshal(kv.Value, b); err != nil {
			t.Fatalf("journal key %s: %v", kv.Key, err)
		}
		seq, ok := kvstore.ParseVolatileName(strings.TrimPrefix(string(kv.Key), store.VolatilePrefix()))
		if !ok || seq != b.GetSeq() {
			t.Fatalf("journal key %s holds seq %d", kv.Key, b.GetSeq())
		}
		batches = append(batches, b)
		bytes += len(kv.Value)
	}
	return batches, bytes
}

func TestJournalEntryEncoding(t *testing.T) {
	long := strings.Repeat("x", kvcv1.MaxIDLen)
	cases := []struct {
		name string
		rec  *kvcv1.SessionRecord
	}{
		{"zero fields", &kvcv1.SessionRecord{SessionId: "s"}},
		{"all fields", &kvcv1.SessionRecord{SessionId: "sess-000001", Turn: 12, LastSeenUnixMs: 1_796_000_000_123, KvCommittedLen: 40_000,
			DRejects: map[string]int32{"d07": 2, "d01": 1, "d30": 0}}},
		{"negative and extreme", &kvcv1.SessionRecord{SessionId: long, Turn: -3, LastSeenUnixMs: -1, KvCommittedLen: 1 << 62,
			DRejects: map[string]int32{long: 1 << 30, "": -5}}},
		{"unicode id", &kvcv1.SessionRecord{SessionId: "séance-é", Turn: 1}},
		{"content chain", &kvcv1.SessionRecord{SessionId: "sess-000002", Turn: 3, KvCommittedLen: 32_768,
			ContentChain: bytes.Repeat([]byte{1, 0xff, 7}, 250)}},
	}
	var j journal
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := j.appendEntry(nil, tc.rec)
			b = j.appendEntry(b, tc.rec) // scratch buffers reused
			got := &kvcv1.VolatileBatch{}
			if err := proto.Unmarshal(b, got); err != nil {
				t.Fatal(err)
			}
			want := &kvcv1.VolatileEntry{SessionId: tc.rec.SessionId, Turn: tc.rec.Turn, LastSeenUnixMs: tc.rec.LastSeenUnixMs,
				KvCommittedLen: tc.rec.KvCommittedLen, DRejects: tc.rec.DRejects, ContentChain: tc.rec.ContentChain}
			if len(got.Entries) != 2 || !proto.Equal(got.Entries[0], want) || !proto.Equal(got.Entries[1], want) {
				t.Fatalf("decoded %v, want twice %v", got.Entries, want)
			}
			if std, _ := proto.Marshal(want); len(b) > 2*(len(std)+1+len(protoVarint(len(std)))) {
				t.Fatalf("encoded %d bytes, more than proto.Marshal's %d per entry", len(b), len(std))
			}
		})
	}
}

func protoVarint(n int) []byte {
	var b []byte
	for n >= 0x80 {
		b = append(b, byte(n)|0x80)
		n >>= 7
	}
	return append(b, byte(n))
}

// TestJournalLoad: what a new leader loads from the records and the journal, on a real etcd:
// a journal entry newer than the record wins, a record newer than the journal wins, entries
// of deleted sessions are ignored, the latest of several journal keys wins; across a
// failover without EndTerm (crash) and with it (graceful), the last flushed values survive.
func TestJournalLoad(t *testing.T) {
	f := newFixture(t, Config{NodeID: "cp-1", FlushDelay: 5 * time.Millisecond, VolatileFlush: time.Hour})
	st, ctx := f.st, t.Context()
	for _, id := range []string{"newer-journal", "newer-record", "deleted", "several", "untouched"} {
		st.UpdateSession(id, func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0"; r.Turn = 1; r.KvCommittedLen = 100 })
	}
	must(t, st.Flush(ctx))
	for _, id := range []string{"newer-journal", "newer-record", "deleted", "several"} {
		st.UpdateSession(id, func(r *kvcv1.SessionRecord) {
			r.Turn = 5
			r.KvCommittedLen = 500
			r.DRejects = map[string]int32{"d1": 2}
		})
	}
	st.UpdateSession("deleted", func(r *kvcv1.SessionRecord) { r.LastSeenUnixMs = 1 }) // idle since 1970
	must(t, st.Flush(ctx))                                                             // journal key 1
	first, _ := journalBatches(t, f.store)
	if len(first) != 1 || len(first[0].GetEntries()) != 4 || first[0].GetEpoch() != st.Epoch() {
		t.Fatalf("first flush: %v", first)
	}
	// A full record after the journal entry (a durable change: a residency change would
	// restart kv_committed_len at the new worker's commit), with a volatile change too.
	st.UpdateSession("newer-record", func(r *kvcv1.SessionRecord) { r.PreviousDecodeWorker = "d2"; r.Turn = 6; r.DRejects = nil })
	// Deleted after its entry was journalled.
	if n := st.ExpireIdle(time.Now()); n != 1 {
		t.Fatalf("expired %d sessions, want 1", n)
	}
	st.UpdateSession("several", func(r *kvcv1.SessionRecord) { r.Turn = 7 })
	st.UpdateSession("untouched", func(r *kvcv1.SessionRecord) { r.Turn = 2 }) // keeps key 2 live
	must(t, st.Flush(ctx))                                                     // key 2
	st.UpdateSession("several", func(r *kvcv1.SessionRecord) { r.KvCommittedLen = 900; r.DRejects = nil })
	must(t, st.Flush(ctx)) // key 3

	// etcd really holds the stale values the rule must ignore: key 1 (still live for
	// newer-journal) has newer-record's and deleted's old entries, key 2 (live for untouched)
	// several's older kv_committed_len.
	batches, _ := journalBatches(t, f.store)
	if len(batches) != 3 || batches[0].GetSeq() >= batches[1].GetSeq() || batches[1].GetSeq() >= batches[2].GetSeq() {
		t.Fatalf("journal keys %v", batches)
	}
	stale := map[string]bool{}
	for _, b := range batches[:2] {
		for _, e := range b.GetEntries() {
			stale[fmt.Sprintf("%s/%d/%d", e.GetSessionId(), e.GetTurn(), e.GetKvCommittedLen())] = true
		}
	}
	for _, k := range []string{"newer-record/5/500", "deleted/5/500", "several/7/500"} {
		if !stale[k] {
			t.Fatalf("journal lacks the stale entry %s: %v", k, batches)
		}
	}
	if rec, _, _ := f.store.GetSession(ctx, "newer-journal"); rec.GetTurn() != 1 {
		t.Fatalf("the record was rewritten (turn %d): the journal was not used", rec.GetTurn())
	}
	check := func(what string, view map[string]*kvcv1.SessionRecord) {
		t.Helper()
		want := map[string]string{
			"newer-journal": "turn=5 kv=500 rejects=map[d1:2] decode=d0",
			"newer-record":  "turn=6 kv=500 rejects=map[] decode=d0",
			"several":       "turn=7 kv=900 rejects=map[] decode=d0",
			"untouched":     "turn=2 kv=100 rejects=map[] decode=d0",
		}
		if len(view) != len(want) {
			t.Fatalf("%s: %d sessions, want %d", what, len(view), len(want))
		}
		for id, w := range want {
			r := view[id]
			if got := fmt.Sprintf("turn=%d kv=%d rejects=%v decode=%s", r.GetTurn(), r.GetKvCommittedLen(), r.GetDRejects(), r.GetDecodeWorker()); got != w {
				t.Fatalf("%s: %s loads as %s, want %s", what, id, got, w)
			}
		}
	}
	check("journal over records", loadedView(t, f.store))
	for id := range loadedView(t, f.store) {
		mem, _ := st.Session(id)
		if view := loadedView(t, f.store)[id]; !proto.Equal(view, mem) {
			t.Fatalf("%s: a new leader would load %v, memory %v", id, view, mem)
		}
	}

	// Crash: the leader loses its lease without EndTerm; the next one loads the same.
	if _, err := f.store.Client().Revoke(ctx, f.sess.Lease()); err != nil {
		t.Fatal(err)
	}
	f2 := leadOn(t, f.store, Config{NodeID: "cp-2", FlushDelay: 5 * time.Millisecond, VolatileFlush: time.Hour})
	view2 := map[string]*kvcv1.SessionRecord{}
	for _, id := range []string{"newer-journal", "newer-record", "several", "untouched"} {
		view2[id], _ = f2.st.Session(id)
	}
	check("new leader after a crash", view2)
	if f2.st.SessionCount() != 4 {
		t.Fatalf("new leader holds %d sessions", f2.st.SessionCount())
	}
	// The new leader's keys come after the old ones; a graceful EndTerm writes the rest.
	f2.st.UpdateSession("several", func(r *kvcv1.SessionRecord) { r.Turn = 11 })
	f2.st.EndTerm(f2.term)
	must(t, f2.sess.Close())
	after, _ := journalBatches(t, f.store)
	if last := after[len(after)-1]; last.GetSeq() <= batches[2].GetSeq() || last.GetEpoch() != f2.term.Fence().Rev {
		t.Fatalf("new leader's key %d (epoch %d) after the old leader's %d", last.GetSeq(), last.GetEpoch(), batches[2].GetSeq())
	}
	f3 := leadOn(t, f.store, Config{NodeID: "cp-3"})
	if r, _ := f3.st.Session("several"); r.GetTurn() != 11 || r.GetKvCommittedLen() != 900 {
		t.Fatalf("after a graceful failover: %v", r)
	}
	if r, _ := f3.st.Session("newer-journal"); r.GetTurn() != 5 {
		t.Fatalf("after two failovers: %v", r)
	}
}

// TestJournalBounded: many flushes over hot and cold sessions keep the journal at a few
// times the live entries; every key is deleted once its sessions are written in full or
// deleted; what a new leader would load matches memory throughout.
func TestJournalBounded(t *testing.T) {
	const (
		sessions = 3000
		hot      = 100
		per      = 64 // sessions per journal key
	)
	f := newFixture(t, Config{FlushDelay: 5 * time.Millisecond, VolatileFlush: time.Hour, journalMax: per})
	st, ctx := f.st, t.Context()
	ids := make([]string, sessions)
	for i := range ids {
		ids[i] = fmt.Sprintf("s%05d", i)
		st.UpdateSession(ids[i], func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0" })
	}
	must(t, st.Flush(ctx))
	rng := rand.New(rand.NewPCG(3, 4))
	maxKeys, maxEntries := 0, 0
	for round := range 60 {
		touch := func(id string) {
			st.UpdateSession(id, func(r *kvcv1.SessionRecord) { r.Turn++; r.LastSeenUnixMs = time.Now().UnixMilli() })
		}
		for i := range hot {
			touch(ids[i])
		}
		for range 300 + rng.IntN(600) {
			touch(ids[hot+rng.IntN(sessions-hot)])
		}
		if round%10 == 9 { // some sessions written in full: their entries die
			for range 200 {
				st.UpdateSession(ids[rng.IntN(sessions)], func(r *kvcv1.SessionRecord) { r.Generation++ })
			}
		}
		st.flushDirtyPaced(ctx, 0)
		must(t, f.term.batcher.Flush(ctx))

		batches, bytes := journalBatches(t, f.store)
		st.mu.Lock()
		live := 0
		for _, e := range st.sessions {
			if e.jseq() != 0 {
				live++
			}
		}
		nkeys, jbytes := len(st.jr.keys), st.jr.bytes
		st.mu.Unlock()
		entries := 0
		for _, b := range batches {
			entries += len(b.GetEntries())
		}
		if nkeys != len(batches) || jbytes != bytes {
			t.Fatalf("round %d: state tracks %d keys / %d bytes, etcd holds %d / %d", round, nkeys, jbytes, len(batches), bytes)
		}
		// Before a flush every key is at least half live (or the one small key); the flush
		// adds its own keys and kills at most as many old entries as it writes.
		if entries > 3*live+2*per || len(batches) > live/(per/4)+live/per+3 {
			t.Fatalf("round %d: %d keys, %d entries, %d bytes for %d live sessions", round, len(batches), entries, bytes, live)
		}
		maxKeys, maxEntries = max(maxKeys, len(batches)), max(maxEntries, entries)
	}
	t.Logf("journal over 60 rounds: at most %d keys, %d entries for %d sessions", maxKeys, maxEntries, sessions)
	if maxEntries > 3*sessions {
		t.Fatalf("journal grew to %d entries for %d sessions", maxEntries, sessions)
	}
	view := loadedView(t, f.store)
	for _, id := range ids {
		mem, _ := st.Session(id)
		if !proto.Equal(view[id], mem) {
			t.Fatalf("%s: a new leader would load %v, memory %v", id, view[id], mem)
		}
	}
	// Every session expires: no journal key is left.
	if n := st.ExpireIdle(time.Now().Add(48 * time.Hour)); n != sessions {
		t.Fatalf("expired %d", n)
	}
	must(t, st.Flush(ctx))
	if n := journalKeys(t, f.store); n != 0 {
		t.Fatalf("%d journal keys left after every session expired", n)
	}
}

// TestJournalNegativeFlush: a leader with VolatileFlush < 0 (no journal) loads a journal left
// by a previous leader, writes those sessions in full and deletes the keys.
func TestJournalNegativeFlush(t *testing.T) {
	f := newFixture(t, Config{NodeID: "cp-1", FlushDelay: 5 * time.Millisecond, VolatileFlush: time.Hour})
	st, ctx := f.st, t.Context()
	for i := range 10 {
		id := fmt.Sprint("s", i)
		st.UpdateSession(id, func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0" })
		st.UpdateSession(id, func(r *kvcv1.SessionRecord) { r.Turn = int32(10 + i) })
	}
	st.EndTerm(f.term)
	must(t, f.sess.Close())
	if n := journalKeys(t, f.store); n != 1 {
		t.Fatalf("%d journal keys after EndTerm, want 1", n)
	}
	f2 := leadOn(t, f.store, Config{NodeID: "cp-2", FlushDelay: 5 * time.Millisecond, VolatileFlush: -1})
	f2.st.UpdateSession("s3", func(r *kvcv1.SessionRecord) { r.Turn = 99 }) // at once, in full
	must(t, f2.st.Flush(ctx))
	if n := journalKeys(t, f.store); n != 0 {
		t.Fatalf("%d journal keys left by a leader without journal", n)
	}
	for i := range 10 {
		id := fmt.Sprint("s", i)
		want := int32(10 + i)
		if i == 3 {
			want = 99
		}
		if rec, ok, err := f.store.GetSession(ctx, id); err != nil || !ok || rec.GetTurn() != want {
			t.Fatalf("%s in etcd: %v %v %v, want turn %d", id, rec, ok, err, want)
		}
	}
}

// FuzzApplyJournal: any journal value (etcd is not trusted to hold what this leader wrote)
// applies without a panic and leaves consistent bookkeeping.
func FuzzApplyJournal(f *testing.F) {
	seed, _ := proto.Marshal(&kvcv1.VolatileBatch{Seq: 3, Epoch: 2, Entries: []*kvcv1.VolatileEntry{
		{SessionId: "a", Turn: 4, DRejects: map[string]int32{"d": 1}}, {SessionId: "zz"}, {SessionId: "a", Turn: -1}}})
	f.Add(seed, uint64(3), uint64(1))
	f.Add([]byte{}, uint64(0), uint64(0))
	f.Add([]byte{0x1a, 0x03, 0x0a, 0x01, 'b'}, uint64(9), uint64(9))
	f.Add(seed, uint64(1<<63+1), uint64(1<<63))
	f.Fuzz(func(t *testing.T, v []byte, seq, recSeq uint64) {
		b := &kvcv1.VolatileBatch{}
		if proto.Unmarshal(v, b) != nil {
			return
		}
		b.Seq = seq
		st := New(Config{})
		st.mu.Lock()
		defer st.mu.Unlock()
		snap := &kvstore.Snapshot{Volatile: []*kvcv1.VolatileBatch{b, {Seq: seq + 1}}}
		for _, id := range []string{"a", "b"} {
			snap.Sessions = append(snap.Sessions, &kvcv1.SessionRecord{SessionId: id, VolatileSeq: recSeq})
		}
		st.loadSessionsLocked(snap)
		live := map[uint64]int{}
		for _, e := range st.sessions {
			if e.jseq() != 0 {
				live[e.jseq()]++
			}
		}
		for seq, k := range st.jr.keys {
			if k.live != live[seq] || k.live <= 0 {
				t.Fatalf("key %d: live %d, sessions pointing at it %d", seq, k.live, live[seq])
			}
		}
		var want uint64 // the largest valid seq loaded, from keys or records
		for _, v := range []uint64{seq, seq + 1, recSeq} {
			if v < dirtyBit {
				want = max(want, v)
			}
		}
		if len(st.jr.keys) != len(live) || st.jr.seq != want {
			t.Fatalf("keys %d, live keys %d, seq %d", len(st.jr.keys), len(live), st.jr.seq)
		}
	})
}

// BenchmarkJournalKey is one journal key of journalMaxEntries dirty sessions written under
// the state lock (what one step of the paced flush holds the lock for).
func BenchmarkJournalKey(b *testing.B) {
	f := newFixture(b, Config{VolatileFlush: time.Hour})
	st, term := f.st, f.term
	ids := make([]string, journalMaxEntries)
	for i := range ids {
		ids[i] = fmt.Sprintf("sess-%06d", i)
		st.UpdateSession(ids[i], func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0"; r.Turn = 3; r.KvCommittedLen = 40_000 })
	}
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		st.mu.Lock()
		for _, id := range ids {
			e := st.sessions[id]
			e.rec.Turn++
			e.rec.LastSeenUnixMs = time.Now().UnixMilli()
			st.markDirtyLocked(id, e)
		}
		b.StartTimer()
		if _, n := st.journalLocked(ids); n != len(ids) {
			b.Fatalf("wrote %d", n)
		}
		b.StopTimer()
		clear(st.dirty)
		st.dirty = st.dirty[:0]
		st.mu.Unlock()
		if err := term.batcher.Flush(b.Context()); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(st.jr.bytes)/float64(len(st.jr.keys))/journalMaxEntries, "journal-bytes/session")
}

// TestJournalContentChainCost: the content chain (SessionRecord.content_chain, ~450 bytes for
// a 32K-token session in 64-token pages) rides in the journal with kv_committed_len — a turn
// is still no record write — and what that costs in etcd: journal keys fill by bytes
// (journalMaxBytes) instead of by entries. A new leader gets each session's latest chain.
func TestJournalContentChainCost(t *testing.T) {
	const sessions, chainBytes = 2_000, 450
	f := newFixture(t, Config{NodeID: "cp-1", FlushDelay: 5 * time.Millisecond, VolatileFlush: time.Hour})
	st, ctx := f.st, t.Context()
	for i := range sessions {
		st.UpdateSession(fmt.Sprintf("sess-%06d", i), func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d0"; r.KvCommittedLen = 1_000 })
	}
	must(t, st.Flush(ctx))
	chain := func(i, turn int) []byte {
		b := bytes.Repeat([]byte{byte(turn)}, chainBytes)
		b[0], b[1] = byte(i), byte(i>>8)
		return b
	}
	var without, with int
	for turn, withChain := range []bool{false, true} {
		before := journalWrites(t, st)
		for i := range sessions {
			st.UpdateSession(fmt.Sprintf("sess-%06d", i), func(r *kvcv1.SessionRecord) {
				r.KvCommittedLen += 300
				r.Turn++
				if withChain {
					r.ContentChain = chain(i, turn)
				}
			})
		}
		must(t, st.Flush(ctx))
		keys := journalWrites(t, st) - before
		_, size := journalBatches(t, f.store)
		t.Logf("chain %v: %d sessions → %d journal keys, %d bytes in etcd (%.0f per session)", withChain, sessions, keys, size, float64(size)/sessions)
		if withChain {
			with = keys
		} else {
			without = keys
		}
	}
	if rec, _, err := f.store.GetSession(ctx, "sess-000977"); err != nil || rec.GetKvCommittedLen() != 1_000 || len(rec.GetContentChain()) != 0 {
		t.Fatalf("the record in etcd was rewritten by volatile turns: %v, %v", rec, err)
	}
	// ~480 bytes per entry: keys fill at journalMaxBytes, not journalMaxEntries.
	if want := sessions * (chainBytes + 30) / journalMaxBytes; with < want || with > want+2 || without > 2 {
		t.Fatalf("journal keys: %d with chains (want about %d), %d without", with, want, without)
	}
	// A crash of this leader: the next one loads each session's latest chain.
	_ = f.sess.Close()
	g := leadOn(t, f.store, Config{NodeID: "cp-2"})
	for _, i := range []int{0, 977, sessions - 1} {
		rec, ok := g.st.Session(fmt.Sprintf("sess-%06d", i))
		if !ok || !bytes.Equal(rec.ContentChain, chain(i, 1)) || rec.KvCommittedLen != 1_600 {
			t.Fatalf("session %d loaded %v", i, rec)
		}
	}
}
