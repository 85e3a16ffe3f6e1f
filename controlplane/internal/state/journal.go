package state

import (
	"bytes"
	"context"
	"slices"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// The volatile journal. A change of an existing session's volatile fields only (turn,
// last_seen_unix_ms, kv_committed_len, epoch, d_rejects, content_chain) marks the session dirty; a flush
// (every Config.VolatileFlush, on Flush and at EndTerm) writes the dirty sessions' volatile
// fields as kvc.v1.VolatileBatch values, up to journalMaxEntries sessions per key, under
// <prefix>volatile/<16-hex seq> (kvstore.Store.VolatileKey), through the term's fenced
// batcher. So a flush of 40,000 dirty sessions is about 40 puts instead of 40,000.
//
// Ordering. Every full record written carries volatile_seq = the last journal seq allocated
// (jr.seq): a journal entry applies over a record only when its key's seq is greater. Seqs
// only grow within a term, and a new leader continues after the largest seq it loaded (keys
// and records), so "greater seq" is "written later" across terms too, whatever Txn the
// batcher put the writes in.
//
// Bounding. Each session entry remembers which key holds its latest persisted volatile
// state (sessEntry.jseq); each key counts its live entries. An entry dies when the session is
// journalled again, written in full or deleted; a key whose live count reaches 0 is deleted
// (the delete is queued after the writes that superseded it). At each periodic flush, keys
// whose live fraction fell under one half, and small keys when there are several, have their
// live sessions marked dirty, so the flush carries them forward into its own keys
// (log-structured compaction) and the old keys die. The journal thus holds at most about
// twice the live entries (plus a few small keys), about 30-60 bytes per session without a
// content chain, about 0.8-2 KB with one (a 32K-token session's chain is ~750 bytes).
//
// Keys hold up to journalMaxEntries sessions (and stop growing past journalMaxBytes); a key
// with fewer than a quarter of journalMaxEntries live entries is small.
const (
	journalMaxEntries = 1024
	journalMaxBytes   = 256 << 10
)

// journal is the leader's bookkeeping of the volatile journal's keys (guarded by State.mu).
type journal struct {
	seq     uint64 // last allocated key seq
	keys    map[uint64]*jkey
	bytes   int      // value bytes of the keys held in etcd
	buf     []byte   // batch encoding scratch
	entry   []byte   // entry encoding scratch
	mapKeys []string // d_rejects key sorting scratch
	moved   []uint64 // keys that lost an entry to the key being written
}

// jkey is one journal key.
type jkey struct {
	n     int      // entries in the value
	live  int      // entries that are their session's latest persisted volatile state
	bytes int      // value size
	ids   []string // the sessions with an entry in the value (for carrying them forward)
}

func (j *journal) reset() {
	j.seq = 0
	j.keys = make(map[uint64]*jkey)
	j.bytes = 0
}

func (s *State) publishJournalLocked() {
	s.m.journalKeys.Set(float64(len(s.jr.keys)))
	s.m.journalBytes.Set(float64(s.jr.bytes))
}

// dropJournalLocked kills one live entry of key seq (0: none); the key is deleted when it
// has none left.
func (s *State) dropJournalLocked(seq uint64) {
	if seq == 0 {
		return
	}
	k := s.jr.keys[seq]
	if k == nil {
		return
	}
	if k.live--; k.live > 0 {
		return
	}
	delete(s.jr.keys, seq)
	s.jr.bytes -= k.bytes
	if s.term != nil {
		if err := s.term.batcher.Delete(s.cfg.Store.VolatileKey(seq)); err != nil {
			s.m.writeFailures.Inc()
		}
	}
	s.m.journalDeleted.Inc()
	s.publishJournalLocked()
}

// journalLocked writes one journal key with the dirty sessions among ids (in order, up to
// journalMaxEntries / journalMaxBytes). It returns how many ids it consumed and how many
// sessions it wrote (0: no key written).
func (s *State) journalLocked(ids []string) (used, n int) {
	j := &s.jr
	seq := j.seq + 1
	buf := protowire.AppendTag(j.buf[:0], 1, protowire.VarintType)
	buf = protowire.AppendVarint(buf, seq)
	buf = protowire.AppendTag(buf, 2, protowire.VarintType)
	buf = protowire.AppendVarint(buf, uint64(s.term.fence.Rev))
	var kids []string
	for used < len(ids) && n < s.cfg.journalMax && len(buf) < journalMaxBytes {
		id := ids[used]
		used++
		e, ok := s.sessions[id]
		if !ok || !e.dirty() {
			continue // written in full meanwhile, deleted, or listed twice
		}
		buf = j.appendEntry(buf, e.rec)
		if e.jseq() != 0 {
			j.moved = append(j.moved, e.jseq())
		}
		e.js = seq // not dirty
		s.sessions[id] = e
		if kids == nil {
			kids = make([]string, 0, min(len(ids)-used+1, s.cfg.journalMax))
		}
		kids = append(kids, e.rec.SessionId)
		n++
	}
	j.buf = buf
	if n == 0 {
		return used, 0
	}
	j.seq = seq
	v := bytes.Clone(buf) // the batcher keeps it until written
	if err := s.term.batcher.PutBytes(s.cfg.Store.VolatileKey(seq), v); err != nil {
		s.m.writeFailures.Inc()
	}
	j.keys[seq] = &jkey{n: n, live: n, bytes: len(v), ids: kids}
	j.bytes += len(v)
	s.m.journalWritten.Inc()
	s.m.volatileFlushed.Add(float64(n))
	for _, old := range j.moved { // deletes queued after the put that superseded them
		s.dropJournalLocked(old)
	}
	j.moved = j.moved[:0]
	s.publishJournalLocked()
	return used, n
}

// appendEntry appends rec's volatile fields as field 3 (entries) of a VolatileBatch.
func (j *journal) appendEntry(b []byte, rec *kvcv1.SessionRecord) []byte {
	e := protowire.AppendTag(j.entry[:0], 1, protowire.BytesType)
	e = protowire.AppendString(e, rec.SessionId)
	if rec.Turn != 0 {
		e = protowire.AppendTag(e, 2, protowire.VarintType)
		e = protowire.AppendVarint(e, uint64(int64(rec.Turn)))
	}
	if rec.LastSeenUnixMs != 0 {
		e = protowire.AppendTag(e, 3, protowire.VarintType)
		e = protowire.AppendVarint(e, uint64(rec.LastSeenUnixMs))
	}
	if rec.KvCommittedLen != 0 {
		e = protowire.AppendTag(e, 4, protowire.VarintType)
		e = protowire.AppendVarint(e, uint64(rec.KvCommittedLen))
	}
	if len(rec.DRejects) > 0 {
		ks := j.mapKeys[:0]
		for k := range rec.DRejects {
			ks = append(ks, k)
		}
		slices.Sort(ks)
		for _, k := range ks {
			v := rec.DRejects[k]
			size := 1 + protowire.SizeBytes(len(k))
			if v != 0 {
				size += 1 + protowire.SizeVarint(uint64(int64(v)))
			}
			e = protowire.AppendTag(e, 5, protowire.BytesType)
			e = protowire.AppendVarint(e, uint64(size))
			e = protowire.AppendTag(e, 1, protowire.BytesType)
			e = protowire.AppendString(e, k)
			if v != 0 {
				e = protowire.AppendTag(e, 2, protowire.VarintType)
				e = protowire.AppendVarint(e, uint64(int64(v)))
			}
		}
		clear(ks)
		j.mapKeys = ks[:0]
	}
	if len(rec.ContentChain) > 0 {
		e = protowire.AppendTag(e, 6, protowire.BytesType)
		e = protowire.AppendBytes(e, rec.ContentChain)
	}
	j.entry = e
	b = protowire.AppendTag(b, 3, protowire.BytesType)
	return protowire.AppendBytes(b, e)
}

// markDirtyLocked lists a session for the next journal flush.
func (s *State) markDirtyLocked(id string, e sessEntry) {
	if e.dirty() {
		return
	}
	e.js |= dirtyBit
	s.sessions[id] = e
	s.dirty = append(s.dirty, id)
}

// compactJournalLocked marks dirty the live sessions of sparse keys (live fraction under one
// half) and, when there are several, of small keys, so that the next flush carries them
// forward and those keys die. It returns how many sessions it marked.
func (s *State) compactJournalLocked() int {
	smallLive := s.cfg.journalMax / 4
	// A key is small when its live entries fill under a quarter of a key by count and by
	// bytes: with content chains (~0.7-1 KB per entry) keys fill by bytes at a few hundred
	// entries, and such a key is not small for having fewer than smallLive entries.
	isSmall := func(k *jkey) bool {
		return k.live < smallLive && k.live*k.bytes < k.n*(journalMaxBytes/4)
	}
	small := 0
	for _, k := range s.jr.keys {
		if isSmall(k) {
			small++
		}
	}
	marked := 0
	for seq, k := range s.jr.keys {
		if k.live*2 >= k.n && (small < 2 || !isSmall(k)) {
			continue
		}
		for _, id := range k.ids {
			if e, ok := s.sessions[id]; ok && e.jseq() == seq && !e.dirty() {
				s.markDirtyLocked(id, e)
				marked++
			}
		}
	}
	return marked
}

func (s *State) resetFlushingLocked() {
	clear(s.flushing)
	s.flushing, s.fpos = s.flushing[:0], 0
}

// flushDirtyLocked writes every dirty session to the journal now (Flush, EndTerm).
func (s *State) flushDirtyLocked() int {
	if s.term == nil {
		return 0
	}
	n := 0
	for s.fpos < len(s.flushing) {
		used, k := s.journalLocked(s.flushing[s.fpos:])
		s.fpos += used
		n += k
	}
	s.resetFlushingLocked()
	for pos := 0; pos < len(s.dirty); {
		used, k := s.journalLocked(s.dirty[pos:])
		pos += used
		n += k
	}
	clear(s.dirty)
	s.dirty = s.dirty[:0]
	return n
}

// flushDirtyPaced compacts the journal, then writes the dirty sessions to it one key at a
// time, spread over about spread, so that decisions are not held up behind one long critical
// section (a key of journalMaxEntries sessions takes the lock for about 0.1-0.2 ms). A session
// dirtied again meanwhile is written with its latest value (and again at the next flush).
// When ctx ends it stops; EndTerm writes what is left.
func (s *State) flushDirtyPaced(ctx context.Context, spread time.Duration) int {
	s.mu.Lock()
	if s.term == nil {
		s.mu.Unlock()
		return 0
	}
	s.compactJournalLocked()
	if s.fpos >= len(s.flushing) {
		s.resetFlushingLocked()
		s.dirty, s.flushing = s.flushing, s.dirty
	} else {
		s.flushing = append(s.flushing, s.dirty...)
		clear(s.dirty)
		s.dirty = s.dirty[:0]
	}
	keys := (len(s.flushing) - s.fpos + s.cfg.journalMax - 1) / s.cfg.journalMax
	s.mu.Unlock()
	var pause time.Duration
	if keys > 1 {
		pause = spread / time.Duration(keys)
	}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	n := 0
	for {
		s.mu.Lock()
		if s.term == nil || s.fpos >= len(s.flushing) {
			s.mu.Unlock()
			return n
		}
		used, k := s.journalLocked(s.flushing[s.fpos:])
		s.fpos += used
		n += k
		done := s.fpos >= len(s.flushing)
		if done {
			s.resetFlushingLocked()
		}
		s.mu.Unlock()
		if done {
			return n
		}
		if pause > 0 {
			timer.Reset(pause)
			select {
			case <-ctx.Done():
				return n
			case <-timer.C:
			}
		}
	}
}

// applyJournalLocked applies the loaded journal (in seq order) over the loaded sessions and
// rebuilds the bookkeeping: an entry applies when its key's seq is greater than the record's
// volatile_seq (and than any entry applied before); entries of unknown sessions are ignored.
// Keys left without a live entry are deleted. It returns the entries applied.
func (s *State) applyJournalLocked(batches []*kvcv1.VolatileBatch) int {
	applied := 0
	for _, b := range batches {
		seq := b.GetSeq()
		if seq == 0 || seq >= dirtyBit {
			continue // never allocated: not a key this code wrote
		}
		s.jr.seq = max(s.jr.seq, seq)
		k := &jkey{n: len(b.GetEntries()), bytes: proto.Size(b)}
		for _, en := range b.GetEntries() {
			e, ok := s.sessions[en.GetSessionId()]
			if !ok || seq <= e.rec.GetVolatileSeq() || seq <= e.jseq() {
				continue
			}
			rec := e.rec
			rec.Turn = en.GetTurn()
			rec.LastSeenUnixMs = en.GetLastSeenUnixMs()
			rec.KvCommittedLen = en.GetKvCommittedLen()
			rec.DRejects = en.GetDRejects()
			if len(rec.DRejects) == 0 {
				rec.DRejects = nil
			}
			rec.ContentChain = en.GetContentChain()
			if len(rec.ContentChain) == 0 {
				rec.ContentChain = nil
			}
			rec.Epoch = b.GetEpoch()
			if old := s.jr.keys[e.jseq()]; old != nil {
				old.live--
			}
			e.js = seq
			s.sessions[rec.SessionId] = e
			k.live++
			k.ids = append(k.ids, rec.SessionId)
			applied++
		}
		s.jr.keys[seq] = k
		s.jr.bytes += k.bytes
	}
	for seq, k := range s.jr.keys {
		if k.live <= 0 {
			k.live = 1
			s.dropJournalLocked(seq)
		}
	}
	s.publishJournalLocked()
	return applied
}
