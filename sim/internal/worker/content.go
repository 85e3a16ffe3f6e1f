package worker

import (
	"context"
	"math"
	"net/http"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// contentKey is the key of kvc-sim's content pattern (kvpool.FillContent): the same on every
// kvc-sim, so KV computed for the same tokens at the same positions is the same bytes on every
// worker and in every session, as real KV of an identical prefix is.
const contentKey = 0x6b76632d73696d

// rankKey is the content key of tensor-parallel rank r's shard: rank 0's (and a worker without
// tensor parallelism's) is contentKey; every other rank's differs, so KV that reaches a rank
// from another rank's shard fails verification, as a mis-paired transfer would be garbage.
func rankKey(r int32) uint64 {
	if r <= 0 {
		return contentKey
	}
	return contentKey ^ (uint64(r) * 0x9e3779b97f4a7c15)
}

// synthVocab bounds the token ids kvc-sim makes up: for the positions a request gives no
// input_ids for, and for the tokens it "generates".
const synthVocab = 32000

// synthID is the token at position pos of a request without input_ids there, and the token
// kvc-sim generates at pos: a deterministic function of (seed key, position), so a client that
// sends no ids and one that sends back the generated ids see the same content.
func synthID(seed uint64, pos int64) uint32 {
	x := seed + uint64(pos+1)*0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	x ^= x >> 31
	return uint32(x % synthVocab)
}

// tokenIDs is the content of the request's KV [0, n): its input_ids where given, made-up ids
// elsewhere (positions past the input are the generated tokens).
func (p *plan) tokenIDs(n int64) []uint32 {
	out := make([]uint32, n)
	seed := kvpool.SessionSeed(p.seedKey)
	for t := int64(0); t < n; t++ {
		if t < int64(len(p.ids)) {
			out[t] = p.ids[t]
		} else {
			out[t] = synthID(seed, t)
		}
	}
	return out
}

// content returns the ids of tokens [0, n) of the turn's KV, growing the cache as needed.
func (t *turn) content(n int64) []uint32 {
	if int64(len(t.ids)) < n {
		t.ids = t.p.tokenIDs(max(n, t.p.input+t.p.maxNew))
	}
	return t.ids[:n]
}

// fillContent writes the content pattern of tokens [from, to) of the turn into pages.
func (w *Worker) fillContent(t *turn, pages []int64, from, to int64) *apiError {
	if err := kvpool.FillContent(w.mem, rankKey(w.cfg.TPRank), t.content(to), pages, from, to); err != nil {
		w.log.Error().Err(err).Int64("from", from).Int64("to", to).Int("pages", len(pages)).Msg("fill content")
		return errf(http.StatusInternalServerError, "internal", "writing KV of tokens [%d, %d): %v", from, to, err)
	}
	return nil
}

// checkContent verifies tokens [from, to) of pages against the turn's ids in every buffer; it
// returns the bytes checked and the (token, buffer) slots that did not match.
func (w *Worker) checkContent(t *turn, pages []int64, from, to int64) (checked, bad int64, err error) {
	bad, err = kvpool.CheckContent(w.mem, rankKey(w.cfg.TPRank), t.content(to), pages, from, to)
	return (to - from) * int64(w.cfg.Geometry.Buffers()) * int64(w.cfg.Geometry.BytesPerToken), bad, err
}

// firstMismatch is the first position in [0, n) whose resident KV (buffer 0 of pages) is not
// the KV of the turn's id at that position, and the number of such positions; n and 0 when all
// verify. Buffer 0 is enough to locate a divergence (every buffer of a token is written
// together); received KV is checked in every buffer (checkContent).
func (w *Worker) firstMismatch(t *turn, pages []int64, n int64) (first, count int64) {
	first = n
	if n <= 0 {
		return first, 0
	}
	ids := t.content(n)
	l := w.mem.Layout()
	ps := int64(l.PageSize)
	tb := l.TokenBytes()
	buf := w.mem.Buffer(0)
	for pos := int64(0); pos < n; pos++ {
		off := uint64(pages[pos/ps])*l.ItemLen + uint64(pos%ps)*tb
		if !kvpool.CheckTokenContent(buf[off:off+tb], rankKey(w.cfg.TPRank), ids[pos], pos, 0) {
			if count == 0 {
				first = pos
			}
			count++
		}
	}
	return first, count
}

// reusable checks the KV the session holds, [0, upto), against this turn's prompt before it is
// reused, and returns how much of it may be kept. The control plane decides on page hashes: it
// vouches for the session's full pages [0, ⌊kv_len / page⌋·page) (and the decision's
// truncate_to already cut at the longest common prefix). The partial last page is invisible
// to it, so a divergence there (the usual chat-turn seam: a re-rendered end of the previous
// answer) is the worker's to handle: it keeps the tokens before the first mismatch. A
// divergence inside the full pages is mis-stitched KV — the control plane sent a turn to KV
// that is not a prefix of its prompt — and fails the request as kv_verify_failed: it is never
// served from mismatched KV.
func (w *Worker) reusable(t *turn, s *session, upto int64) (int64, *apiError) {
	w.mu.Lock()
	pages := append([]int64(nil), s.pages...)
	kv := s.kvLen
	w.mu.Unlock()
	first, count := w.firstMismatch(t, pages, upto)
	if count == 0 {
		return upto, nil
	}
	ps := int64(w.cfg.Geometry.PageSize)
	full := kv / ps * ps
	if first >= full {
		w.m.tailRewrites.Inc()
		return first, nil
	}
	t.meta.VerifyFailures = count * int64(w.cfg.Geometry.Buffers())
	w.m.verifyFailures.Add(float64(t.meta.VerifyFailures))
	w.m.misStitched.Inc()
	w.log.Error().Str("session", s.id).Int64("first_mismatch", first).Int64("positions", count).Int64("reused", upto).
		Msg("resident KV is not a prefix of the prompt (mis-stitched)")
	return 0, errf(http.StatusInternalServerError, "kv_verify_failed",
		"resident KV of session %q diverges from the prompt at token %d (%d of %d reused positions): not a prefix",
		s.id, first, count, upto)
}

// keptOnExtend is how much of the session it holds (kvLen tokens) a large append keeps before
// it receives the rest. Without receive_from, reusable over what the prompt covers. With it
// (from > 0, whole pages), the control plane vouches for [0, from) only: those must match
// the prompt (reusable: a mismatch there is mis-stitched KV); past them the held session is
// kept up to its first token that differs from the prompt or the prompt's end — an edited or
// compacted history whose common prefix the decision cut at from is cut back there, never an
// error.
func (w *Worker) keptOnExtend(t *turn, s *session, kvLen, from int64) (int64, *apiError) {
	upto := min(kvLen, t.p.input)
	if from <= 0 {
		return w.reusable(t, s, upto)
	}
	keep, e := w.reusable(t, s, min(from, upto))
	if e != nil || keep < from || upto <= from {
		return keep, e
	}
	w.mu.Lock()
	pages := append([]int64(nil), s.pages...)
	w.mu.Unlock()
	first, _ := w.firstMismatch(t, pages, upto)
	return max(first, from), nil
}

// truncateSession keeps only the first keep tokens of the session (a truncation the decision
// asked for, or the worker's own cut before a rewritten partial last page): the pages past them
// are freed, and the sidecar forgets the session (ReleaseSession: any snapshot push reading it
// is aborted first), because a sidecar's committed length never shrinks and its snapshot must
// not mix old and new tokens; the turn's commit registers the rewritten session anew (a new
// snapshot generation, see RouteOutcome.truncated_to).
func (w *Worker) truncateSession(t *turn, s *session, keep int64) *apiError {
	w.mu.Lock()
	committed := s.committed
	w.mu.Unlock()
	if committed {
		if err := w.release(s.id, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED); err != nil {
			return errf(http.StatusBadGateway, "internal", "truncating session %q: ReleaseSession: %v", s.id, err)
		}
		w.mu.Lock()
		s.committed = false
		w.mu.Unlock()
	}
	w.trim(s, keep)
	t.meta.TruncatedTo = keep
	w.m.truncations.Inc()
	return nil
}

// beginLocal starts a new session's first turn prefilled on this decode worker (a
// LOCAL_FIRST_TURN decision: conditional disaggregation). Like SGLang's radix cache, the worker
// reuses the longest page-aligned prefix of the prompt whose KV it already holds for another
// idle session (up to cached_tokens, the control plane's overlap): the bytes are copied into
// the new session's pages and verified against the prompt's ids (kvc-sim shares no pages
// between sessions; the copy stands for SGLang's shared radix pages), and only the rest is
// prefilled. A stale copy of the session here is replaced.
func (w *Worker) beginLocal(ctx context.Context, t *turn, need int64) *apiError {
	p := t.p
	t.local = true
	w.mu.Lock()
	old := w.sessions[p.sessionID]
	w.mu.Unlock()
	if old != nil {
		w.dropSession(old, kvcv1.ReleaseReason_RELEASE_REASON_RELEASED)
	}
	donor, reuse := w.findDonor(t, min(p.cached, p.input))
	if donor != nil {
		defer w.unpin(donor)
	}
	ta := time.Now()
	pages, ev, e := w.allocate(ctx, need, p.sessionID)
	t.meta.AllocMS += ms(time.Since(ta))
	t.meta.EvictedSessions = ev
	if e != nil {
		return e
	}
	s := &session{id: p.sessionID, pages: pages, pinned: 1}
	w.mu.Lock()
	w.touch(s)
	w.sessions[s.id] = s
	w.mu.Unlock()
	t.s = s
	if reuse > 0 {
		w.mu.Lock()
		src := append([]int64(nil), donor.pages...)
		w.mu.Unlock()
		copyTokens(w.mem, src, pages, reuse)
		_, bad, err := w.checkContent(t, pages, 0, reuse)
		if err != nil || bad > 0 {
			return errf(http.StatusInternalServerError, "kv_verify_failed", "prefix KV copied from session %q does not verify: %d bad slots, %v", donor.id, bad, err)
		}
		t.meta.PrefixCachedTokens = reuse
		w.m.prefixCachedTokens.Add(float64(reuse))
	}
	t.kv = reuse
	return w.appendPrefill(ctx, t, reuse, p.input)
}

// findDonor returns the idle resident session whose KV holds the longest page-aligned prefix
// of the turn's prompt, at most limit tokens (checked on buffer 0 against the prompt's ids),
// pinned, and that length; nil and 0 when none holds a page of it.
func (w *Worker) findDonor(t *turn, limit int64) (*session, int64) {
	ps := int64(w.cfg.Geometry.PageSize)
	limit = limit / ps * ps
	if limit <= 0 {
		return nil, 0
	}
	ids := t.content(limit)
	l := w.mem.Layout()
	tb := l.TokenBytes()
	buf := w.mem.Buffer(0)
	w.mu.Lock()
	defer w.mu.Unlock()
	var best *session
	var bestN int64
	for _, s := range w.sessions {
		if s.id == t.p.sessionID || s.pinned > 0 || s.kvLen < ps {
			continue
		}
		n := min(limit, s.kvLen/ps*ps)
		m := int64(0)
		for ; m < n; m++ {
			off := uint64(s.pages[m/ps])*l.ItemLen + uint64(m%ps)*tb
			if !kvpool.CheckTokenContent(buf[off:off+tb], rankKey(w.cfg.TPRank), ids[m], m, 0) {
				break
			}
		}
		if m = m / ps * ps; m > bestN || (m == bestN && m > 0 && s.id < best.id) {
			best, bestN = s, m
		}
	}
	if best != nil {
		w.pinLocked(best) // not evicted while its pages are copied
	}
	return best, bestN
}

// copyTokens copies the KV of tokens [0, n) from the src page list to the dst page list, every
// buffer.
func copyTokens(p kvpool.Buffers, src, dst []int64, n int64) {
	l := p.Layout()
	ps := int64(l.PageSize)
	tb := l.TokenBytes()
	for b := 0; b < l.NumBuffers(); b++ {
		buf := p.Buffer(b)
		for t := int64(0); t < n; t += ps {
			k := min(ps, n-t) * int64(tb)
			so := uint64(src[t/ps]) * l.ItemLen
			do := uint64(dst[t/ps]) * l.ItemLen
			copy(buf[do:do+uint64(k)], buf[so:so+uint64(k)])
		}
	}
}

// commitIDs are a commit's token ids (CommitSessionRequest.token_ids): the session's content,
// which its snapshot pushes carry to the prefill store so that a load elsewhere (re-homing)
// sends them back as input_ids and the loaded KV is verified against them. nil when an id is
// past the API's [0, 2^31) (a client's input_ids may reach 2^32 here): the commit then goes
// without ids, and a load of the session keeps today's unverified path.
func commitIDs(content []uint32) []int32 {
	out := make([]int32, len(content))
	for i, id := range content {
		if id > math.MaxInt32 {
			return nil
		}
		out[i] = int32(id)
	}
	return out
}
