package tokenizer

import (
	"sort"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"
)

// Character classes the pre-tokenizer regexes use (Oniguruma / Unicode semantics, which is
// what Hugging Face `tokenizers` runs): \p{L}, \p{N}, \p{M}, \p{P}, \p{S}, \s, [\r\n].
const (
	cL  uint8 = 1 << iota // letter
	cN                    // number
	cM                    // mark
	cP                    // punctuation
	cS                    // symbol
	cWS                   // white space (\s: the Unicode White_Space property)
	cNL                   // '\r' or '\n'
)

var (
	bmpOnce    sync.Once
	bmpClass   []uint8    // class bits for every rune of the Basic Multilingual Plane
	asciiClass [128]uint8 // the ASCII part, as an array (no bounds checks on the hot path)
)

// classRange is a run of code points with the same class bits.
type classRange struct {
	lo, hi rune
	bits   uint8
}

func initClasses() {
	bmpOnce.Do(func() {
		t := make([]uint8, 0x10000)
		for r := 0; r < len(t); r++ {
			t[r] = slowClass(rune(r))
		}
		bmpClass = t
		copy(asciiClass[:], t[:128])
	})
}

// slowClass is the class of r as the HF regex engine sees it: Go's unicode tables, corrected
// by hfClassOverrides (code points Go's Unicode version does not know yet).
func slowClass(r rune) uint8 {
	if r >= hfClassOverrides[0].lo && r <= hfClassOverrides[len(hfClassOverrides)-1].hi {
		i := sort.Search(len(hfClassOverrides), func(i int) bool { return hfClassOverrides[i].hi >= r })
		if i < len(hfClassOverrides) && hfClassOverrides[i].lo <= r {
			return hfClassOverrides[i].bits
		}
	}
	var c uint8
	switch {
	case unicode.IsLetter(r):
		c |= cL
	case unicode.IsNumber(r):
		c |= cN
	case unicode.IsMark(r):
		c |= cM
	case unicode.IsPunct(r):
		c |= cP
	case unicode.IsSymbol(r):
		c |= cS
	}
	if unicode.IsSpace(r) {
		c |= cWS
	}
	if r == '\r' || r == '\n' {
		c |= cNL
	}
	return c
}

// at decodes the rune at s[i] and returns its class and width.
func at(s string, i int) (uint8, int) {
	if b := s[i]; b < utf8.RuneSelf {
		return asciiClass[b], 1
	}
	r, w := utf8.DecodeRuneInString(s[i:])
	if r < 0x10000 {
		return bmpClass[r], w
	}
	return slowClass(r), w
}

// matcher is one pre-tokenizer regex: matchAt returns the end of the leftmost-first match
// that starts exactly at i, or -1 when the regex matches nothing there.
type matcher interface {
	matchAt(s string, i int) int
}

// skipper is implemented by matchers that can jump to the next position where a match may
// start (every position before it is known not to match).
type skipper interface {
	next(s string, i int) int
}

// splitIsolated is Split{behavior: Isolated, invert: false}: every match and every gap
// between matches becomes its own piece, in order (Rust regex find_iter semantics).
func splitIsolated(m matcher, s string, dst []string) []string {
	gap := 0
	sk, canSkip := m.(skipper)
	for i := 0; i < len(s); {
		if canSkip {
			if i = sk.next(s, i); i >= len(s) {
				break
			}
		}
		if e := m.matchAt(s, i); e > i {
			if gap < i {
				dst = append(dst, s[gap:i])
			}
			dst = append(dst, s[i:e])
			i, gap = e, e
			continue
		}
		_, w := at(s, i)
		i += w
	}
	if gap < len(s) {
		dst = append(dst, s[gap:])
	}
	return dst
}

// whitespace returns the end of the run of \s starting at i (i when s[i] is not \s), the
// end just after the run's last '\r' or '\n' (-1 when the run has none) and the start of the
// run's last rune.
func whitespace(s string, i int) (end, afterNL, lastStart int) {
	end, afterNL, lastStart = i, -1, i
	for end < len(s) {
		c, w := at(s, end)
		if c&cWS == 0 {
			break
		}
		lastStart = end
		end += w
		if c&cNL != 0 {
			afterNL = end
		}
	}
	return end, afterNL, lastStart
}

