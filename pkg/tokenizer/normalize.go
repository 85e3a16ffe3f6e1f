package tokenizer

import "golang.org/x/text/unicode/norm"

// normForm is the Unicode normalization a tokenizer.json configures (none, NFC or NFKC).
type normForm uint8

const (
	normNone normForm = iota
	normNFC
	normNFKC
)

func (f normForm) apply(s string) string {
	switch f {
	case normNFC:
		if isASCII(s) || norm.NFC.IsNormalString(s) {
			return s
		}
		return norm.NFC.String(s)
	case normNFKC:
		if isASCII(s) || norm.NFKC.IsNormalString(s) {
			return s
		}
		return norm.NFKC.String(s)
	}
	return s
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}
