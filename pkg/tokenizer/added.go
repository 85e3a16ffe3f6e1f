package tokenizer

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of tokenizer.json's added_tokens: matched in the text before any
// normalization or pre-tokenization and emitted as its id.
type addedToken struct {
	content    string
	id         uint32
	lstrip     bool
	rstrip     bool
	normalized bool
}

// addedSet finds added tokens leftmost-longest (Hugging Face uses Aho-Corasick with
// MatchKind::LeftmostLongest).
type addedSet struct {
	first [256]bool
	byte0 [256][]addedToken // candidates by first byte, longest first
	empty bool
}

func newAddedSet(toks []addedToken, normalized bool) *addedSet {
	s := &addedSet{empty: true}
	for _, t := range toks {
		if t.normalized != normalized {
			continue
		}
		b := t.content[0]
		s.first[b] = true
		s.byte0[b] = append(s.byte0[b], t)
		s.empty = false
	}
	return s
}

// segment is a piece of the input: either an added token (isAdded) or text to encode.
type segment struct {
	text    string
	id      uint32
	isAdded bool
}

// split cuts text into added tokens and the text between them, appending to dst.
func (s *addedSet) split(text string, dst []segment) []segment {
	if s.empty {
		return append(dst, segment{text: text})
	}
	startOffset := 0
	for i := 0; i < len(text); i++ {
		if !s.first[text[i]] {
			continue
		}
		var hit *addedToken
		for k := range s.byte0[text[i]] {
			if c := &s.byte0[text[i]][k]; strings.HasPrefix(text[i:], c.content) {
				hit = c
				break
			}
		}
		if hit == nil {
			continue
		}
		start, stop := i, i+len(hit.content)
		if hit.lstrip {
			start = max(startOffset, i-trailingSpace(text[:i]))
		}
		if hit.rstrip {
			stop += leadingSpace(text[stop:])
		}
		if startOffset < start {
			dst = append(dst, segment{text: text[startOffset:start]})
		}
		dst = append(dst, segment{text: text[start:stop], id: hit.id, isAdded: true})
		startOffset = stop
		i = stop - 1
	}
	if startOffset < len(text) {
		dst = append(dst, segment{text: text[startOffset:]})
	}
	return dst
}

func trailingSpace(s string) int {
	n := len(s)
	for n > 0 {
		r, w := utf8.DecodeLastRuneInString(s[:n])
		if !unicode.IsSpace(r) {
			break
		}
		n -= w
	}
	return len(s) - n
}

func leadingSpace(s string) int {
	n := 0
	for n < len(s) {
		r, w := utf8.DecodeRuneInString(s[n:])
		if !unicode.IsSpace(r) {
			break
		}
		n += w
	}
	return n
}