// matchSpaceTail matches the regex tail every supported pattern ends with:
//
//	\s*[\r\n]+ | \s+(?!\S) | \s+
func matchSpaceTail(s string, i int) int {
	end, afterNL, lastStart := whitespace(s, i)
	if end == i {
		return -1
	}
	if afterNL > 0 { // \s*[\r\n]+ backtracks to the run's last newline
		return afterNL
	}
	if end == len(s) { // \s+(?!\S) at the end of the text takes the whole run
		return end
	}
	if lastStart > i { // \s+(?!\S): leave the last space for the next token
		return lastStart
	}
	return end // \s+
}

// contraction matches (?i:'s|'t|'re|'ve|'m|'ll|'d) (or the case-sensitive GPT-2 variant)
// with s[i] == '\”. Case folding follows Unicode simple folding: 'ſ' (U+017F) folds to 's'
// and 'K' (U+212A, Kelvin) to 'k', which no contraction uses.
func contraction(s string, i int, fold bool) int {
	j := i + 1
	if j >= len(s) {
		return -1
	}
	lower := func(b byte) byte {
		if fold && b >= 'A' && b <= 'Z' {
			return b + 'a' - 'A'
		}
		return b
	}
	c := lower(s[j])
	switch c {
	case 's', 't', 'm', 'd':
		return j + 1
	case 'r', 'v', 'l':
		if j+1 < len(s) {
			want := byte('e')
			if c == 'l' {
				want = 'l'
			}
			if lower(s[j+1]) == want {
				return j + 2
			}
		}
	}
	if fold && len(s) >= j+2 && s[j] == 0xC5 && s[j+1] == 0xBF { // ſ
		return j + 2
	}
	return -1
}

// run consumes runes whose class intersects mask, starting at i; it returns the end.
func run(s string, i int, mask uint8) int {
	for i < len(s) {
		if b := s[i]; b < utf8.RuneSelf {
			if asciiClass[b]&mask == 0 {
				break
			}
			i++
			continue
		}
		c, w := at(s, i)
		if c&mask == 0 {
			break
		}
		i += w
	}
	return i
}

// cl100kFamily covers the pattern shared by Qwen2/Qwen3, Llama-3 (cl100k) and Qwen3.5:
//
//	(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?LETTERS+|\p{N}{1,NUMMAX}| ?[^\s\p{L}\p{N}EXTRA]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//
// with LETTERS = \p{L} (or [\p{L}\p{M}] for Qwen3.5) and EXTRA = "" (or \p{M}).
type cl100kFamily struct {
	letters uint8 // classes of the letter run
	other   uint8 // classes excluded from the punctuation run (besides \s)
	numMax  int
}

func (p cl100kFamily) matchAt(s string, i int) int {
	if s[i] == '\'' {
		if e := contraction(s, i, true); e > 0 {
			return e
		}
	}
	c, w := at(s, i)
	// [^\r\n\p{L}\p{N}]?LETTERS+
	if c&(cNL|cL|cN) == 0 && i+w < len(s) {
		if c2, _ := at(s, i+w); c2&p.letters != 0 {
			return run(s, i+w, p.letters)
		}
	}
	if c&p.letters != 0 {
		return run(s, i, p.letters)
	}
	// \p{N}{1,numMax}
	if c&cN != 0 {
		j := i
		for k := 0; k < p.numMax && j < len(s); k++ {
			cj, wj := at(s, j)
			if cj&cN == 0 {
				break
			}
			j += wj
		}
		return j
	}
	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	j := i
	if s[j] == ' ' {
		j++
	}
	if e := run2(s, j, p.other|cWS); e > j {
		for e < len(s) && (s[e] == '\r' || s[e] == '\n') {
			e++
		}
		return e
	}
	return matchSpaceTail(s, i)
}

// run2 consumes runes whose class does NOT intersect excl.
func run2(s string, i int, excl uint8) int {
	for i < len(s) {
		if b := s[i]; b < utf8.RuneSelf {
			if asciiClass[b]&excl != 0 {
				break
			}
			i++
			continue
		}
		c, w := at(s, i)
		if c&excl != 0 {
			break
		}
		i += w
	}
	return i
}

// gpt2 is the ByteLevel pre-tokenizer's own regex (use_regex: true):
//
//	's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
type gpt2 struct{}

