package kvcv1

import (
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"
)

// validateIDReference is ValidateID as it was before its ASCII fast path (two passes: UTF-8,
// then every rune).
func validateIDReference(field, v string) error {
	if v == "" {
		return fmt.Errorf("%s is required", field)
	}
	if len(v) > MaxIDLen {
		return fmt.Errorf("%s is %d bytes, longer than %d", field, len(v), MaxIDLen)
	}
	if !utf8.ValidString(v) {
		return fmt.Errorf("%s is not valid UTF-8", field)
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f || r == '/' {
			return fmt.Errorf("%s contains a forbidden character %q", field, r)
		}
	}
	return nil
}

// TestValidateIDMatchesReference: the fast path accepts and refuses exactly what the two-pass
// check does, with the same error.
func TestValidateIDMatchesReference(t *testing.T) {
	for _, v := range []string{
		"", "a", "sess-000001", "d00", "new-17", "~", " ", "a b", strings.Repeat("x", MaxIDLen),
		strings.Repeat("x", MaxIDLen+1), "a/b", "/", "tab\there", "nl\n", "del\x7f", "\x00",
		"héllo", "日本", "é/", "\xff", "a\xffb", "a/\xff", "\xc3", "\xe2\x82", "é\x01", "\u2028",
		"\u00a0", "\U0010ffff", "a\u0080b",
		// Eight bytes at a time: a forbidden byte at each position of a word, and after it.
		"abcdefg/", "/bcdefgh", "abcdefgh/", "abc\x1fefgh", "abcdefg\x7f", "\x80bcdefgh", "abcdefghijklmno\x00",
		"sess-000123", "d4f2a1b3-123456", " !\"#$%&'()*+,-.0123456789:;<=>?@AZ[\\]^_`az{|}~",
	} {
		got, want := ValidateID("session_id", v), validateIDReference("session_id", v)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("ValidateID(%q) = %v, want %v", v, got, want)
		}
	}
}

// TestPlainASCIIEveryByte: the eight-at-a-time check agrees with the byte-by-byte rule for
// every byte value at every position of ids of 1 to 17 bytes (a refusal it got wrong would
// only cost the slow path, which TestValidateIDMatchesReference cannot see).
func TestPlainASCIIEveryByte(t *testing.T) {
	for n := 1; n <= 17; n++ {
		b := []byte(strings.Repeat("a", n))
		for pos := range n {
			for c := range 256 {
				b[pos] = byte(c)
				want := c >= 0x20 && c < 0x7f && c != '/'
				if got := plainASCII(string(b)); got != want {
					t.Fatalf("plainASCII(%q) = %v, want %v", b, got, want)
				}
			}
			b[pos] = 'a'
		}
	}
}

func FuzzValidateID(f *testing.F) {
	for _, s := range []string{"sess-1", "a/b", "é", "\xff", "\x7f"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		got, want := ValidateID("id", v), validateIDReference("id", v)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("ValidateID(%q) = %v, want %v", v, got, want)
		}
	})
}

func BenchmarkValidateID(b *testing.B) {
	for b.Loop() {
		if err := ValidateID("session_id", "sess-000123"); err != nil {
			b.Fatal(err)
		}
	}
}

func TestValidateTokenIDs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		ids    []int32
		tokens int64
		want   string // "" = ok
	}{
		{"none", nil, 5, ""},
		{"exact", []int32{0, 1, 1<<31 - 1}, 3, ""},
		{"short", []int32{1, 2}, 3, "2 ids for 3 tokens"},
		{"long", []int32{1, 2, 3, 4}, 3, "4 ids for 3 tokens"},
		{"negative", []int32{1, -1, 3}, 3, "token_ids[1] = -1 is negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := ValidateTokenIDs("token_ids", tc.ids, tc.tokens)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
