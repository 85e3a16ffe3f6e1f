package tokenizer

// Encoded is a text's ids (Encode(text, false)) with the cuts at which the encoding is
// concatenative: the starts of the segments the text splits into on added tokens matched on
// the raw text, and its end. Everything after that split — normalization, normalized added tokens,
// pre-tokenization, BPE — works on one segment at a time (appendEncode), and the split of a
// text's prefix that ends at one of its cuts is the same split's prefix (leftmost-longest
// matching only looks forward; a match, lstrip or rstrip that crossed the cut would have made
// it no cut). So for every cut c of text: Encode(text) == Encode(text[:c]) ++ Encode(text[c:]),
// whatever the normalizer or pre-tokenizer — which is what EncodeReuse relies on. The
// post-processor's tokens (addSpecial) are not part of an Encoded.
//
// An Encoded is immutable once returned; share it freely.
type Encoded struct {
	// Text is the encoded text.
	Text string
	// IDs is Encode(Text, false).
	IDs []uint32

	cuts []encCut // ascending by at; the first is {0, 0}
}

// encCut is a cut of an Encoded's text: its byte offset and the number of ids before it.
// An Encoded's cuts end with {len(Text), len(IDs)}.
type encCut struct{ at, ids int }

// Size is the memory an Encoded holds, in bytes (for caches bounded by bytes).
func (e *Encoded) Size() int64 {
	if e == nil {
		return 0
	}
	return int64(len(e.Text)) + 4*int64(cap(e.IDs)) + 16*int64(cap(e.cuts)) + 64
}

// Cuts is the number of cuts of the text (segment starts on raw added tokens, and the end).
func (e *Encoded) Cuts() int { return len(e.cuts) }

// EncodeReuse encodes text as Encode(text, false) does, reusing prev's ids up to the longest
// cut that prev's text and text share byte for byte and that is a cut of both; only the rest
// is encoded. It returns the encoding and the number of ids taken from prev (0 when prev is nil
// or shares no cut past 0). The result equals Encode(text, false) exactly; prev is not
// modified and the result does not alias it.
func (t *Tokenizer) EncodeReuse(text string, prev *Encoded) (*Encoded, int) {
	return t.encodeReuse(text, prev, nil)
}

// encodeReuse is EncodeReuse under l (nil: unbounded; limit.go).
func (t *Tokenizer) encodeReuse(text string, prev *Encoded, l *limiter) (*Encoded, int) {
	sc := scratchPool.Get().(*encodeScratch)
	sc.lim, sc.bpe.lim = l, l
	defer func() { sc.lim, sc.bpe.lim = nil, nil; putScratch(sc) }()
	segs := t.rawAdded.split(text, sc.segs[:0])
	defer func() { sc.segs = segs }()

	// The cuts of text are its segment starts and its end. Reuse up to the last of them that
	// lies within the common byte prefix and is a cut of prev too: up to there both texts
	// split alike, so prev's ids and cuts before it are text's.
	from, at, reuse, pj := 0, 0, 0, 0 // segment to encode from, its offset, ids reused, prev cuts kept
	if prev != nil && len(prev.cuts) > 0 {
		l := commonPrefix(prev.Text, text)
		off, j := 0, 0
		for k := 0; k <= len(segs) && off <= l; k++ {
			for j < len(prev.cuts) && prev.cuts[j].at < off {
				j++
			}
			if j < len(prev.cuts) && prev.cuts[j].at == off {
				from, at, reuse, pj = k, off, prev.cuts[j].ids, j
			}
			if k < len(segs) {
				off += len(segs[k].text)
			}
		}
	}
	out := &Encoded{Text: text, cuts: make([]encCut, 0, len(segs)+1)}
	ids := make([]uint32, 0, reuse+(len(text)-at)/3+4)
	if reuse > 0 {
		ids = append(ids, prev.IDs[:reuse]...)
		out.cuts = append(out.cuts, prev.cuts[:pj]...)
	} else {
		from, at = 0, 0
	}
	for _, sg := range segs[from:] {
		if l.stop(len(ids)) {
			break
		}
		out.cuts = append(out.cuts, encCut{at: at, ids: len(ids)})
		ids = t.encodeSegment(ids, sg, sc)
		at += len(sg.text)
	}
	out.cuts = append(out.cuts, encCut{at: at, ids: len(ids)}) // the end
	out.IDs = ids
	return out, reuse
}

// encodeSegment appends the ids of one segment of the raw added-token split (appendEncode's
// loop body).
func (t *Tokenizer) encodeSegment(dst []uint32, sg segment, sc *encodeScratch) []uint32 {
	if sg.isAdded {
		return append(dst, sg.id)
	}
	normed := t.norm.apply(sg.text)
	segs2 := t.normAdded.split(normed, sc.segs2[:0])
	for _, sg2 := range segs2 {
		if sg2.isAdded {
			dst = append(dst, sg2.id)
			continue
		}
		dst = t.encodeText(dst, sg2.text, sc)
	}
	sc.segs2 = segs2
	return dst
}

// commonPrefix is the length of the longest common byte prefix of a and b.
func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	// Compare 64-byte blocks as strings (memequal), then bytes.
	i := 0
	for i+64 <= n && a[i:i+64] == b[i:i+64] {
		i += 64
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}
