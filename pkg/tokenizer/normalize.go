package tokenizer

import (
	"sort"
	"strings"
	"sync"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// normForm is the Unicode normalization a tokenizer.json configures (none, NFC or NFKC).
type normForm uint8

const (
	normNone normForm = iota
	normNFC
	normNFKC
)

// apply normalizes s as HF's normalizer does. HF's normalization tables are older than
// golang.org/x/text's: code points it does not know (hfNFCInert / hfNFKCInert) stay as they
// are and, having combining class 0, split the text into independently normalized runs.
func (f normForm) apply(s string) string {
	var form norm.Form
	var inert []classRange
	switch f {
	case normNFC:
		form, inert = norm.NFC, hfNFCInert[:]
	case normNFKC:
		form, inert = norm.NFKC, hfNFKCInert[:]
	default:
		return s
	}
	if isASCII(s) {
		return s
	}
	cut := -1
	for i, r := range s {
		if r >= inert[0].lo && isInert(f, inert, r) {
			cut = i
			break
		}
	}
	if cut < 0 {
		if form.IsNormalString(s) {
			return s
		}
		return form.String(s)
	}
	var b strings.Builder
	start := 0
	for i := cut; i < len(s); {
		r, w := utf8.DecodeRuneInString(s[i:])
		if r >= inert[0].lo && isInert(f, inert, r) {
			b.WriteString(form.String(s[start:i]))
			b.WriteString(s[i : i+w])
			start = i + w
		}
		i += w
	}
	b.WriteString(form.String(s[start:]))
	return b.String()
}

var (
	inertOnce sync.Once
	inertBMP  [3][0x10000 / 64]uint64 // per normForm: bit r set when r < 0x10000 is inert
)

func isInert(f normForm, rs []classRange, r rune) bool {
	if r < 0x10000 {
		inertOnce.Do(func() {
			for _, x := range []struct {
				f  normForm
				rs []classRange
			}{{normNFC, hfNFCInert[:]}, {normNFKC, hfNFKCInert[:]}} {
				for _, cr := range x.rs {
					for c := cr.lo; c <= cr.hi && c < 0x10000; c++ {
						inertBMP[x.f][c/64] |= 1 << (c % 64)
					}
				}
			}
		})
		return inertBMP[f][r/64]&(1<<(r%64)) != 0
	}
	return inRanges(rs, r)
}

func inRanges(rs []classRange, r rune) bool {
	i := sort.Search(len(rs), func(i int) bool { return rs[i].hi >= r })
	return i < len(rs) && rs[i].lo <= r
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}
