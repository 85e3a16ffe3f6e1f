package tokenizer

// byteToRune is GPT-2's bytes_to_unicode: every byte maps to a printable rune, so byte-level
// vocabularies are written as strings of those runes.
var byteToRune [256]rune

// runeToByte inverts byteToRune; runes outside the map are absent.
var runeToByte map[rune]byte

func init() {
	runeToByte = make(map[rune]byte, 256)
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			byteToRune[b] = rune(b)
		} else {
			byteToRune[b] = rune(256 + n)
			n++
		}
		runeToByte[byteToRune[b]] = byte(b)
	}
}

// unmapByteLevel turns a byte-level vocabulary string into the raw bytes it stands for. ok is
// false when the string holds a rune outside the byte-level alphabet (an added token's literal
// text, say).
func unmapByteLevel(s string) (raw string, ok bool) {
	buf := make([]byte, 0, len(s))
	for _, r := range s {
		b, found := runeToByte[r]
		if !found {
			return "", false
		}
		buf = append(buf, b)
	}
	return string(buf), true
}
