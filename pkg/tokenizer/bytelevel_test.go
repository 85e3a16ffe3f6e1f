package tokenizer

import (
	"testing"
	"unicode"
	"unicode/utf8"
)

// Every byte maps to one printable rune and back: any byte string survives the round trip, and
// printable ASCII maps to itself (GPT-2's bytes_to_unicode).
func TestByteLevelRoundTrip(t *testing.T) {
	all := make([]byte, 256)
	for i := range all {
		all[i] = byte(i)
	}
	tests := []string{"", "hello", " leading space", "\x00\x01\xff", "naïve 日本", string(all)}
	for _, raw := range tests {
		mapped := mapByteLevel(raw)
		for _, r := range mapped {
			if !unicode.IsPrint(r) {
				t.Fatalf("mapByteLevel(%q) has unprintable rune %U", raw, r)
			}
		}
		back, ok := unmapByteLevel(mapped)
		if !ok || back != raw {
			t.Fatalf("unmapByteLevel(mapByteLevel(%q)) = %q, %v", raw, back, ok)
		}
	}
	if got := mapByteLevel("abc~!"); got != "abc~!" {
		t.Fatalf("printable ASCII mapped to %q", got)
	}
	if got := mapByteLevel(" "); got != "Ġ" {
		t.Fatalf("space mapped to %q, want Ġ", got)
	}
	if _, ok := unmapByteLevel("日"); ok {
		t.Fatal("a rune outside the byte-level alphabet unmapped")
	}
}

// mapByteLevel is the forward mapping, the inverse of unmapByteLevel.
func mapByteLevel(raw string) string {
	buf := make([]byte, 0, len(raw)*2)
	for i := 0; i < len(raw); i++ {
		buf = utf8.AppendRune(buf, byteToRune[raw[i]])
	}
	return string(buf)
}
