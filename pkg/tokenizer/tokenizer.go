package tokenizer

import (
	"strings"
	"sync"
	"unicode/utf8"
)

// Tokenizer is a loaded byte-level BPE tokenizer. It is immutable and safe for concurrent use.
type Tokenizer struct {
	model     *bpe
	norm      normForm
	stages    []matcher // pre-tokenizer Split stages, applied in order
	rawAdded  *addedSet // added tokens matched on the raw text (normalized: false)
	normAdded *addedSet // added tokens matched after normalization (normalized: true)

	postPrefix, postSuffix []uint32 // TemplateProcessing "single" special tokens

	idToToken map[uint32]string // byte-level vocabulary strings and added tokens' content
	special   map[uint32]bool   // added tokens marked special
	addedIDs  map[uint32]bool   // every added token

	specialVars map[string]any // bos_token, eos_token, ... for the chat template
	chat        *chatTemplate
}

var scratchPool = sync.Pool{New: func() any { return &encodeScratch{} }}

type encodeScratch struct {
	bpe    scratch
	segs   []segment
	segs2  []segment
	pieces []string
	tmp    []string
	ids    []uint32 // Count's buffer
	lim    *limiter // EncodeContext's bound (limit.go); nil: none
}

// Encode returns the token ids of text, as Hugging Face's Tokenizer.encode(text,
// add_special_tokens=addSpecial).ids does. Added tokens (special or not) in the text are
// always recognised; addSpecial only adds the post-processor's tokens (Llama-3's BOS, say).
func (t *Tokenizer) Encode(text string, addSpecial bool) []uint32 {
	return t.AppendEncode(make([]uint32, 0, len(text)/3+4), text, addSpecial)
}

// Count returns len(Encode(text, addSpecial)) without keeping the ids.
func (t *Tokenizer) Count(text string, addSpecial bool) int {
	sc := scratchPool.Get().(*encodeScratch)
	sc.ids = t.appendEncode(sc.ids[:0], text, addSpecial, sc)
	n := len(sc.ids)
	putScratch(sc) // do not pin a huge buffer in the pool
	return n
}

// AppendEncode appends the ids of text to dst.
func (t *Tokenizer) AppendEncode(dst []uint32, text string, addSpecial bool) []uint32 {
	sc := scratchPool.Get().(*encodeScratch)
	dst = t.appendEncode(dst, text, addSpecial, sc)
	putScratch(sc)
	return dst
}

func (t *Tokenizer) appendEncode(dst []uint32, text string, addSpecial bool, sc *encodeScratch) []uint32 {
	if addSpecial {
		dst = append(dst, t.postPrefix...)
	}
	segs := t.rawAdded.split(text, sc.segs[:0])
	for _, sg := range segs {
		if sc.lim.stop(len(dst)) {
			break
		}
		if sg.isAdded {
			dst = append(dst, sg.id)
			continue
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
	}
	sc.segs = segs
	if addSpecial {
		dst = append(dst, t.postSuffix...)
	}
	return dst
}

// encodeText pre-tokenizes normalized text and BPE-encodes each piece.
func (t *Tokenizer) encodeText(dst []uint32, text string, sc *encodeScratch) []uint32 {
	if text == "" || (sc.lim != nil && sc.lim.err != nil) {
		return dst
	}
	pieces := append(sc.pieces[:0], text)
	for _, st := range t.stages {
		next := sc.tmp[:0]
		for _, p := range pieces {
			next = splitIsolated(st, p, next)
		}
		sc.tmp = pieces
		pieces = next
	}
	for _, p := range pieces {
		if sc.lim.stop(len(dst)) {
			break
		}
		dst = t.model.encodeWord(dst, p, &sc.bpe)
	}
	sc.pieces = pieces
	return dst
}

// Decode turns ids back into text (byte-level decoding; invalid UTF-8 becomes U+FFFD as in
// HF's errors="replace"). skipSpecial drops special added tokens. Unknown ids are skipped.
func (t *Tokenizer) Decode(ids []uint32, skipSpecial bool) string {
	var raw []byte
	var out strings.Builder
	flush := func() {
		out.WriteString(strings.ToValidUTF8(string(raw), "\uFFFD"))
		raw = raw[:0]
	}
	for _, id := range ids {
		s, ok := t.idToToken[id]
		if !ok || (skipSpecial && t.special[id]) {
			continue
		}
		if b, ok := unmapByteLevel(s); ok && !t.addedIDs[id] {
			raw = append(raw, b...)
			continue
		}
		flush()
		out.WriteString(s)
	}
	flush()
	return out.String()
}

// TokenID returns the id of a vocabulary entry or added token written as it appears in
// tokenizer.json (byte-level form for vocabulary entries).
func (t *Tokenizer) TokenID(token string) (uint32, bool) {
	for _, set := range []*addedSet{t.rawAdded, t.normAdded} {
		if token != "" {
			for _, a := range set.byte0[token[0]] {
				if a.content == token {
					return a.id, true
				}
			}
		}
	}
	if raw, ok := unmapByteLevel(token); ok && utf8.ValidString(token) {
		id, ok := t.model.vocab[raw]
		return id, ok
	}
	return 0, false
}

// VocabSize is the number of distinct ids (vocabulary and added tokens).
func (t *Tokenizer) VocabSize() int { return len(t.idToToken) }