func (gpt2) matchAt(s string, i int) int {
	if s[i] == '\'' {
		if e := contraction(s, i, false); e > 0 {
			return e
		}
	}
	j := i
	if s[j] == ' ' {
		j++
	}
	if j < len(s) {
		c, _ := at(s, j)
		switch {
		case c&cL != 0:
			return run(s, j, cL)
		case c&cN != 0:
			return run(s, j, cN)
		}
		if e := run2(s, j, cL|cN|cWS); e > j {
			return e
		}
	}
	end, _, lastStart := whitespace(s, i)
	switch {
	case end == i:
		return -1
	case end == len(s):
		return end
	case lastStart > i:
		return lastStart
	}
	return end
}

// numbers is \p{N}{1,max}.
type numbers struct{ max int }

func (p numbers) matchAt(s string, i int) int {
	j := i
	for k := 0; k < p.max && j < len(s); k++ {
		c, w := at(s, j)
		if c&cN == 0 {
			break
		}
		j += w
	}
	if j == i {
		return -1
	}
	return j
}

// next skips ASCII bytes that are not digits (every non-ASCII rune may be a \p{N}).
func (numbers) next(s string, i int) int {
	for i < len(s) && s[i] < utf8.RuneSelf && (s[i] < '0' || s[i] > '9') {
		i++
	}
	return i
}

// deepseekCJK is [\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+.
type deepseekCJK struct{}

func isDeepseekCJK(r rune) bool {
	return (r >= 0x4e00 && r <= 0x9fa5) || (r >= 0x3040 && r <= 0x309f) || (r >= 0x30a0 && r <= 0x30ff)
}

// next skips to the next byte that can start a rune of the three ranges (0xE3..0xE9 lead bytes).
func (deepseekCJK) next(s string, i int) int {
	for i < len(s) && (s[i] < 0xE3 || s[i] > 0xE9) {
		i++
	}
	return i
}

func (deepseekCJK) matchAt(s string, i int) int {
	j := i
	for j < len(s) && s[j] >= utf8.RuneSelf {
		r, w := utf8.DecodeRuneInString(s[j:])
		if !isDeepseekCJK(r) {
			break
		}
		j += w
	}
	if j == i {
		return -1
	}
	return j
}

// deepseekMain is DeepSeek-V3/V4's third split:
//
//	[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
type deepseekMain struct{}

func isASCIIPunct(b byte) bool {
	return (b >= '!' && b <= '/') || (b >= ':' && b <= '@') || (b >= '[' && b <= '`') || (b >= '{' && b <= '~')
}

func isASCIILetter(b byte) bool { return (b|0x20) >= 'a' && (b|0x20) <= 'z' }

func (deepseekMain) matchAt(s string, i int) int {
	if isASCIIPunct(s[i]) && i+1 < len(s) && isASCIILetter(s[i+1]) {
		j := i + 2
		for j < len(s) && isASCIILetter(s[j]) {
			j++
		}
		return j
	}
	c, w := at(s, i)
	if c&(cNL|cL|cP|cS) == 0 && i+w < len(s) {
		if c2, _ := at(s, i+w); c2&(cL|cM) != 0 {
			return run(s, i+w, cL|cM)
		}
	}
	if c&(cL|cM) != 0 {
		return run(s, i, cL|cM)
	}
	j := i
	if s[j] == ' ' {
		j++
	}
	if e := run(s, j, cP|cS); e > j {
		for e < len(s) && (s[e] == '\r' || s[e] == '\n') {
			e++
		}
		return e
	}
	return matchSpaceTail(s, i)
}

// Regexes this package implements, as they are written in tokenizer.json files.
const (
	reQwen2  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	reLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	reQwen35 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	reGPT2   = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	reDSNum  = `\p{N}{1,3}`
	reDSCJK  = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
	reDSMain = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|" + `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// lookupRegex finds the hand-written matcher of a Split pattern. Patterns are compared after
// writing literal CR and LF characters as the escapes \r and \n (tokenizer.json files use both).
func lookupRegex(pattern string) (matcher, bool) {
	pattern = strings.NewReplacer("\r", `\r`, "\n", `\n`).Replace(pattern)
	m, ok := knownRegexes[pattern]
	return m, ok
}

// knownRegexes maps a Split pattern to its hand-written matcher.
var knownRegexes = map[string]matcher{
	reQwen2:  cl100kFamily{letters: cL, other: cL | cN, numMax: 1},
	reLlama3: cl100kFamily{letters: cL, other: cL | cN, numMax: 3},
	reQwen35: cl100kFamily{letters: cL | cM, other: cL | cM | cN, numMax: 1},
	reGPT2:   gpt2{},
	reDSNum:  numbers{max: 3},
	reDSCJK:  deepseekCJK{},
	reDSMain: deepseekMain{},
}
